"""Test set-up: one dtorch runtime serves the whole session (it starts on first use and stops
at exit); tests that kill processes run their program in a subprocess of their own."""

import pytest
import torch

import dtorch
from helpers import runtime_with


@pytest.fixture(scope="session")
def one():
    """The one-device mesh: dtorch is bit-identical to torch there."""
    return dtorch.DeviceMesh("cpu", [0])


@pytest.fixture(scope="session")
def mesh1():
    return dtorch.DeviceMesh("cpu", [0, 1, 2])


@pytest.fixture(scope="session")
def mesh2():
    return dtorch.DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=["dp", "tp"])


@pytest.fixture(scope="session")
def mesh3():
    return dtorch.init_device_mesh("cpu", (2, 2, 2))


def pytest_configure(config):
    config.addinivalue_line("markers", "no_runtime: the test starts no runtime, so there is no "
                                       "kernel error to check after it")


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
