"""What :class:`~kvplug_sglang.KvplugHiCacheStorage` needs from SGLang's host pool, and how it
learns it once, when SGLang registers the pool (``register_mem_pool_host``).

From the pool SGLang registers, kvplug reads:

* ``page_size`` (or ``logical_page_size``): tokens per page, and ``layout``: the host layout,
  part of every key;
* where a page's bytes are, in one of two ways:

  - ``get_page_buffer_meta(token_indices)``: a page as at most two regions (K and V, or one
    for MLA) inside the pool's ``kv_buffer``/``k_buffer``/``v_buffer`` tensors. Such pages go
    to kvplug as they are, one object per region;
  - otherwise ``get_data_page(index, flat=False)`` and ``set_from_flat_data_page(index,
    page)``: a page is gathered into one object and scattered back;

* the KV dtype, part of every key: ``dtype``, or where a pool has none, the dtype of its page
  (``get_data_page``) or of the buffer its regions lie in.

Nothing else: kvplug never allocates a page through the pool (``get_dummy_flat_data_page``
pins memory, which fails on a machine without an accelerator). Every SGLang host pool of an
MHA or MLA model qualifies. One that does not (DeepSeek V4's ``LogicalHostPool``, which holds
no KV and is served through SGLang's multi-pool v2 API) is refused at registration with what it
lacks.

Example (a pool with neither way to reach a page)::

    >>> class NoPages:
    ...     page_size, layout, dtype = 16, "layer_first", None
    >>> pool_geometry(NoPages())  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    kvplug.errors.ConfigError: KvplugHiCacheStorage cannot reach the pages of SGLang's host ...
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvplug.errors import ConfigError

POOL_BUFFERS = ("kv_buffer", "k_buffer", "v_buffer")
"""Host pool tensors a page region may lie in."""
_WHAT = "KvplugHiCacheStorage"


@dataclass(frozen=True)
class PoolGeometry:
    """A registered host pool's pages, as kvplug moves them."""

    page_tokens: int
    """Tokens per page (host token slots a page spans)."""
    page_bytes: int
    """Bytes of one page (the flat page of SGLang's copying API)."""
    dtype: torch.dtype
    """The KV dtype."""
    layout: str
    """The host layout name."""
    segment_sizes: tuple[int, ...]
    """Bytes of each object a page is stored as, in the page's byte order."""
    zero_copy: bool
    """Pages are regions of the pool's memory (else gathered into one object)."""
    memory: tuple[tuple[int, int, torch.Tensor], ...]
    """``(start address, size, flat uint8 tensor)`` of each storage behind the pool's buffers."""

    def view(self, address: int, size: int) -> torch.Tensor | None:
        """The pool's bytes ``[address, address + size)``, or None outside its buffers."""
        for start, length, flat in self.memory:
            if start <= address and address + size <= start + length:
                return flat[address - start : address - start + size]
        return None


def byte_views(tensors: Sequence[torch.Tensor]) -> tuple[tuple[int, int, torch.Tensor], ...]:
    """``(start address, size, flat uint8 tensor)`` over the whole storage behind each tensor,
    once per storage: the memory a page pointer may point into."""
    views: dict[int, tuple[int, int, torch.Tensor]] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        start = storage.data_ptr()
        if start not in views:
            flat = torch.empty(0, dtype=torch.uint8, device=tensor.device)
            flat.set_(storage, 0, (storage.nbytes(),), (1,))
            views[start] = (start, storage.nbytes(), flat)
    return tuple(views.values())


def _name(pool: Any) -> str:
    return f"SGLang's host pool {type(pool).__name__}"


def _page_tokens(pool: Any) -> int:
    for attribute in ("logical_page_size", "page_size"):
        size = getattr(pool, attribute, None)
        if isinstance(size, int) and not isinstance(size, bool) and size > 0:
            return size
    raise ConfigError(
        f"{_WHAT}: {_name(pool)} has no page_size (tokens per page, a positive int), so kvplug "
        "cannot tell where one page ends. Register a HostKVCache (what SGLang's "
        "HiCacheController registers), or give the pool a page_size."
    )


def _layout(pool: Any) -> str:
    layout = getattr(pool, "layout", None)
    if not isinstance(layout, str) or not layout:
        raise ConfigError(
            f"{_WHAT}: {_name(pool)} has no layout (SGLang's --hicache-mem-layout, e.g. "
            "page_first), which kvplug keys pages by because every layout orders a page's bytes "
            "differently. Register a HostKVCache, or give the pool its layout name."
        )
    return layout


def _regions(pool: Any, page_tokens: int) -> list[tuple[int, int]]:
    """The regions of the page at token slot 0, as the pool describes them; [] where it
    cannot."""
    describe = getattr(pool, "get_page_buffer_meta", None)
    if not callable(describe):
        return []
    try:
        pointers, sizes = describe(torch.arange(page_tokens, dtype=torch.int64))
        return [(int(p), int(s)) for p, s in zip(pointers, sizes, strict=True)]
    except (NotImplementedError, AttributeError, AssertionError, ValueError, TypeError):
        return []


def _sample_page(pool: Any) -> torch.Tensor | None:
    """The page at token slot 0 (a view where the pool gives one), or None where the pool
    cannot gather and scatter pages."""
    if not callable(getattr(pool, "set_from_flat_data_page", None)):
        return None
    gather = getattr(pool, "get_data_page", None)
    if not callable(gather):
        return None
    try:
        page = gather(0, flat=False)
    except (NotImplementedError, AttributeError, ValueError, TypeError):
        return None
    return page if isinstance(page, torch.Tensor) else None


def _dtype(pool: Any, page: torch.Tensor | None, buffers: Sequence[torch.Tensor]) -> torch.dtype:
    dtype = getattr(pool, "dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    if page is not None:
        return page.dtype
    if buffers:
        return buffers[0].dtype
    raise ConfigError(
        f"{_WHAT}: {_name(pool)} has no dtype, no get_data_page and no KV buffer tensor, so "
        "kvplug cannot tell the KV dtype it keys pages by. Give the pool a dtype attribute "
        "(a torch.dtype), as every SGLang HostKVCache has."
    )


def pool_geometry(pool: Any) -> PoolGeometry:
    """Learn ``pool``'s pages (see the module documentation for what is read); raise
    :class:`~kvplug.errors.ConfigError` naming what the pool lacks and the fix."""
    page_tokens = _page_tokens(pool)
    layout = _layout(pool)
    buffers = [
        tensor
        for tensor in (getattr(pool, name, None) for name in POOL_BUFFERS)
        if isinstance(tensor, torch.Tensor)
    ]
    memory = byte_views(buffers)
    regions = _regions(pool, page_tokens)
    page = _sample_page(pool)
    in_pool = 0 < len(regions) <= 2 and all(
        n > 0 and any(s <= a and a + n <= s + length for s, length, _ in memory) for a, n in regions
    )
    region_bytes = sum(size for _, size in regions)
    page_bytes = page.numel() * page.element_size() if page is not None else None
    # A page goes as pool memory where the regions cover it whole: the copying API's flat page
    # (get_data_page) must then hold the same bytes, split at the same sizes.
    zero_copy = in_pool and page_bytes in (None, region_bytes)
    if zero_copy:
        sizes = tuple(size for _, size in regions)
        page_bytes = region_bytes
    elif page_bytes:
        sizes = (page_bytes,)
    else:
        raise ConfigError(
            f"{_WHAT} cannot reach the pages of {_name(pool)} (layout {layout}): it describes a "
            f"page neither as at most two regions of its {'/'.join(POOL_BUFFERS)} tensors "
            "(get_page_buffer_meta) nor offers get_data_page and set_from_flat_data_page to "
            "copy one that holds any bytes. kvplug-sglang implements SGLang's single-pool page "
            "API (interface_v1), for the host pools of MHA and MLA models; stacks whose "
            "registered pool holds no KV (DeepSeek V4's LogicalHostPool) need SGLang's "
            "multi-pool v2 API, which it does not implement: use one of SGLang's own storage "
            "backends for such a model."
        )
    return PoolGeometry(
        page_tokens=page_tokens,
        page_bytes=page_bytes,
        dtype=_dtype(pool, page, buffers),
        layout=layout,
        segment_sizes=sizes,
        zero_copy=zero_copy,
        memory=memory,
    )


__all__ = ["POOL_BUFFERS", "PoolGeometry", "byte_views", "pool_geometry"]
