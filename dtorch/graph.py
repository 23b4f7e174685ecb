"""DTorch's public module for graphs (``Graph``, ``GraphOption``, ``VoidFutureCollect``).

dtorch.Graph: a stream of operators with its own compute streams on every device, and the
defaults (mesh, dtype) of the tensors made on it.

A tensor belongs to the graph it was made on (``x.graph``), and operators on it run there, on
that graph's compute streams, so work of two graphs can run concurrently on one device
(inter-graph parallelism); collectives of all graphs share each device's communication stream,
which keeps them in one order on every device. Factories make their tensors on the graph given
as ``graph=``, else on the calling thread's current graph: the innermost ``with graph:``, else
the thread's own default graph (``Graph.default_graph()``; the importing thread's is
``dtorch.default_graph``). An operator whose tensor operands are on several graphs runs on the
innermost ``with graph:`` when that is one of them, else on its first tensor operand's graph;
its results belong to the graph it ran on. Which graph runs an operator never changes its value: the controller
orders every access to a tensor after the conflicting accesses of other streams, whichever
graph made them. ``with`` blocks nest, per thread.

>>> import dtorch
>>> g = dtorch.Graph()
>>> with g:
...     x = dtorch.ones(3)
>>> y = x.sum()  # runs on x's graph, g
>>> y.graph == g, y.graph != dtorch.default_graph
(True, True)
>>> g.sync()
>>> with g.device_mesh_guard("cpu"), g.dtype_guard(None):
...     g.default_device_mesh.devices, g.default_dtype
((0,), torch.float32)

``GraphOption(per_device_per_process=...)`` is DTorch's choice between running each GPU in a
thread of the user's process or in a process of its own. dtorch always does the latter, for
every device: each GPU has a host process, CPU devices share ``config.cpu_hosts`` host
processes (each device on threads of its own), and none runs in the user's process, so no
device ever shares the user's GIL. The option is kept (``graph.option``) and changes nothing.

A thread's current graph is the context's (``current.py``: the stack of ``with graph:``
blocks, per thread), and the client picks each operator's graph (``client/dispatch.graph_of``);
a Graph's waits ask the session through the context's handle, so this module, like the
operators, imports nothing of the client.
"""

from __future__ import annotations

import contextlib
import gc

import torch

from . import current
from .cuda import memory_kernels
from .future import VoidFutureCollect
from .memory_stats import MemoryStat, MemoryStats
from .mesh import DeviceMesh, absent_devices

__all__ = ["Graph", "GraphOption", "VoidFutureCollect"]


class GraphOption:
    """DTorch's graph options. ``per_device_per_process``: None takes the environment's
    ``DTORCH_PER_DEVICE_PER_PROCESS`` when a Graph is made with it; dtorch runs every device in
    a host process either way (see the module doc)."""

    __slots__ = ("_per_device_per_process",)

    def __init__(self, *, per_device_per_process: bool | None = None) -> None:
        self.per_device_per_process = per_device_per_process

    @property
    def per_device_per_process(self) -> bool | None:
        return self._per_device_per_process

    @per_device_per_process.setter
    def per_device_per_process(self, value: bool | None) -> None:
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"GraphOption.per_device_per_process must be a bool or None, not "
                            f"{type(value).__name__}")
        self._per_device_per_process = value

    def __eq__(self, other) -> bool:
        if not isinstance(other, GraphOption):
            return NotImplemented
        return self._per_device_per_process == other._per_device_per_process

    __hash__ = None  # mutable

    def __repr__(self) -> str:
        return f"GraphOption(per_device_per_process={self._per_device_per_process!r})"

    __str__ = __repr__


class Graph:
    """A graph: its own compute streams on every device, its default mesh and dtype.
    ``Graph()`` or ``Graph(GraphOption(...))``; graphs are equal when their ids are."""

    def __init__(self, option: GraphOption | None = None, *, _id: int | None = None) -> None:
        if option is not None and not isinstance(option, GraphOption):
            raise TypeError(f"Graph(): expected a GraphOption, got {type(option).__name__}")
        self._id = current.new_graph_id() if _id is None else _id
        self._name = ""
        self._per_device_per_process = None if option is None else option.per_device_per_process
        self._mesh = None  # the one-device CPU mesh until a guard sets one
        self._dtype = torch.float32

    # -- identity -------------------------------------------------------------------------------
    @property
    def id(self) -> int:
        return self._id

    @property
    def option(self) -> GraphOption:
        """The graph's options (a copy); a value left None is the environment's, read on first
        use as DTorch does (``GlobalOption.get_per_device_per_process()``)."""
        if self._per_device_per_process is None:
            from .global_option import GlobalOption

            self._per_device_per_process = GlobalOption.get_per_device_per_process()
        return GraphOption(per_device_per_process=self._per_device_per_process)

    def set_name(self, name: str) -> None:
        if not isinstance(name, str):
            raise TypeError(f"Graph.set_name: name must be a str, not {type(name).__name__}")
        self._name = name

    def get_name(self) -> str:
        return self._name

    def __eq__(self, other) -> bool:
        if not isinstance(other, Graph):
            return NotImplemented
        return self._id == other._id

    def __hash__(self) -> int:
        return hash(self._id)

    def __str__(self) -> str:
        return f"dtorch.Graph with id: {self._id}"  # DTorch's

    def __repr__(self) -> str:
        name = f", name={self._name!r}" if self._name else ""
        return f"dtorch.Graph(id={self._id}{name})"

    @staticmethod
    def default_graph() -> Graph:
        """The calling thread's default graph (made on its first use in the thread)."""
        return current.per_thread.default

    # -- waits ----------------------------------------------------------------------------------
    def sync(self, compiles: bool = False) -> None:
        """Waits until every operator issued so far (on every graph and device, as DTorch's:
        a graph's sync is not a wait for that graph alone) has run;
        raises the kernel errors reported since the last wait. ``compiles=True`` also waits
        until every kernel fusion those operators started (``dtorch.config.fusion``) is
        compiled and swapped in, or given up: what a benchmark of fused code waits for."""
        current.session().sync(compiles)

    def sync_future(self) -> VoidFutureCollect:
        """``sync()`` without the wait: returns at once; the future is ready once every
        operator issued so far has run (``get``/``wait``/``wait_for``/``await``)."""
        return VoidFutureCollect((current.session().sync_async(),))

    # -- memory ---------------------------------------------------------------------------------
    def empty_cache(self) -> None:
        """Frees what the devices hold but no longer use: collects the client's garbage (its
        dropped tensors release their blobs), waits for the releases, then empties the
        caching allocator of each device this runtime has used (CUDA's; on a CPU, the freed
        blocks its host's malloc keeps: ``runtime/cpu_memory.py``)."""
        gc.collect()
        self.sync()
        for device_type in ("cuda", "cpu"):
            devices = _used_devices(device_type)
            if devices:
                memory_kernels.empty_cache(device_type, devices)
        self.sync()

    def get_memory_stats(self, device_mesh=None, reset_peak: bool = False) -> MemoryStats:
        """The memory figures of each device of ``device_mesh`` (default: every device of the
        default mesh's type that this runtime has used, and the default mesh's own), read once
        the work issued so far has run. ``reset_peak``: the peaks start again from the current
        figures after this reading.

        >>> import dtorch
        >>> stats = dtorch.default_graph.get_memory_stats()
        >>> stats.find(0).memory_allocated >= 0
        True
        """
        if device_mesh is None:
            mesh = self.default_device_mesh
            devices = sorted(set(mesh.devices) | set(_used_devices(mesh.device_type)))
            device_type = mesh.device_type
        else:
            mesh = as_mesh(device_mesh)
            devices, device_type = list(mesh.devices), mesh.device_type
        self.sync()  # releases issued so far have reached the hosts, and their kernels have run
        rows = memory_kernels.memory_stats(device_type, devices, reset_peak)
        return MemoryStats({d: MemoryStat(allocated=a, reserved=r, max_memory_allocated=ma,
                                          max_memory_reserved=mr)
                            for d, (a, r, ma, mr) in zip(devices, rows)},
                           device_type=device_type)

    # -- defaults -------------------------------------------------------------------------------
    @property
    def default_device_mesh(self) -> DeviceMesh:
        """The mesh of tensors made on this graph without one; first ``DeviceMesh("cpu", [0])``."""
        if self._mesh is None:
            return current.cpu0()
        return self._mesh

    @contextlib.contextmanager
    def device_mesh_guard(self, device_mesh):
        """Within the block, ``device_mesh`` (a DeviceMesh, or what ``DeviceMesh(...)`` takes:
        ``"cpu"``, ``"cuda:1"``, a ``torch.device``) is the default mesh; restored on exit.
        None keeps the current default, so a loader can pass on an optional mesh as given."""
        mesh = self._mesh if device_mesh is None else as_mesh(device_mesh)
        previous, self._mesh = self._mesh, mesh
        try:
            yield self.default_device_mesh
        finally:
            self._mesh = previous

    @property
    def default_dtype(self) -> torch.dtype:
        """The dtype of floating tensors made on this graph without one; first float32."""
        return self._dtype

    @contextlib.contextmanager
    def dtype_guard(self, dtype: torch.dtype | None):
        """Within the block, ``dtype`` (None: float32) is the default dtype; restored on exit."""
        previous = self._dtype
        self._set_default_dtype(dtype, "dtype_guard")
        try:
            yield self._dtype
        finally:
            self._dtype = previous

    def _set_default_dtype(self, dtype: torch.dtype | None, name="_set_default_dtype") -> None:
        """Sets the default dtype (None: float32) until it is set again: DTorch's form, which
        HF's ``from_pretrained`` path calls beside ``torch.set_default_dtype`` (and restores
        after); ``dtype_guard`` is the scoped one."""
        if dtype is None:
            dtype = torch.float32
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"Graph.{name}: dtype must be a torch.dtype or None, not "
                            f"{type(dtype).__name__}")
        self._dtype = dtype

    def satisfy(self, device_mesh) -> bool:
        """Whether this machine has every device of ``device_mesh`` (a DeviceMesh, or what
        ``DeviceMesh(...)`` takes): CPU device ids are logical, so any CPU mesh; a CUDA mesh
        when its ids are below ``torch.cuda.device_count()``. A mesh it is False for can be
        made, and raises at its first operator.

        >>> import dtorch
        >>> dtorch.default_graph.satisfy(dtorch.DeviceMesh("cpu", [0, 1]))
        True
        """
        return not absent_devices(as_mesh(device_mesh))

    # -- with graph: ----------------------------------------------------------------------------
    def __enter__(self) -> Graph:
        current.per_thread.enter(self)
        return self

    def __exit__(self, *exc) -> None:
        current.per_thread.exit()


def _as_device(spec) -> torch.device:
    if isinstance(spec, (str, torch.device)):
        return torch.device(spec)
    raise TypeError(f"expected a DeviceMesh, a device string such as 'cpu' or 'cuda:1', or a "
                    f"torch.device; got {type(spec).__name__}")


def as_mesh(spec) -> DeviceMesh:
    """A DeviceMesh as DTorch's ``DeviceMesh(spec)`` makes it: ``spec`` itself, or the
    one-device mesh of a device (``"cpu"``, ``"cuda"`` is device 0, ``torch.device("cuda:1")``)."""
    if isinstance(spec, DeviceMesh):
        return spec
    d = _as_device(spec)
    return DeviceMesh(d.type, [d.index or 0])


def _used_devices(device_type: str) -> list:
    """The ids of the ``device_type`` devices this runtime's meshes name so far."""
    s = current.session()
    return sorted({d for m in list(s.mesh_ids) if m.device_type == device_type
                   for d in m.devices})


current.plug_graph_type(Graph)
default_graph = Graph.default_graph()  # the importing thread's


def get_default_device_mesh(device=None, device_mesh=None, graph=None) -> DeviceMesh:
    """The mesh an op without one runs on: ``DeviceMesh(device)`` if a device is given, else
    ``device_mesh``, else the default mesh of ``graph`` (or of the graph calls issue on now).

    >>> get_default_device_mesh(device="cpu:2").devices
    (2,)
    """
    if device is not None and device_mesh is not None:
        raise ValueError(f"get_default_device_mesh: got both device={device!r} and "
                         f"device_mesh={device_mesh!r}; give one of them")
    if device is not None:
        return as_mesh(device)
    if device_mesh is not None:
        return as_mesh(device_mesh)
    return (graph or current.current_graph()).default_device_mesh

