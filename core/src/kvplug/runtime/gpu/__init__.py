"""Moving KV between an inference engine's paged cache and kvplug chunks.

An engine keeps its KV cache in fixed-size blocks of *slots*; a token's K and V live at one slot
per layer, and the engine's *slot mapping* says which. kvplug stores KV in *chunks*: one
contiguous ``[kv_planes, num_layers, num_tokens, row]`` tensor per run of tokens
(:attr:`~kvplug.memory.MemoryFormat.KV_2LTD`, or ``KV_MLA_FMT`` for MLA). This package copies
between the two:

* :class:`PagedKVCache` wraps the engine's per-layer tensors (:class:`KVLayout`: vLLM flash,
  MLA, SGLang) and checks them once;
* :func:`gather` copies the slots of a slot mapping into a chunk (offload), :func:`scatter`
  copies a chunk back into the slots (load);
* on a CUDA cache they use kvplug's copy kernel (built on first use; see
  :func:`kernel_available`), which reads and writes pinned host memory directly; everywhere
  else, and as a fallback, a pure-torch implementation with identical results.

Importing this package needs neither CUDA nor a compiler.

Example::

    >>> import torch
    >>> from kvplug.runtime.gpu import PagedKVCache, gather, scatter
    >>> from kvplug.memory import FreeListAllocator
    >>> layers = [torch.randn(2, 16, 16, 8, 128, dtype=torch.bfloat16) for _ in range(4)]
    >>> cache = PagedKVCache.vllm_flash(layers)
    >>> slots = torch.arange(32, 64)  # the tokens in blocks 2 and 3
    >>> obj = FreeListAllocator(1 << 22).allocate(cache.chunk_shape(32), cache.dtype)
    >>> gather(cache, slots, obj)
    >>> _ = [layer.zero_() for layer in layers]
    >>> scatter(obj, cache, slots)
    >>> bool(layers[3][1, 2:4].flatten().equal(obj.tensor[1, 3].flatten()))
    True
    >>> obj.release()
"""

from __future__ import annotations

from kvplug.runtime.gpu.layouts import KVLayout, PagedKVCache
from kvplug.runtime.gpu.ops import IMPLS, Impl, gather, kernel_available, scatter
from kvplug.runtime.gpu.pipeline import DEFAULT_DEPTH, load, offload

__all__ = [
    "DEFAULT_DEPTH",
    "IMPLS",
    "Impl",
    "KVLayout",
    "PagedKVCache",
    "gather",
    "kernel_available",
    "load",
    "offload",
    "scatter",
]
