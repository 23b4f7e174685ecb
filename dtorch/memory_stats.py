"""MemoryStat and MemoryStats: the memory figures of devices (``Graph.get_memory_stats``).

A ``MemoryStat`` holds one device's figures in bytes: ``memory_allocated``, ``memory_reserved``,
``max_memory_allocated`` and ``max_memory_reserved``, as torch.cuda names them. ``MemoryStats``
maps device ids to them, like the dict that ``torch.cuda.memory_stats`` returns: iterate it for
the ids, index it, or call ``items()``.

On a CUDA device the figures are torch.cuda's caching allocator's. On a CPU device, where DTorch
has none, they are the bytes held by the tensors the device stores (each storage counted once)
and the peak of that since the last reset; a CPU device caches nothing, so reserved equals
allocated.

>>> import dtorch
>>> from dtorch.memory_stats import MemoryStat, MemoryStats
>>> print(MemoryStat(allocated=4_194_304, reserved=4_194_304))
MemoryStat(allocated: 4.1943MB, reserved: 4.1943MB, maxAllocated: 0MB, maxReserved: 0MB)
>>> stats = MemoryStats({0: MemoryStat(allocated=8)})
>>> stats.size, stats.find(0).memory_allocated, stats.find(5)
(1, 8, None)
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["MemoryStat", "MemoryStats"]

_FIELDS = ("memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved")


def _bytes(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            value = value.__index__()  # a NumPy or 0-dim torch integer
        except (AttributeError, TypeError):
            raise TypeError(f"MemoryStat.{name} must be an int (bytes), got "
                            f"{type(value).__name__}") from None
    return int(value)


def _megabytes(n: int) -> str:
    """DTorch's form: ``bytes / 1e6`` as a C++ stream prints a double (6 significant digits)."""
    return f"{n / 1e6:g}MB"


def _figure(k: int) -> property:
    """Figure ``k`` of a MemoryStat (bytes), read and set as a property."""
    name = _FIELDS[k]

    def get(self) -> int:
        return self._values[k]

    def set(self, value) -> None:
        self._values[k] = _bytes(name, value)

    return property(get, set, doc=f"{name} (bytes)")


class MemoryStat:
    """One device's memory figures in bytes. ``MemoryStat(other)`` copies ``other``."""

    __slots__ = ("_values",)

    def __init__(self, cpp_instance: MemoryStat | None = None, *, allocated: int = 0,
                 reserved: int = 0, max_memory_allocated: int = 0,
                 max_memory_reserved: int = 0) -> None:
        if cpp_instance is not None:
            if not isinstance(cpp_instance, MemoryStat):
                raise TypeError(f"MemoryStat(): expected a MemoryStat to copy, got "
                                f"{type(cpp_instance).__name__}")
            self._values = list(cpp_instance._values)
            return
        given = (allocated, reserved, max_memory_allocated, max_memory_reserved)
        self._values = [_bytes(name, v) for name, v in zip(_FIELDS, given)]

    memory_allocated = _figure(0)
    memory_reserved = _figure(1)
    max_memory_allocated = _figure(2)
    max_memory_reserved = _figure(3)

    def __eq__(self, other) -> bool:
        if not isinstance(other, MemoryStat):
            return NotImplemented
        return self._values == other._values

    __hash__ = None  # mutable (its figures may be set)

    def __str__(self) -> str:
        a, r, ma, mr = map(_megabytes, self._values)
        return f"MemoryStat(allocated: {a}, reserved: {r}, maxAllocated: {ma}, maxReserved: {mr})"

    def __repr__(self) -> str:
        a, r, ma, mr = self._values
        return (f"MemoryStat(allocated={a}, reserved={r}, max_memory_allocated={ma}, "
                f"max_memory_reserved={mr})")


class MemoryStats(Mapping):
    """The figures of several devices: device id -> MemoryStat, in id order.

    ``MemoryStats(stats)`` takes a mapping of ids to MemoryStat (or another MemoryStats);
    ``device_type`` names the devices in ``str``. ``find(id)`` gives None for a device not in
    it (DTorch gives a zeroed MemoryStat); ``stats[id]`` raises KeyError.
    """

    __slots__ = ("_stats", "device_type")

    def __init__(self, cpp_instance: Mapping | None = None, *, device_type: str | None = None):
        items = dict(cpp_instance or {})
        for device, stat in items.items():
            if isinstance(device, bool) or not isinstance(device, int) or not isinstance(
                    stat, MemoryStat):
                raise TypeError(f"MemoryStats(): expected device id (int) -> MemoryStat, got "
                                f"{device!r}: {type(stat).__name__}")
        self._stats = {d: items[d] for d in sorted(items)}
        if device_type is None:
            device_type = getattr(cpp_instance, "device_type", None) or "cpu"
        self.device_type = device_type

    @property
    def size(self) -> int:
        """How many devices it has figures for."""
        return len(self._stats)

    def find(self, device_id: int) -> MemoryStat | None:
        """The figures of device ``device_id``, or None when it has none."""
        return self._stats.get(device_id)

    def __getitem__(self, device_id: int) -> MemoryStat:
        return self._stats[device_id]

    def __iter__(self):
        return iter(self._stats)

    def __len__(self) -> int:
        return len(self._stats)

    def __eq__(self, other) -> bool:
        if not isinstance(other, MemoryStats):
            return NotImplemented
        return self.device_type == other.device_type and self._stats == other._stats

    __hash__ = None

    def __str__(self) -> str:
        rows = "".join(f"\t{self.device_type}:{d}: {s}\n" for d, s in self._stats.items())
        return f"MemoryStats(\n{rows})"

    def __repr__(self) -> str:
        return f"MemoryStats({self._stats!r}, device_type={self.device_type!r})"
