"""Gather a chunk out of an engine's paged KV cache, and scatter one back into it.

:func:`gather` copies, for every token ``i`` of ``slot_mapping[start:end]``, the row at slot
``slot_mapping[start + i]`` of every (plane, layer) into ``chunk[plane, layer, i]``;
:func:`scatter` does the reverse. Negative slots (vLLM's mark for tokens it does not need
moved) are skipped: the chunk row (gather) or the cache (scatter) is left as it was.

Two implementations give identical bytes:

* ``"cuda"``: kvplug's copy kernel (``csrc/``, built on first use by
  :func:`kvplug.runtime.gpu.kernel.load_kernel`), one launch for all layers and planes on the
  current
  CUDA stream, reading and writing a pinned host chunk directly (or a chunk on the cache's GPU).
* ``"torch"``: :func:`kvplug.runtime.gpu.reference.torch_gather` / ``torch_scatter``, a few indexing
  calls per (plane, layer). It runs on any device; a chunk on another device than the cache is
  staged through one copy.

``impl="auto"`` (the default) uses the kernel for a cache on a CUDA device when the chunk is on
that device or in pinned host memory and the kernel builds; otherwise the torch path. If the
kernel fails to build, one warning with the compiler's output is logged and the torch path is
used from then on.

Example::

    >>> import torch
    >>> from kvplug.runtime.gpu import PagedKVCache, gather, scatter
    >>> layers = [torch.randn(2, 8, 16, 4, 64).half() for _ in range(2)]
    >>> cache = PagedKVCache.vllm_flash(layers)
    >>> slots = torch.tensor([17, 18, 19, 40])
    >>> chunk = torch.empty(cache.chunk_shape(4), dtype=torch.float16)
    >>> gather(cache, slots, chunk)
    >>> torch.equal(chunk[1, 0, 3], layers[0][1, 2, 8].flatten())
    True
    >>> scatter(chunk[:, :, 3:].clone().zero_(), cache, slots, start=3)  # only slot 40
    >>> float(layers[1][0, 2, 8].abs().sum()), float(layers[1][0, 2, 7].abs().sum()) > 0
    (0.0, True)
"""

from __future__ import annotations

import difflib
import logging
import threading
from types import ModuleType
from typing import Literal

import torch

from kvplug.errors import ConfigError
from kvplug.memory import MemoryObj
from kvplug.runtime.gpu.layouts import PagedKVCache
from kvplug.runtime.gpu.reference import torch_gather, torch_scatter

Impl = Literal["auto", "torch", "cuda"]
IMPLS: tuple[Impl, ...] = ("auto", "torch", "cuda")
MAX_VEC_BYTES = 16

logger = logging.getLogger("kvplug.gpu")

_kernel_lock = threading.Lock()
_kernel_error: str | None = None
"""Why the kernel failed to build under ``impl="auto"``; ``None`` until it has."""


def kernel_available() -> bool:
    """True when CUDA is present and the copy kernel loads (building it if needed). Never raises.

    Example::

        >>> import torch
        >>> from kvplug.runtime.gpu import kernel_available
        >>> kernel_available() or not torch.cuda.is_available()
        True
    """
    if not torch.cuda.is_available() or _kernel_error is not None:
        return False
    try:
        from kvplug.runtime.gpu.kernel import load_kernel

        load_kernel()
    except Exception:
        return False
    return True


def gather(
    cache: PagedKVCache,
    slot_mapping: torch.Tensor,
    out: MemoryObj | torch.Tensor,
    *,
    start: int = 0,
    end: int | None = None,
    impl: Impl = "auto",
    synchronize: bool = True,
    validate: bool = True,
) -> None:
    """Copy tokens ``start:end`` of ``slot_mapping`` from ``cache`` into the chunk ``out``.

    For ``i`` in ``range(end - start)`` and every (plane, layer), the row at slot
    ``slot_mapping[start + i]`` goes to ``out[plane, layer, i, :]``; a negative slot leaves that
    row of ``out`` as it was.

    Args:
        cache: the engine's paged cache.
        slot_mapping: 1-D int64 (or int32) slots, on any device; ``end`` defaults to its length.
        out: a :class:`~kvplug.memory.MemoryObj` in ``cache.memory_format`` or a contiguous
            tensor, of shape ``cache.chunk_shape(end - start)`` and the cache's dtype. For the
            kernel a host chunk must be pinned (allocate it from a
            :class:`~kvplug.memory.FreeListAllocator`, whose host buffer is pinned under CUDA).
        impl: ``"auto"``, ``"torch"`` or ``"cuda"`` (see the module docs). ``"cuda"`` raises
            :class:`~kvplug.runtime.gpu.kernel.KernelBuildError` when the kernel does not build.
        synchronize: with a host chunk and a CUDA cache, wait for the copy before returning.
            With ``False`` the caller synchronizes the current stream before reading ``out``.
        validate: check that no slot is ``>= cache.num_slots`` (one ``max()`` reduction, a
            device sync for a CUDA mapping). With ``False`` the caller guarantees it: the
            kernel does not check, and an out-of-range slot reads out of bounds.

    Example::

        >>> import torch
        >>> from kvplug.runtime.gpu import PagedKVCache, gather
        >>> from kvplug.memory import FreeListAllocator, MemoryFormat
        >>> layers = [torch.arange(4 * 16 * 8.0).view(4, 16, 8) for _ in range(3)]
        >>> cache = PagedKVCache.mla(layers)
        >>> obj = FreeListAllocator(1 << 16).allocate(
        ...     cache.chunk_shape(2), torch.float32, MemoryFormat.KV_MLA_FMT
        ... )
        >>> gather(cache, torch.tensor([1, 63]), obj)
        >>> obj.tensor[0, 2, :, 0].tolist()
        [8.0, 504.0]
        >>> obj.release()
    """
    _move(cache, slot_mapping, out, "gather's out", start, end, impl, synchronize, validate, True)


def scatter(
    src: MemoryObj | torch.Tensor,
    cache: PagedKVCache,
    slot_mapping: torch.Tensor,
    *,
    start: int = 0,
    end: int | None = None,
    impl: Impl = "auto",
    synchronize: bool = True,
    validate: bool = True,
) -> None:
    """Copy the chunk ``src`` into ``cache`` at the slots ``slot_mapping[start:end]``.

    The reverse of :func:`gather`, with the same arguments: ``src[plane, layer, i, :]`` goes to
    slot ``slot_mapping[start + i]`` of every (plane, layer); negative slots are skipped and the
    cache is untouched there. Which write wins for a slot mapped twice is unspecified.
    ``synchronize`` waits until a host chunk has been read, so it can be reused at once.

    Example::

        >>> import torch
        >>> from kvplug.runtime.gpu import PagedKVCache, scatter
        >>> k = [torch.zeros(6, 2, 4, dtype=torch.float16)]
        >>> v = [torch.zeros(6, 2, 4, dtype=torch.float16)]
        >>> cache = PagedKVCache.sglang(k, v)
        >>> chunk = torch.ones(cache.chunk_shape(3), dtype=torch.float16)
        >>> scatter(chunk, cache, torch.tensor([4, -1, 0], dtype=torch.int32))
        >>> k[0].sum(dim=(1, 2)).tolist()
        [8.0, 0.0, 0.0, 0.0, 8.0, 0.0]
    """
    _move(
        cache, slot_mapping, src, "scatter's chunk", start, end, impl, synchronize, validate, False
    )


def _move(
    cache: PagedKVCache,
    slot_mapping: torch.Tensor,
    chunk_or_obj: MemoryObj | torch.Tensor,
    what: str,
    start: int,
    end: int | None,
    impl: Impl,
    synchronize: bool,
    validate: bool,
    to_chunk: bool,
) -> None:
    slots = _slice_slots(slot_mapping, start, end, cache, validate)
    chunk = _chunk_tensor(chunk_or_obj, cache, slots.numel(), what)
    kernel = _pick_kernel(impl, cache, chunk)
    if slots.numel() == 0:
        return
    if kernel is not None:
        _launch(kernel, cache, slots, chunk, to_chunk=to_chunk, synchronize=synchronize)
    elif to_chunk:
        torch_gather(cache, slots, chunk, synchronize=synchronize)
    else:
        torch_scatter(chunk, cache, slots, synchronize=synchronize)


def _slice_slots(
    slot_mapping: torch.Tensor,
    start: int,
    end: int | None,
    cache: PagedKVCache,
    validate: bool,
) -> torch.Tensor:
    if not isinstance(slot_mapping, torch.Tensor):
        raise ConfigError(
            f"slot_mapping must be a torch.Tensor, got {type(slot_mapping).__name__}. "
            "Pass the engine's slot mapping, e.g. torch.tensor(slots, dtype=torch.int64)."
        )
    if slot_mapping.dim() != 1 or slot_mapping.dtype not in (torch.int64, torch.int32):
        raise ConfigError(
            f"slot_mapping must be a 1-D int64 or int32 tensor, got {slot_mapping.dim()}-D "
            f"{slot_mapping.dtype}. Flatten it and convert with .long()."
        )
    length = slot_mapping.shape[0]
    stop = length if end is None else end
    if not 0 <= start <= stop <= length:
        raise ConfigError(
            f"token range start={start}, end={end} does not fit slot_mapping of length {length}; "
            "use 0 <= start <= end <= len(slot_mapping)."
        )
    slots = slot_mapping[start:stop]
    if validate and slots.numel():
        top = int(slots.max())
        if top >= cache.num_slots:
            raise ConfigError(
                f"slot_mapping[{start}:{stop}] holds slot {top}, but the cache has "
                f"{cache.num_slots} slots (0 to {cache.num_slots - 1}). The mapping belongs to "
                "another cache or is corrupt; pass the slot mapping of this cache's engine."
            )
    return slots


def _chunk_tensor(
    chunk: MemoryObj | torch.Tensor, cache: PagedKVCache, num_tokens: int, what: str
) -> torch.Tensor:
    if isinstance(chunk, MemoryObj):
        if chunk.fmt != cache.memory_format:
            raise ConfigError(
                f"{what} is a MemoryObj in format {chunk.fmt.name}, but a {cache.layout.value} "
                f"cache moves {cache.memory_format.name} chunks. Allocate it with "
                f"fmt=MemoryFormat.{cache.memory_format.name}."
            )
        tensor = chunk.tensor
    elif isinstance(chunk, torch.Tensor):
        tensor = chunk
    else:
        raise ConfigError(
            f"{what} must be a MemoryObj or a torch.Tensor, got {type(chunk).__name__}."
        )
    expected = cache.chunk_shape(num_tokens)
    if tuple(tensor.shape) != expected or tensor.dtype != cache.dtype:
        raise ConfigError(
            f"{what} has shape {tuple(tensor.shape)}, expected {expected} "
            f"(cache.chunk_shape({num_tokens}), for tokens start:end), and dtype {tensor.dtype}, "
            f"expected the cache's {cache.dtype}. Allocate the chunk with that shape and dtype."
        )
    if not tensor.is_contiguous():
        raise ConfigError(
            f"{what} is not contiguous (strides {tuple(tensor.stride())}); rows are copied as "
            "runs of bytes. Allocate it with torch.empty(cache.chunk_shape(n), dtype=...) or "
            "from a FreeListAllocator."
        )
    return tensor


def _kernel_chunk_problem(cache: PagedKVCache, chunk: torch.Tensor) -> str | None:
    """Why the kernel cannot use ``chunk`` with ``cache``, or ``None`` when it can."""
    if chunk.device.type == "cpu":
        if chunk.is_pinned():
            return None
        return (
            "the chunk is in pageable host memory, and the kernel reads and writes host memory "
            "directly, which needs pinned memory. Allocate the chunk from a FreeListAllocator "
            "(its host buffer is CUDA-pinned when CUDA is present) or with pin_memory=True"
        )
    if chunk.device == cache.device:
        return None
    return (
        f"the chunk is on {chunk.device} but the cache on {cache.device}; put the chunk in "
        "pinned host memory or on the cache's GPU"
    )


def _pick_kernel(impl: Impl, cache: PagedKVCache, chunk: torch.Tensor) -> ModuleType | None:
    """The kernel module to use, or ``None`` for the torch path."""
    if impl not in IMPLS:
        close = difflib.get_close_matches(str(impl), IMPLS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"unknown impl {impl!r}{hint}; use one of {', '.join(map(repr, IMPLS))}.")
    if impl == "torch":
        return None
    on_cuda = cache.device.type == "cuda"
    if impl == "cuda":
        if not on_cuda:
            raise ConfigError(
                f"impl='cuda' needs a cache on a CUDA device, but this cache is on "
                f"{cache.device}. Use impl='torch' or impl='auto' for it."
            )
        problem = _kernel_chunk_problem(cache, chunk)
        if problem is not None:
            raise ConfigError(f"impl='cuda' cannot use this chunk: {problem}.")
        from kvplug.runtime.gpu.kernel import load_kernel

        return load_kernel()
    if not on_cuda or _kernel_chunk_problem(cache, chunk) is not None:
        return None
    return _auto_kernel()


def _auto_kernel() -> ModuleType | None:
    global _kernel_error
    if _kernel_error is not None:
        return None
    from kvplug.runtime.gpu.kernel import KernelBuildError, load_kernel

    try:
        return load_kernel()
    except KernelBuildError as error:
        with _kernel_lock:
            first = _kernel_error is None
            _kernel_error = str(error)
        if first:
            logger.warning(
                "kvplug.gpu: the CUDA copy kernel is unavailable, so gather and scatter use "
                "the pure-torch path from now on: %s",
                error,
            )
        return None


def _vec_bytes(cache: PagedKVCache, chunk: torch.Tensor) -> int:
    """Widest access (a power of two up to 16 bytes) that keeps every kernel access aligned."""
    bits = cache.address_bits | chunk.data_ptr()
    return min(MAX_VEC_BYTES, bits & -bits) if bits else MAX_VEC_BYTES


def _launch(
    kernel: ModuleType,
    cache: PagedKVCache,
    slots: torch.Tensor,
    chunk: torch.Tensor,
    *,
    to_chunk: bool,
    synchronize: bool,
) -> None:
    slots = slots.to(device=cache.device, dtype=torch.int64).contiguous()
    vec = _vec_bytes(cache, chunk)
    with torch.cuda.device(cache.device):
        kernel.transfer(
            chunk, cache.plane_pointers(), slots, cache.slot_stride_bytes, vec, to_chunk
        )
        if synchronize and chunk.device.type == "cpu":
            torch.cuda.current_stream().synchronize()


__all__ = ["IMPLS", "Impl", "gather", "kernel_available", "scatter"]
