"""The paged KV-cache layouts kvplug reads from and writes to.

An inference engine keeps its KV cache in *slots*: slot ``s`` holds one token's keys (and
values) for one layer. :class:`PagedKVCache` wraps the engine's per-layer tensors, checks once
that every slot's row is one contiguous run of bytes at a uniform stride, and exposes what the
copy routines in :mod:`kvplug.runtime.gpu.ops` need: the geometry, the chunk shape, and the byte
address
of slot 0 of every (plane, layer).

A *plane* is K or V (``kv_planes == 2``), or the single latent plane of MLA
(``kv_planes == 1``). A kvplug chunk holds ``[kv_planes, num_layers, num_tokens, row]``.

Example::

    >>> import torch
    >>> from kvplug.runtime.gpu import PagedKVCache
    >>> layers = [torch.zeros(2, 4, 16, 8, 64, dtype=torch.float16) for _ in range(3)]
    >>> cache = PagedKVCache.vllm_flash(layers)
    >>> cache.num_layers, cache.num_slots, cache.row_elements, cache.kv_planes
    (3, 64, 512, 2)
    >>> cache.chunk_shape(256), cache.memory_format.name, cache.slot_stride_bytes
    ((2, 3, 256, 512), 'KV_2LTD', 1024)
    >>> cache.plane_pointers().shape
    torch.Size([2, 3])
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from kvplug.errors import ConfigError
from kvplug.memory import KV_DTYPES, MemoryFormat


class KVLayout(enum.Enum):
    """How an engine lays out one layer of its paged KV cache."""

    VLLM_FLASH = "vllm_flash"
    """Per layer one tensor ``[2, num_blocks, block_size, num_heads, head_size]`` (K, V)."""
    MLA = "mla"
    """Per layer one tensor ``[num_blocks, block_size, head_dim]`` (the MLA latent)."""
    SGLANG = "sglang"
    """Per layer a K buffer and a V buffer, each ``[num_slots, num_heads, head_dim]``."""


_EXPECTED_SHAPE = {
    KVLayout.VLLM_FLASH: "[2, num_blocks, block_size, num_heads, head_size]",
    KVLayout.MLA: "[num_blocks, block_size, head_dim]",
    KVLayout.SGLANG: "[num_slots, num_heads, head_dim]",
}


def _dims_contiguous(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether these dims address one dense run of elements (size-1 dims have any stride)."""
    expected = 1
    for size, stride in zip(reversed(sizes), reversed(strides), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


@dataclass(frozen=True, eq=False)
class PagedKVCache:
    """An engine's paged KV cache: every layer's tensors, validated once.

    Build it with :meth:`vllm_flash`, :meth:`mla` or :meth:`sglang`. Construction checks that
    the tensors share dtype, shape, device and strides, that the dtype is a KV dtype kvplug
    stores (:data:`kvplug.memory.KV_DTYPES`), that each slot's row is contiguous, and that the
    slots of a plane sit at one stride, so a slot's row starts at
    ``plane address + slot * slot_stride_bytes``. Non-contiguous caches (a permuted K/V dim,
    padding between slots, a view at an offset) are fine as long as that holds.

    ``tensors`` are the layer tensors as given (vLLM flash, MLA) or the K buffers followed by
    the V buffers (SGLang). The cache keeps them alive, and the addresses taken at construction
    stay valid as long as the engine does not reallocate them.

    Example::

        >>> import torch
        >>> from kvplug.runtime.gpu import PagedKVCache
        >>> k = [torch.zeros(100, 4, 3, dtype=torch.bfloat16) for _ in range(2)]
        >>> v = [torch.zeros(100, 4, 3, dtype=torch.bfloat16) for _ in range(2)]
        >>> cache = PagedKVCache.sglang(k, v)
        >>> cache.chunk_shape(10), cache.slot_stride_bytes
        ((2, 2, 10, 12), 24)
        >>> PagedKVCache.mla([torch.zeros(8, 16, 576, dtype=torch.float8_e4m3fn)]).chunk_shape(4)
        (1, 1, 4, 576)
    """

    layout: KVLayout
    tensors: tuple[torch.Tensor, ...]
    num_slots: int = field(init=False)
    """Slots per plane: ``num_blocks * block_size`` (vLLM flash, MLA) or ``num_slots``."""
    row_elements: int = field(init=False)
    """Elements in one slot's row: ``num_heads * head_size``, or ``head_dim``."""
    slot_stride: int = field(init=False)
    """Elements between the starts of two consecutive slots' rows."""
    plane_addresses: tuple[tuple[int, ...], ...] = field(init=False)
    """``[kv_planes][num_layers]`` byte addresses of slot 0 (what :meth:`plane_pointers` holds)."""
    address_bits: int = field(init=False)
    """:attr:`row_bytes`, :attr:`slot_stride_bytes` and every plane address OR-ed together:
    its lowest set bit is the widest aligned access into any row (computed once, not per copy)."""
    _rows: tuple[tuple[torch.Tensor, ...], ...] = field(init=False, repr=False)
    _pointer_tensor: list[torch.Tensor] = field(init=False, repr=False, default_factory=list)

    @classmethod
    def vllm_flash(cls, layers: Sequence[torch.Tensor]) -> PagedKVCache:
        """vLLM's flash-attention layout: per layer ``[2, num_blocks, block_size, heads, size]``."""
        return cls(KVLayout.VLLM_FLASH, _as_tensor_tuple(layers, "layers"))

    @classmethod
    def mla(cls, layers: Sequence[torch.Tensor]) -> PagedKVCache:
        """vLLM's MLA layout: per layer ``[num_blocks, block_size, head_dim]``."""
        return cls(KVLayout.MLA, _as_tensor_tuple(layers, "layers"))

    @classmethod
    def sglang(
        cls, k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor]
    ) -> PagedKVCache:
        """SGLang's layout: per layer a K and a V buffer, each ``[num_slots, heads, head_dim]``."""
        ks = _as_tensor_tuple(k_buffers, "k_buffers")
        vs = _as_tensor_tuple(v_buffers, "v_buffers")
        if len(ks) != len(vs):
            raise ConfigError(
                f"SGLang cache has {len(ks)} K buffers but {len(vs)} V buffers: every layer "
                "needs one of each. Pass the token pool's k_buffer and v_buffer lists."
            )
        return cls(KVLayout.SGLANG, ks + vs)

    def __post_init__(self) -> None:
        try:
            layout = KVLayout(self.layout)
        except ValueError:
            valid = ", ".join(repr(m.value) for m in KVLayout)
            raise ConfigError(f"unknown KV layout {self.layout!r}; use one of {valid}.") from None
        object.__setattr__(self, "layout", layout)
        tensors = _as_tensor_tuple(self.tensors, "tensors")
        object.__setattr__(self, "tensors", tensors)
        if layout is KVLayout.SGLANG and len(tensors) % 2:
            raise ConfigError(
                f"SGLang cache needs K buffers followed by as many V buffers, got {len(tensors)} "
                "tensors in all. Build it with PagedKVCache.sglang(k_buffers, v_buffers)."
            )
        self._check_uniform()
        self._check_shape()
        num_slots, slot_stride = self._slot_geometry()
        row = self._row_span()
        if num_slots > 1 and slot_stride < row:
            raise ConfigError(
                f"{self._name(0)} has slots {slot_stride} elements apart but rows of {row} "
                f"elements, so consecutive slots overlap (strides {tuple(tensors[0].stride())}). "
                "An expanded or aliased tensor cannot hold a KV cache; pass the engine's own "
                "allocation."
            )
        object.__setattr__(self, "num_slots", num_slots)
        object.__setattr__(self, "row_elements", row)
        object.__setattr__(self, "slot_stride", slot_stride)
        self._check_planes_disjoint()
        self._build_rows()

    def _name(self, index: int) -> str:
        if self.layout is KVLayout.SGLANG:
            half = len(self.tensors) // 2
            return f"SGLang {'K' if index < half else 'V'} buffer {index % half}"
        return f"{'vLLM flash' if self.layout is KVLayout.VLLM_FLASH else 'MLA'} layer {index}"

    def _check_uniform(self) -> None:
        first = self.tensors[0]
        for index, tensor in enumerate(self.tensors[1:], start=1):
            for what, mine, theirs in (
                ("dtype", tensor.dtype, first.dtype),
                ("shape", tuple(tensor.shape), tuple(first.shape)),
                ("device", tensor.device, first.device),
                ("strides", tuple(tensor.stride()), tuple(first.stride())),
            ):
                if mine != theirs:
                    raise ConfigError(
                        f"{self._name(index)} has {what} {mine} but {self._name(0)} has "
                        f"{theirs}: every layer of a paged cache must share dtype, shape, device "
                        "and strides. Pass all the layers of one engine's cache, unchanged."
                    )
        if first.dtype not in KV_DTYPES.values():
            supported = ", ".join(KV_DTYPES)
            raise ConfigError(
                f"{self._name(0)} has dtype {first.dtype}, which is not a KV-cache dtype kvplug "
                f"stores. Use a cache in one of: {supported}."
            )

    def _check_shape(self) -> None:
        first = self.tensors[0]
        shape = tuple(first.shape)
        expected = _EXPECTED_SHAPE[self.layout]
        ndim = 5 if self.layout is KVLayout.VLLM_FLASH else 3
        if first.dim() != ndim or (self.layout is KVLayout.VLLM_FLASH and shape[0] != 2):
            raise ConfigError(
                f"{self._name(0)} has shape {shape}; the {self.layout.value} layout needs "
                f"{expected}. Pick the KVLayout constructor that matches the engine's cache."
            )
        if 0 in shape:
            raise ConfigError(
                f"{self._name(0)} has shape {shape} with an empty dimension; a paged cache "
                f"{expected} needs every size >= 1."
            )
        row_dims = 1 if self.layout is KVLayout.MLA else 2
        if not _dims_contiguous(shape[-row_dims:], first.stride()[-row_dims:]):
            what = "head_dim" if row_dims == 1 else "num_heads × head_size"
            raise ConfigError(
                f"{self._name(0)} (shape {shape}, strides {tuple(first.stride())}) does not keep "
                f"one slot's row ({what} elements) contiguous, and kvplug copies each row as one "
                "run of bytes. A head-major (HND) cache viewed as NHD does this; allocate the "
                "cache with the heads and head size as its innermost, dense dimensions."
            )

    def _slot_geometry(self) -> tuple[int, int]:
        """``(num_slots, slot_stride)`` of one plane, merging block and in-block dims."""
        first = self.tensors[0]
        if self.layout is KVLayout.SGLANG:
            sizes, strides = [first.shape[0]], [first.stride(0)]
        else:
            at = 1 if self.layout is KVLayout.VLLM_FLASH else 0
            sizes = list(first.shape[at : at + 2])
            strides = list(first.stride()[at : at + 2])
        kept = [(n, s) for n, s in zip(sizes, strides, strict=True) if n != 1]
        num_slots = _prod(sizes)
        if not kept:
            return 1, self._row_span()
        if len(kept) == 2 and kept[0][1] != kept[1][0] * kept[1][1]:
            (_, block_stride), (block_size, slot_stride) = kept
            raise ConfigError(
                f"{self._name(0)} (shape {tuple(first.shape)}, strides {tuple(first.stride())}) "
                f"does not place its slots at one stride: the block stride {block_stride} is not "
                f"block_size {block_size} × the in-block stride {slot_stride}, so slot = block × "
                "block_size + offset has no single address step. A [num_blocks, 2, block_size, "
                "...] allocation viewed as [2, num_blocks, block_size, ...] does this. Use a "
                "cache whose blocks are consecutive runs of slots, e.g. allocated as "
                "[2, num_blocks, block_size, heads, size] or [num_blocks, block_size, 2, heads, "
                "size]."
            )
        return num_slots, kept[-1][1]

    def _row_span(self) -> int:
        first = self.tensors[0]
        return int(first.shape[-1]) if self.layout is KVLayout.MLA else _prod(first.shape[-2:])

    def _check_planes_disjoint(self) -> None:
        if self.layout is KVLayout.VLLM_FLASH:
            # K and V share one tensor: V's rows must miss every K row. With plane offset
            # q * stride + m, V's slot j lands m elements into K's slot q + j.
            offset = self.tensors[0].stride(0)
            stride, rows, row = self.slot_stride, self.num_slots, self.row_elements
            q, m = divmod(offset, stride)
            if q < rows and (m < row or (m > stride - row and q + 1 < rows)):
                raise ConfigError(
                    f"{self._name(0)} (shape {tuple(self.tensors[0].shape)}, strides "
                    f"{tuple(self.tensors[0].stride())}) has K and V planes that overlap in "
                    "memory, so writing V would overwrite K. Pass the engine's own allocation, "
                    "not an expanded or aliased view."
                )
        itemsize = self.tensors[0].element_size()
        planes = 2 if self.layout is KVLayout.VLLM_FLASH else 1
        addresses = [
            [t.data_ptr() + p * t.stride(0) * itemsize for t in self.tensors] for p in range(planes)
        ]
        if self.layout is KVLayout.SGLANG:
            half = len(self.tensors) // 2
            addresses = [addresses[0][:half], addresses[0][half:]]
        flat = [a for plane in addresses for a in plane]
        seen: dict[int, int] = {}
        for second, address in enumerate(flat):
            first = seen.setdefault(address, second)
            if first == second:
                continue
            raise ConfigError(
                f"{self._name(first % len(self.tensors))} and "
                f"{self._name(second % len(self.tensors))} are the same memory, so a scatter "
                "into one would overwrite the other. Pass each layer's own tensor."
            )
        object.__setattr__(self, "plane_addresses", tuple(tuple(p) for p in addresses))
        bits = self.row_bytes | self.slot_stride_bytes
        for address in flat:
            bits |= address
        object.__setattr__(self, "address_bits", bits)

    def _build_rows(self) -> None:
        rows: list[tuple[torch.Tensor, ...]] = []
        for plane in range(self.kv_planes):
            views = []
            for layer in range(self.num_layers):
                if self.layout is KVLayout.VLLM_FLASH:
                    base = self.tensors[layer].select(0, plane)
                else:
                    base = self.tensors[plane * self.num_layers + layer]
                view = base.as_strided((self.num_slots, self.row_elements), (self.slot_stride, 1))
                views.append(view.view(torch.uint8))
            rows.append(tuple(views))
        object.__setattr__(self, "_rows", tuple(rows))

    @property
    def num_layers(self) -> int:
        return len(self.tensors) // (2 if self.layout is KVLayout.SGLANG else 1)

    @property
    def kv_planes(self) -> int:
        """2 (K and V) or 1 (MLA)."""
        return 1 if self.layout is KVLayout.MLA else 2

    @property
    def dtype(self) -> torch.dtype:
        return self.tensors[0].dtype

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device

    @property
    def memory_format(self) -> MemoryFormat:
        """``KV_MLA_FMT`` for MLA, ``KV_2LTD`` otherwise: the format of this cache's chunks."""
        return MemoryFormat.KV_MLA_FMT if self.layout is KVLayout.MLA else MemoryFormat.KV_2LTD

    @property
    def row_bytes(self) -> int:
        return self.row_elements * self.dtype.itemsize

    @property
    def slot_stride_bytes(self) -> int:
        """Bytes between the starts of two consecutive slots' rows in one plane."""
        return self.slot_stride * self.dtype.itemsize

    def chunk_shape(self, num_tokens: int) -> tuple[int, int, int, int]:
        """Shape of a chunk of ``num_tokens`` tokens: ``(kv_planes, layers, tokens, row)``."""
        if num_tokens < 0:
            raise ConfigError(f"num_tokens must be >= 0, got {num_tokens}.")
        return (self.kv_planes, self.num_layers, num_tokens, self.row_elements)

    def slot_rows(self, plane: int, layer: int) -> torch.Tensor:
        """Plane ``plane`` of layer ``layer`` as a ``[num_slots, row_bytes]`` ``uint8`` view.

        Writes through the view go to the cache.
        """
        return self._rows[plane][layer]

    def plane_pointers(self) -> torch.Tensor:
        """``[kv_planes, num_layers]`` int64 tensor, on the cache's device, of slot-0 addresses.

        vLLM flash: plane 0 is each layer's ``data_ptr()``, plane 1 that plus the K/V stride;
        MLA: one plane; SGLang: the K buffers, then the V buffers. Built once per cache.
        """
        if not self._pointer_tensor:
            self._pointer_tensor.append(
                torch.tensor(self.plane_addresses, dtype=torch.int64, device=self.device)
            )
        return self._pointer_tensor[0]

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(layout={self.layout.name}, layers={self.num_layers}, "
            f"slots={self.num_slots}, row_elements={self.row_elements}, dtype={self.dtype}, "
            f"device={self.device})"
        )


def _prod(values: Sequence[int]) -> int:
    result = 1
    for value in values:
        result *= int(value)
    return result


def _as_tensor_tuple(values: object, what: str) -> tuple[torch.Tensor, ...]:
    if isinstance(values, torch.Tensor):
        raise ConfigError(
            f"{what} must be a sequence of per-layer tensors, not one tensor of shape "
            f"{tuple(values.shape)}. Pass a list, e.g. list(kv_caches)."
        )
    if not isinstance(values, Iterable):
        raise ConfigError(
            f"{what} must be a sequence of per-layer tensors, got {type(values).__name__}."
        )
    result = tuple(values)
    if not result:
        raise ConfigError(f"{what} is empty: a paged KV cache needs at least one layer.")
    for index, value in enumerate(result):
        if not isinstance(value, torch.Tensor):
            raise ConfigError(
                f"{what}[{index}] is a {type(value).__name__}, not a torch.Tensor. Pass the "
                "engine's per-layer cache tensors (for a dict of layers, its values)."
            )
    return result


__all__ = ["KVLayout", "PagedKVCache"]
