"""The memory Mooncake moves data from and into: it must be registered with the client
first (``register_buffer``).

The backend registers two regions for its whole life: the buffer of its allocator, and a slab
of header slots (:class:`HeaderSlab`) that frame headers are written to and read into. Other
memory (an object wrapped around an engine's own tensor) is registered for the calls that move
it (:meth:`Registrations.holding`), never copied. Mooncake's CPU client moves host memory only:
GPU objects go through a host copy (:func:`host_copy`, :func:`host_like`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvplug.errors import BackendUnavailable
from kvplug.memory import FreeListAllocator, MemoryObj
from kvplug.url import BackendURL
from kvplug_mooncake import codes
from kvplug_mooncake.layout import HEADER_REGION

HEADER_SLOTS = 4096
"""Header slots in the slab: the most operations on objects one backend has in flight."""


@dataclass
class HeaderSlot:
    """One header slot: :data:`~kvplug_mooncake.layout.HEADER_REGION` bytes of registered
    memory a value's header region is written to or read into."""

    obj: MemoryObj

    @property
    def ptr(self) -> int:
        return self.obj.data_ptr()

    def view(self) -> memoryview:
        return self.obj.memoryview()

    def release(self) -> None:
        self.obj.release()


class HeaderSlab:
    """The registered memory header slots are taken from."""

    def __init__(self, url: BackendURL) -> None:
        self._url = url
        self.allocator = FreeListAllocator(
            HEADER_REGION * HEADER_SLOTS, alignment=HEADER_REGION, pin=False
        )

    def take(self, count: int) -> list[HeaderSlot]:
        """``count`` free slots; release each (:meth:`HeaderSlot.release`) when done."""
        slots: list[HeaderSlot] = []
        for _ in range(count):
            obj = self.allocator.allocate((HEADER_REGION,), torch.uint8)
            if obj is None:
                release_slots(slots)
                raise BackendUnavailable(
                    f"{self._url} has {HEADER_SLOTS} operations on objects in flight, its "
                    "most; lower the engine's concurrency or raise threads."
                )
            slots.append(HeaderSlot(obj))
        return slots


def release_slots(slots: Sequence[HeaderSlot]) -> None:
    for slot in slots:
        slot.release()


class Registrations:
    """Memory the store may move data from and into: regions registered for the backend's
    life (the allocator's buffer, the header slab), and other memory registered for the
    calls that move it (counted, so that concurrent calls over one region share it)."""

    def __init__(self, store: Any, url: BackendURL) -> None:
        self._store = store
        self._url = url
        self._lock = threading.Lock()
        self._fixed: list[tuple[int, int]] = []
        self._temporary: dict[int, list[int]] = {}
        self.temporary_registrations = 0
        """Calls that registered memory outside the fixed regions (none copied it)."""

    def register_fixed(self, ptr: int, size: int, what: str) -> None:
        code = self._store.register_buffer(ptr, size)
        if code != 0:
            raise BackendUnavailable(
                f"Mooncake could not register {what} ({size} bytes) for zero-copy transfers: "
                f"{codes.describe(code)}. With protocol=rdma, check the device and the locked "
                "memory limit (ulimit -l)."
            )
        self._fixed.append((ptr, size))

    def covers(self, ptr: int, size: int) -> bool:
        return any(start <= ptr and ptr + size <= start + length for start, length in self._fixed)

    @contextlib.contextmanager
    def holding(self, regions: Sequence[tuple[int, int]]) -> Iterator[None]:
        """Keep ``regions`` (pointer, size) registered while the block runs."""
        taken: list[int] = []
        try:
            for ptr, size in regions:
                if size == 0 or self.covers(ptr, size):
                    continue
                with self._lock:
                    entry = self._temporary.get(ptr)
                    if entry is not None and entry[0] >= size:
                        entry[1] += 1
                        taken.append(ptr)
                        continue
                    code = self._store.register_buffer(ptr, size)
                    if code != 0:
                        raise BackendUnavailable(
                            f"Mooncake could not register {size} bytes of memory outside the "
                            f"allocator for a transfer on {self._url}: {codes.describe(code)}. "
                            "Allocate objects from the backend's allocator."
                        )
                    self._temporary[ptr] = [size, 1]
                    self.temporary_registrations += 1
                    taken.append(ptr)
            yield
        finally:
            with self._lock:
                for ptr in taken:
                    entry = self._temporary[ptr]
                    entry[1] -= 1
                    if entry[1] == 0:
                        del self._temporary[ptr]
                        self._store.unregister_buffer(ptr)

    def holding_objects(self, objs: Sequence[MemoryObj]) -> contextlib.AbstractContextManager[None]:
        """:meth:`holding` the memory of ``objs``."""
        return self.holding([(obj.data_ptr(), obj.nbytes) for obj in objs])


def host_copy(obj: MemoryObj) -> MemoryObj:
    """``obj`` itself (a new reference) in host memory, or a host copy of a GPU object."""
    if obj.device.type == "cpu":
        return obj.retain()
    return MemoryObj.from_tensor(obj.tensor.cpu().contiguous(), obj.fmt)


def host_like(dest: MemoryObj) -> MemoryObj:
    """``dest`` itself (a new reference) in host memory, or, for a GPU ``dest``, a host object
    of its shape to read into before copying to it."""
    if dest.device.type == "cpu":
        return dest.retain()
    return MemoryObj.from_tensor(torch.empty(dest.shape, dtype=dest.dtype), dest.fmt)


__all__ = [
    "HEADER_SLOTS",
    "HeaderSlab",
    "HeaderSlot",
    "Registrations",
    "host_copy",
    "host_like",
    "release_slots",
]
