"""Pure-torch gather and scatter, and the per-token loops that test them.

:func:`torch_gather` and :func:`torch_scatter` are the ``impl="torch"`` path of
:func:`kvplug.runtime.gpu.gather` and :func:`kvplug.runtime.gpu.scatter`: a handful of
``index_select`` /
``index_copy_`` calls per (plane, layer) over :meth:`PagedKVCache.slot_rows` views, in bytes so
every KV dtype (fp8 included) moves bit-exact. They run wherever the cache lives (CPU or CUDA);
a chunk on another device is staged through one copy. They take arguments the public functions
have already checked.

:func:`naive_gather` and :func:`naive_scatter` copy one token at a time, indexing the engine's
own tensors by ``(block, offset)``, without the stride arithmetic of :class:`PagedKVCache`:
they are the oracle the fast paths (torch and the CUDA kernel) are tested against.

Example::

    >>> import torch
    >>> from kvplug.runtime.gpu import PagedKVCache
    >>> from kvplug.runtime.gpu.reference import naive_gather, torch_gather
    >>> layer = torch.arange(2 * 2 * 4 * 3, dtype=torch.float32).view(2, 2, 4, 1, 3)
    >>> cache = PagedKVCache.vllm_flash([layer])
    >>> slots = torch.tensor([5, -1, 0])
    >>> fast, slow = torch.zeros(2, 1, 3, 3), torch.zeros(2, 1, 3, 3)
    >>> torch_gather(cache, slots, fast)
    >>> naive_gather(cache, slots, slow)
    >>> torch.equal(fast, slow), fast[0, 0, 0].tolist(), fast[1, 0, 1].tolist()
    (True, [15.0, 16.0, 17.0], [0.0, 0.0, 0.0])
"""

from __future__ import annotations

import torch

from kvplug.runtime.gpu.layouts import KVLayout, PagedKVCache


def _as_bytes(chunk: torch.Tensor) -> torch.Tensor:
    """A contiguous ``[P, L, T, row]`` chunk as ``[P, L, T, row_bytes]`` ``uint8``."""
    return chunk.view(torch.uint8) if chunk.dtype != torch.uint8 else chunk


def _valid(slots: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(positions, slots)`` of the non-negative entries; positions ``None`` when all are."""
    mask = slots >= 0
    if bool(mask.all()):
        return None, slots
    positions = mask.nonzero().squeeze(1)
    return positions, slots.index_select(0, positions)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def torch_gather(
    cache: PagedKVCache,
    slot_mapping: torch.Tensor,
    out: torch.Tensor,
    *,
    synchronize: bool = True,
) -> None:
    """Copy slot ``slot_mapping[i]`` of every (plane, layer) into ``out[plane, layer, i]``.

    ``out`` is a contiguous chunk of ``cache.chunk_shape(len(slot_mapping))`` in the cache's
    dtype, on any device; negative slots leave their row of ``out`` as it was.
    """
    if slot_mapping.numel() == 0:
        return
    device = cache.device
    positions, slots = _valid(slot_mapping.to(device=device, dtype=torch.int64))
    dst = _as_bytes(out)
    if out.device == device:
        for plane in range(cache.kv_planes):
            for layer in range(cache.num_layers):
                rows = cache.slot_rows(plane, layer)
                if positions is None:
                    torch.index_select(rows, 0, slots, out=dst[plane, layer])
                else:
                    dst[plane, layer].index_copy_(0, positions, rows.index_select(0, slots))
        return
    # Gather on the cache's device, then one copy across.
    layers = range(cache.num_layers)
    gathered = torch.stack(
        [
            torch.stack([cache.slot_rows(plane, layer).index_select(0, slots) for layer in layers])
            for plane in range(cache.kv_planes)
        ]
    )
    if positions is None:
        dst.copy_(gathered, non_blocking=True)
    else:
        dst.index_copy_(2, positions.to(out.device), gathered.to(out.device))
    if synchronize:
        _synchronize(device)


def torch_scatter(
    src: torch.Tensor,
    cache: PagedKVCache,
    slot_mapping: torch.Tensor,
    *,
    synchronize: bool = True,
) -> None:
    """Copy ``src[plane, layer, i]`` into slot ``slot_mapping[i]`` of every (plane, layer).

    The reverse of :func:`torch_gather`; negative slots are skipped and leave the cache as it
    was. Which write wins for a slot mapped twice is unspecified.
    """
    if slot_mapping.numel() == 0:
        return
    device = cache.device
    positions, slots = _valid(slot_mapping.to(device=device, dtype=torch.int64))
    data = _as_bytes(src)
    if src.device != device:
        data = data.to(device, non_blocking=True)
    for plane in range(cache.kv_planes):
        for layer in range(cache.num_layers):
            rows = data[plane, layer]
            if positions is not None:
                rows = rows.index_select(0, positions)
            cache.slot_rows(plane, layer).index_copy_(0, slots, rows)
    if synchronize and src.device != device:
        _synchronize(device)


def _slot_row(cache: PagedKVCache, plane: int, layer: int, slot: int) -> torch.Tensor:
    """The bytes of one slot's row, indexed the way the engine indexes its own tensors."""
    if cache.layout is KVLayout.SGLANG:
        row = cache.tensors[plane * cache.num_layers + layer][slot]
    elif cache.layout is KVLayout.MLA:
        tensor = cache.tensors[layer]
        block, offset = divmod(slot, tensor.shape[1])
        row = tensor[block, offset]
    else:
        tensor = cache.tensors[layer]
        block, offset = divmod(slot, tensor.shape[2])
        row = tensor[plane, block, offset]
    return row.reshape(-1).view(torch.uint8)


def _token_range(slot_mapping: torch.Tensor, start: int, end: int | None) -> list[int]:
    return [int(s) for s in slot_mapping[start:end].tolist()]


def naive_gather(
    cache: PagedKVCache,
    slot_mapping: torch.Tensor,
    out: torch.Tensor,
    *,
    start: int = 0,
    end: int | None = None,
) -> None:
    """Per-token loop: ``out[p, l, i] = row of slot slot_mapping[start + i]``; skips negatives."""
    for i, slot in enumerate(_token_range(slot_mapping, start, end)):
        if slot < 0:
            continue
        for plane in range(cache.kv_planes):
            for layer in range(cache.num_layers):
                out[plane, layer, i].view(torch.uint8).copy_(_slot_row(cache, plane, layer, slot))


def naive_scatter(
    src: torch.Tensor,
    cache: PagedKVCache,
    slot_mapping: torch.Tensor,
    *,
    start: int = 0,
    end: int | None = None,
) -> None:
    """Per-token loop: row of slot ``slot_mapping[start + i]`` = ``src[p, l, i]``."""
    for i, slot in enumerate(_token_range(slot_mapping, start, end)):
        if slot < 0:
            continue
        for plane in range(cache.kv_planes):
            for layer in range(cache.num_layers):
                _slot_row(cache, plane, layer, slot).copy_(src[plane, layer, i].view(torch.uint8))


__all__ = ["naive_gather", "naive_scatter", "torch_gather", "torch_scatter"]
