"""Test set-up: one dtorch runtime serves the whole session (it starts on first use and stops
at exit); tests that kill processes run their program in a subprocess of their own.

``DTORCH_TEST_DEVICE=cuda`` makes the mesh fixtures (``one``, ``mesh1``, ``mesh2``, ``mesh3``)
CUDA meshes, so the tests written on them cover CUDA (``benchmarks/gpu_check.py`` runs them);
tests marked ``cuda`` run only where torch sees a GPU (as many as they ask for), and are
skipped elsewhere."""

import os

import pytest
import torch

import dtorch
from helpers import runtime_with

DEVICE = os.environ.get("DTORCH_TEST_DEVICE", "cpu")
if DEVICE not in ("cpu", "cuda"):
    raise ValueError(f"DTORCH_TEST_DEVICE must be 'cpu' or 'cuda', got {DEVICE!r}")


@pytest.fixture(scope="session")
def one():
    """The one-device mesh: dtorch is bit-identical to torch there."""
    return on_test_device(1, lambda: dtorch.DeviceMesh(DEVICE, [0]))


@pytest.fixture(scope="session")
def mesh1():
    return on_test_device(3, lambda: dtorch.DeviceMesh(DEVICE, [0, 1, 2]))


@pytest.fixture(scope="session")
def mesh2():
    return on_test_device(4, lambda: dtorch.DeviceMesh(DEVICE, [[0, 1], [2, 3]],
                                                       mesh_dim_names=["dp", "tp"]))


@pytest.fixture(scope="session")
def mesh3():
    return on_test_device(8, lambda: dtorch.init_device_mesh(DEVICE, (2, 2, 2)))


def on_test_device(devices: int, make):
    """The mesh ``make()`` builds, or a skip where ``DTORCH_TEST_DEVICE=cuda`` and the machine
    has fewer GPUs than it spans."""
    if DEVICE == "cuda":
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < devices:
            pytest.skip(f"a CUDA mesh of {devices} devices; this machine has {have}")
    return make()


def pytest_configure(config):
    config.addinivalue_line("markers", "no_runtime: the test starts no runtime, so there is no "
                                       "kernel error to check after it")
    config.addinivalue_line("markers", "cuda(n=1): needs n CUDA devices; skipped without them")


def pytest_collection_modifyitems(config, items):
    """Skips the ``cuda`` tests this machine lacks the GPUs for, saying how many it has."""
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        marker = item.get_closest_marker("cuda")
        if marker is not None:
            need = marker.kwargs.get("n", marker.args[0] if marker.args else 1)
            if have < need:
                item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA device(s), this "
                                                        f"machine has {have}"))


@pytest.fixture(autouse=True)
def _no_pending_errors(request):
    """Every test that uses the runtime starts and ends with no unreported kernel error."""
    yield
    if request.node.get_closest_marker("no_runtime") is None:
        dtorch.sync()


@pytest.fixture
def fusion_off():
    """A runtime whose hosts never compile."""
    with runtime_with(DTORCH_FUSION="0"):
        yield


@pytest.fixture
def rng():
    return torch.Generator().manual_seed(1234)
