"""Memory objects and the allocator they come from.

A :class:`MemoryObj` is a typed tensor view over bytes owned by an :class:`Allocator`. It carries
its logical shape, dtype and :class:`MemoryFormat`, a reference count and a pin count, and goes
back to its allocator the moment both counts reach zero.

Ownership rule (contract clause 5): whoever holds a reference calls :meth:`MemoryObj.release`
exactly once for it. ``allocate`` hands out one reference; :meth:`MemoryObj.retain` adds one.
Releasing more often than retained raises :class:`~kvplug.errors.RefCountError` and never
frees memory twice.

Example::

    >>> import torch
    >>> from kvplug.memory import FreeListAllocator, MemoryFormat
    >>> allocator = FreeListAllocator(1 << 20)
    >>> obj = allocator.allocate((2, 4, 16, 8), torch.float16, MemoryFormat.KV_2LTD)
    >>> obj.tensor.fill_(1.5).sum().item()
    1536.0
    >>> allocator.stats().object_count
    1
    >>> obj.release()
    >>> allocator.stats().used
    0
"""

from __future__ import annotations

import abc
import bisect
import contextlib
import enum
import itertools
import math
import mmap
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from kvplug.errors import ConfigError, RefCountError
from kvplug.units import format_size, host_memory, parse_size

DEFAULT_ALIGNMENT = 4096


class MemoryFormat(enum.IntEnum):
    """Logical layout of a memory object. The numbers travel on the wire and match LMCache."""

    UNDEFINED = 0
    KV_2LTD = 1
    """``[2, num_layers, num_tokens, num_heads * head_size]``: K and V of all layers of a chunk."""
    KV_T2D = 2
    """``[num_tokens, 2, hidden]``: one layer, token-major."""
    KV_2TD = 3
    """``[2, num_tokens, hidden]``: one layer, K/V-major."""
    BINARY = 4
    """Opaque bytes produced by a compressing serde."""
    BINARY_BUFFER = 5
    """Opaque bytes, shape ``[num_bytes]``."""
    KV_MLA_FMT = 6
    """``[1, num_layers, num_tokens, latent_dim]``: MLA latent cache."""

    @property
    def token_dim(self) -> int | None:
        """Index of the token dimension in this format's shape, or ``None`` when it has none."""
        return _TOKEN_DIM.get(self)


_TOKEN_DIM = {
    MemoryFormat.KV_2LTD: 2,
    MemoryFormat.KV_T2D: 0,
    MemoryFormat.KV_2TD: 1,
    MemoryFormat.KV_MLA_FMT: 2,
}

# dtype codes as LMCache writes them on the wire (code 1 is an alias of float16 when decoding);
# codes from 9 on are kvplug's own.
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float32: 4,
    torch.float64: 5,
    torch.uint8: 6,
    torch.float8_e4m3fn: 7,
    torch.float8_e5m2: 8,
    torch.int8: 9,
    torch.int16: 10,
    torch.int32: 11,
    torch.int64: 12,
}
DTYPES_BY_CODE: dict[int, torch.dtype] = {code: dtype for dtype, code in DTYPE_CODES.items()}

KV_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "uint8": torch.uint8,
}
"""The dtypes KV caches come in, by name (what the CLI and the contract suite exercise)."""
DTYPES_BY_CODE[1] = torch.float16


def dtype_code(dtype: torch.dtype) -> int:
    """Wire code of ``dtype``; raises :class:`ConfigError` for a dtype kvplug cannot store."""
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        supported = ", ".join(str(d).removeprefix("torch.") for d in DTYPE_CODES)
        raise ConfigError(
            f"dtype {dtype} cannot be stored: kvplug has no wire code for it. "
            f"Convert the tensor to one of: {supported}."
        ) from None


def nbytes_of(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Logical size in bytes of a tensor of ``shape`` and ``dtype``."""
    if any(dim < 0 for dim in shape):
        raise ConfigError(f"shape {tuple(shape)} has a negative dimension; use sizes >= 0.")
    return math.prod(shape) * dtype.itemsize


class MemoryObj:
    """A typed view over allocator-owned bytes with a reference count and a pin count.

    ``tensor`` is the view in the object's shape and dtype; ``raw`` is the same bytes as a flat
    ``uint8`` tensor and :meth:`memoryview` as a writable Python buffer (zero-copy both ways).
    The object is freed to its allocator when ``ref_count`` and ``pin_count`` are both zero;
    afterwards every data accessor raises :class:`~kvplug.errors.RefCountError`.
    """

    __slots__ = (
        "_allocator",
        "_lock",
        "_nbytes",
        "_pin_count",
        "_raw",
        "_ref_count",
        "dtype",
        "fmt",
        "offset",
        "phy_size",
        "shape",
    )

    def __init__(
        self,
        raw: torch.Tensor,
        shape: Sequence[int],
        dtype: torch.dtype,
        fmt: MemoryFormat = MemoryFormat.KV_2LTD,
        *,
        allocator: Allocator | None = None,
        offset: int = 0,
        phy_size: int | None = None,
    ) -> None:
        self.shape: tuple[int, ...] = tuple(int(d) for d in shape)
        self.dtype = dtype
        self.fmt = MemoryFormat(fmt)
        expected = nbytes_of(self.shape, dtype)
        if raw.dtype != torch.uint8 or raw.dim() != 1 or raw.numel() != expected:
            raise ConfigError(
                f"raw buffer must be a flat uint8 tensor of {expected} bytes for shape "
                f"{self.shape} {dtype}, got {raw.dtype} with {raw.numel()} elements."
            )
        self._raw: torch.Tensor | None = raw
        self._nbytes = expected
        self._allocator = allocator
        self.offset = offset
        self.phy_size = expected if phy_size is None else phy_size
        self._ref_count = 1
        self._pin_count = 0
        self._lock = threading.Lock()

    @classmethod
    def from_tensor(
        cls, tensor: torch.Tensor, fmt: MemoryFormat = MemoryFormat.KV_2LTD
    ) -> MemoryObj:
        """Wrap an existing contiguous tensor without copying; no allocator owns it."""
        if not tensor.is_contiguous():
            raise ConfigError(
                "MemoryObj.from_tensor needs a contiguous tensor; call .contiguous() first."
            )
        raw = (
            tensor.reshape(-1).view(torch.uint8)
            if tensor.numel()
            else tensor.new_empty(0, dtype=torch.uint8)
        )
        return cls(raw, tensor.shape, tensor.dtype, fmt)

    @property
    def allocator(self) -> Allocator | None:
        return self._allocator

    @property
    def nbytes(self) -> int:
        """Logical size in bytes (``numel * itemsize``)."""
        return self._nbytes

    @property
    def is_valid(self) -> bool:
        return self._raw is not None

    @property
    def ref_count(self) -> int:
        return self._ref_count

    @property
    def pin_count(self) -> int:
        return self._pin_count

    @property
    def raw(self) -> torch.Tensor:
        """The bytes as a flat ``uint8`` tensor."""
        raw = self._raw
        if raw is None:
            raise RefCountError(
                f"memory object {self.shape} {self.dtype} was already freed: it was released "
                "more often than retained. Keep a reference (retain) while you use it."
            )
        return raw

    @property
    def tensor(self) -> torch.Tensor:
        """The bytes viewed in the object's dtype and shape."""
        return self.raw.view(self.dtype).view(self.shape)

    @property
    def device(self) -> torch.device:
        return self.raw.device

    def memoryview(self) -> memoryview:
        """A writable, zero-copy buffer over the object's bytes (host memory only)."""
        raw = self.raw
        if raw.device.type != "cpu":
            raise ConfigError("memoryview() needs host memory; this object lives on the GPU.")
        if raw.numel() == 0:
            return memoryview(bytearray())
        return memoryview(cast(Any, raw.numpy())).cast("B")

    def data_ptr(self) -> int:
        return int(self.raw.data_ptr())

    def retain(self) -> MemoryObj:
        """Add a reference and return ``self``."""
        with self._lock:
            if self._raw is None:
                raise RefCountError("cannot retain a memory object that was already freed.")
            self._ref_count += 1
        return self

    def release(self) -> None:
        """Drop one reference; the object is freed when no reference and no pin remain."""
        with self._lock:
            if self._ref_count <= 0:
                raise RefCountError(
                    f"memory object {self.shape} {self.dtype} released more often than retained "
                    f"(ref_count is {self._ref_count}). Each retain or allocation pairs with "
                    "exactly one release."
                )
            self._ref_count -= 1
            free_now = self._ref_count == 0 and self._pin_count == 0
        if free_now:
            self._free()

    def reinterpret(
        self,
        start: int,
        shape: Sequence[int],
        dtype: torch.dtype,
        fmt: MemoryFormat = MemoryFormat.KV_2LTD,
    ) -> MemoryObj:
        """Move this object's memory into a new object over its bytes from ``start``, typed
        ``shape`` and ``dtype``; this object is spent (its block now belongs to the result,
        which returns it to the allocator when freed).

        A byte store that reads a whole stored value (header and payload) into one allocated
        block returns the payload in place with it, without a copy. This object must hold its
        only reference and no pin.

        Example::

            >>> import torch
            >>> from kvplug.memory import FreeListAllocator
            >>> allocator = FreeListAllocator(1 << 16)
            >>> block = allocator.allocate((64 + 16,), torch.uint8)
            >>> block.raw[64:] = torch.arange(4, dtype=torch.float32).view(torch.uint8)
            >>> obj = block.reinterpret(64, (4,), torch.float32)
            >>> obj.tensor.tolist(), block.is_valid, allocator.stats().object_count
            ([0.0, 1.0, 2.0, 3.0], False, 1)
            >>> obj.release()
            >>> allocator.stats().used
            0
        """
        nbytes = nbytes_of(shape, dtype)
        with self._lock:
            raw = self._raw
            if raw is None or self._ref_count != 1 or self._pin_count:
                raise RefCountError(
                    f"reinterpret needs the only reference of a live, unpinned object; {self!r} "
                    "is shared, pinned or freed."
                )
            if start < 0 or start + nbytes > raw.numel():
                raise ConfigError(
                    f"reinterpret of bytes {start}..{start + nbytes} lies outside the object's "
                    f"{raw.numel()} bytes."
                )
            self._raw = None
            self._ref_count = 0
        return MemoryObj(
            raw[start : start + nbytes],
            shape,
            dtype,
            fmt,
            allocator=self._allocator,
            offset=self.offset,
            phy_size=self.phy_size,
        )

    def pin(self) -> None:
        """Keep the memory alive (and, in caches, unevictable) until :meth:`unpin`."""
        with self._lock:
            if self._raw is None:
                raise RefCountError("cannot pin a memory object that was already freed.")
            self._pin_count += 1

    def unpin(self) -> None:
        with self._lock:
            if self._pin_count <= 0:
                raise RefCountError(
                    "memory object unpinned more often than pinned; pair each pin with one unpin."
                )
            self._pin_count -= 1
            free_now = self._ref_count == 0 and self._pin_count == 0
        if free_now:
            self._free()

    def _free(self) -> None:
        self._raw = None
        if self._allocator is not None:
            self._allocator._free_block(self.offset, self.phy_size)

    def __repr__(self) -> str:
        state = "valid" if self._raw is not None else "freed"
        return (
            f"MemoryObj(shape={self.shape}, dtype={self.dtype}, fmt={self.fmt.name}, "
            f"ref={self._ref_count}, pin={self._pin_count}, {state})"
        )


@dataclass(frozen=True)
class AllocatorStats:
    """A consistent snapshot of an allocator's state."""

    capacity: int
    used: int
    largest_free_block: int
    object_count: int
    free_block_count: int
    alignment: int
    shortages: int = 0
    """Allocations that found no room, even after asking the reclaimer (see
    :meth:`FreeListAllocator.set_reclaimer`)."""

    @property
    def free(self) -> int:
        return self.capacity - self.used


class Allocator(abc.ABC):
    """Hands out :class:`MemoryObj` s over memory it owns. Out of memory returns ``None``."""

    @abc.abstractmethod
    def allocate(
        self,
        shape: Sequence[int],
        dtype: torch.dtype,
        fmt: MemoryFormat = MemoryFormat.KV_2LTD,
    ) -> MemoryObj | None:
        """A new object with one reference, or ``None`` when no block is large enough."""

    def batched_allocate(
        self,
        shape: Sequence[int],
        dtype: torch.dtype,
        count: int,
        fmt: MemoryFormat = MemoryFormat.KV_2LTD,
    ) -> list[MemoryObj] | None:
        """``count`` objects, or ``None`` (and nothing held) when they do not all fit."""
        objs: list[MemoryObj] = []
        for _ in range(count):
            obj = self.allocate(shape, dtype, fmt)
            if obj is None:
                for held in objs:
                    held.release()
                return None
            objs.append(obj)
        return objs

    @abc.abstractmethod
    def stats(self) -> AllocatorStats:
        """Capacity, bytes in use, largest free block and live object count."""

    @abc.abstractmethod
    def _free_block(self, offset: int, size: int) -> None:
        """Return a block; called by :class:`MemoryObj` when its counts reach zero."""


def _aligned_host_buffer(capacity: int, alignment: int, pin: bool) -> torch.Tensor:
    """``capacity`` bytes of host memory whose first byte is ``alignment``-aligned."""
    padded = capacity + alignment
    if pin:
        base = torch.empty(padded, dtype=torch.uint8, pin_memory=True)
    else:
        # Anonymous mmap: page-aligned and committed lazily, so a large cap costs nothing upfront.
        base = torch.frombuffer(mmap.mmap(-1, padded), dtype=torch.uint8)
    skip = -base.data_ptr() % alignment
    return base[skip : skip + capacity]


def _memory_of(device: torch.device) -> tuple[str, str]:
    """What memory ``device`` allocates from, and how much of it there is, in words."""
    if device.type == "cpu":
        return "host memory", str(host_memory())
    if device.type == "cuda":
        with contextlib.suppress(RuntimeError):
            free, total = torch.cuda.mem_get_info(device)
            return (
                f"memory on {device}",
                f"{format_size(total)} in total, {format_size(free)} free now",
            )
    return f"memory on {device}", "an amount kvplug cannot tell"


Reclaimer = Callable[[int], int]
"""Called as ``reclaimer(nbytes)`` when an allocation does not fit: frees memory of the
allocator (for example by evicting cache entries that nobody else references) and returns how
many bytes it freed, 0 when it could free none."""


class FreeListAllocator(Allocator):
    """First-fit allocator over one buffer with an explicit, coalescing free list.

    Blocks are rounded up to ``alignment`` (4096 bytes by default, so O_DIRECT and cuFile can use
    the buffers directly). Host buffers are CUDA-pinned when CUDA is available (``pin=None``),
    page-aligned anonymous memory otherwise. Thread-safe.

    When an allocation does not fit, the allocator asks its reclaimer (if one is set with
    :meth:`set_reclaimer`) to free memory and tries again, until it fits or the reclaimer frees
    nothing; only then does it return ``None`` and count a shortage.
    """

    def __init__(
        self,
        capacity: int,
        *,
        alignment: int = DEFAULT_ALIGNMENT,
        device: str | torch.device = "cpu",
        pin: bool | None = None,
        sized_by: str = "the allocator's capacity",
    ) -> None:
        """``sized_by`` names the setting that chose ``capacity`` (for example ``"cpu://
        max_size"``), so that an error about it says what to change."""
        if capacity <= 0:
            raise ConfigError(f"{sized_by} must be positive, got {capacity} bytes.")
        if alignment <= 0 or alignment & (alignment - 1):
            raise ConfigError(f"alignment must be a power of two, got {alignment}.")
        device = torch.device(device)
        capacity -= capacity % alignment
        if capacity == 0:
            raise ConfigError(f"{sized_by} must be at least the alignment ({alignment} bytes).")
        try:
            if device.type == "cpu":
                pinned = torch.cuda.is_available() if pin is None else pin
                self.buffer = _aligned_host_buffer(capacity, alignment, pinned)
            else:
                base = torch.empty(capacity + alignment, dtype=torch.uint8, device=device)
                skip = -base.data_ptr() % alignment
                self.buffer = base[skip : skip + capacity]
        except (OverflowError, OSError, MemoryError, RuntimeError) as error:
            where, has = _memory_of(device)
            cause = str(error).split(". ")[0]  # torch's advice on its own allocator is not ours
            raise ConfigError(
                f"{sized_by} is {format_size(capacity)}, more {where} than this machine can "
                f"reserve ({type(error).__name__}: {cause}); it has {has}. Lower it to fit in "
                "the memory left beside the engine."
            ) from None
        self.capacity = capacity
        self.alignment = alignment
        self._lock = threading.Lock()
        self._free_starts: list[int] = [0]
        self._free_sizes: list[int] = [capacity]
        self._used = 0
        self._objects = 0
        self._shortages = 0
        self._reclaimer: Reclaimer | None = None

    def set_reclaimer(self, reclaimer: Reclaimer | None) -> Reclaimer | None:
        """Install who frees memory when an allocation does not fit (``None`` removes it) and
        return the previous one. The reclaimer is called without the allocator's lock held, so
        it may release objects of this allocator."""
        with self._lock:
            previous, self._reclaimer = self._reclaimer, reclaimer
        return previous

    @property
    def shortages(self) -> int:
        """Allocations that found no room (as in :meth:`stats`, without taking the lock)."""
        return self._shortages

    def has_room(self, nbytes: int) -> bool:
        """Whether an allocation of ``nbytes`` would fit now, asking the reclaimer for room as
        :meth:`allocate` does (without counting a shortage)."""
        size = self._round_up(nbytes)
        while True:
            with self._lock:
                if any(block >= size for block in self._free_sizes):
                    return True
                reclaimer = self._reclaimer
            if reclaimer is None or reclaimer(size) <= 0:
                return False

    def _round_up(self, nbytes: int) -> int:
        return max(self.alignment, -(-nbytes // self.alignment) * self.alignment)

    def allocate(
        self,
        shape: Sequence[int],
        dtype: torch.dtype,
        fmt: MemoryFormat = MemoryFormat.KV_2LTD,
    ) -> MemoryObj | None:
        nbytes = nbytes_of(shape, dtype)
        size = self._round_up(nbytes)
        while True:
            start = self._take(size)
            if start is not None:
                break
            with self._lock:
                reclaimer = self._reclaimer
            if reclaimer is None or reclaimer(size) <= 0:
                with self._lock:
                    self._shortages += 1
                return None
        raw = self.buffer[start : start + nbytes]
        return MemoryObj(raw, shape, dtype, fmt, allocator=self, offset=start, phy_size=size)

    def _take(self, size: int) -> int | None:
        """The start of a block of ``size`` bytes now taken from the free list, or None."""
        with self._lock:
            for index, block_size in enumerate(self._free_sizes):
                if block_size >= size:
                    start = self._free_starts[index]
                    if block_size == size:
                        del self._free_starts[index]
                        del self._free_sizes[index]
                    else:
                        self._free_starts[index] = start + size
                        self._free_sizes[index] = block_size - size
                    self._used += size
                    self._objects += 1
                    return start
            return None

    def _free_block(self, offset: int, size: int) -> None:
        with self._lock:
            index = bisect.bisect_left(self._free_starts, offset)
            merges_left = index > 0 and (
                self._free_starts[index - 1] + self._free_sizes[index - 1] == offset
            )
            merges_right = (
                index < len(self._free_starts) and offset + size == self._free_starts[index]
            )
            if merges_left and merges_right:
                self._free_sizes[index - 1] += size + self._free_sizes[index]
                del self._free_starts[index]
                del self._free_sizes[index]
            elif merges_left:
                self._free_sizes[index - 1] += size
            elif merges_right:
                self._free_starts[index] = offset
                self._free_sizes[index] += size
            else:
                self._free_starts.insert(index, offset)
                self._free_sizes.insert(index, size)
            self._used -= size
            self._objects -= 1

    def stats(self) -> AllocatorStats:
        with self._lock:
            return AllocatorStats(
                capacity=self.capacity,
                used=self._used,
                largest_free_block=max(self._free_sizes, default=0),
                object_count=self._objects,
                free_block_count=len(self._free_sizes),
                alignment=self.alignment,
                shortages=self._shortages,
            )

    def free_blocks(self) -> list[tuple[int, int]]:
        """``(start, size)`` of every free block in address order."""
        with self._lock:
            return list(zip(self._free_starts, self._free_sizes, strict=True))

    def memcheck(self) -> bool:
        """True when free and used bytes add up to the capacity and no free blocks touch."""
        with self._lock:  # one snapshot: two separate reads could straddle a concurrent allocate
            blocks = list(zip(self._free_starts, self._free_sizes, strict=True))
            used = self._used
        total_free = sum(size for _, size in blocks)
        touching = any(a + sa >= b for (a, sa), (b, _) in itertools.pairwise(blocks))
        return total_free + used == self.capacity and not touching

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"FreeListAllocator(capacity={s.capacity}, used={s.used}, objects={s.object_count}, "
            f"device={self.buffer.device})"
        )


_shared_host_allocator: FreeListAllocator | None = None
_shared_lock = threading.Lock()
SHARED_HOST_BUFFER_SIZE = 2 << 30


def shared_host_allocator() -> FreeListAllocator:
    """The process-wide host allocator that backends use when they are given none.

    Its size is ``KVPLUG_HOST_BUFFER_SIZE`` (for example ``8GiB``), 2 GiB by default.
    """
    global _shared_host_allocator
    with _shared_lock:
        if _shared_host_allocator is None:
            import os

            size = parse_size(
                os.environ.get("KVPLUG_HOST_BUFFER_SIZE", SHARED_HOST_BUFFER_SIZE),
                what="KVPLUG_HOST_BUFFER_SIZE",
            )
            _shared_host_allocator = FreeListAllocator(
                size, sized_by="KVPLUG_HOST_BUFFER_SIZE (the shared host buffer)"
            )
        return _shared_host_allocator


__all__ = [
    "DEFAULT_ALIGNMENT",
    "DTYPES_BY_CODE",
    "DTYPE_CODES",
    "KV_DTYPES",
    "Allocator",
    "AllocatorStats",
    "FreeListAllocator",
    "MemoryFormat",
    "MemoryObj",
    "Reclaimer",
    "dtype_code",
    "nbytes_of",
    "shared_host_allocator",
]
