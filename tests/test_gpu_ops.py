"""kvplug.runtime.gpu on the CPU: layouts, the torch gather/scatter against the per-token oracle,
errors.

The CUDA kernel is tested against the same oracle in tests/test_gpu_kernel_cuda.py.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplug.errors import ConfigError, KvplugError
from kvplug.memory import FreeListAllocator, MemoryFormat, MemoryObj
from kvplug.runtime.gpu import IMPLS, KVLayout, PagedKVCache, gather, kernel_available, ops, scatter
from kvplug.runtime.gpu.reference import naive_gather, naive_scatter

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]
VARIANTS = ["contiguous", "padded", "offset", "kv_inside_block"]
U8 = torch.uint8


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A contiguous tensor of random bytes (any bit pattern, NaNs included)."""
    *lead, last = shape
    raw = torch.randint(0, 256, (*lead, last * dtype.itemsize), dtype=U8, generator=gen)
    return raw.view(dtype)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).contiguous().view(U8)


@dataclass
class Geometry:
    layout: KVLayout
    dtype: torch.dtype
    variant: str
    layers: int
    blocks: int
    block_size: int
    heads: int
    head_size: int

    @property
    def num_slots(self) -> int:
        return self.blocks * self.block_size


def build(geo: Geometry, seed: int) -> tuple[PagedKVCache, list[torch.Tensor]]:
    """The cache and the base tensors that own its memory (padding included)."""
    gen = torch.Generator().manual_seed(seed)
    n, bs, h, d = geo.blocks, geo.block_size, geo.heads, geo.head_size
    pad, off = 3, 5
    bases: list[torch.Tensor] = []

    def one(shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor of ``shape`` laid out as the variant says; rows are its last two dims."""
        rows, row = shape[:-2], shape[-2] * shape[-1]
        if geo.variant == "padded":
            base = random_tensor((*rows, row + pad), geo.dtype, gen)
            bases.append(base)
            return base[..., :row].unflatten(-1, shape[-2:])
        if geo.variant == "offset":
            base = random_tensor((off + int(torch.Size(shape).numel()),), geo.dtype, gen)
            bases.append(base)
            return base[off:].view(shape)
        base = random_tensor(shape, geo.dtype, gen)
        bases.append(base)
        return base

    tensors: list[torch.Tensor]
    if geo.layout is KVLayout.VLLM_FLASH:
        if geo.variant == "kv_inside_block":
            tensors = [one((n, bs, 2, h, d)).permute(2, 0, 1, 3, 4) for _ in range(geo.layers)]
        else:
            tensors = [one((2, n, bs, h, d)) for _ in range(geo.layers)]
        return PagedKVCache.vllm_flash(tensors), bases
    if geo.layout is KVLayout.MLA:
        tensors = [one((n, bs, 1, d)).squeeze(2) for _ in range(geo.layers)]
        return PagedKVCache.mla(tensors), bases
    ks = [one((n * bs, h, d)) for _ in range(geo.layers)]
    vs = [one((n * bs, h, d)) for _ in range(geo.layers)]
    return PagedKVCache.sglang(ks, vs), bases


@st.composite
def geometries(draw: st.DrawFn) -> Geometry:
    layout = draw(st.sampled_from(list(KVLayout)))
    variants = VARIANTS if layout is KVLayout.VLLM_FLASH else VARIANTS[:3]
    return Geometry(
        layout=layout,
        dtype=draw(st.sampled_from(DTYPES)),
        variant=draw(st.sampled_from(variants)),
        layers=draw(st.integers(1, 3)),
        blocks=draw(st.integers(1, 5)),
        block_size=draw(st.integers(1, 4)),
        heads=draw(st.integers(1, 3)),
        head_size=draw(st.sampled_from([1, 2, 3, 5, 8, 16])),
    )


@st.composite
def mappings(draw: st.DrawFn, num_slots: int, unique: bool) -> tuple[torch.Tensor, int, int]:
    """A slot mapping with -1 holes (unique slots for scatter) and a token range in it."""
    if unique:
        slots = draw(st.permutations(range(num_slots)))[: draw(st.integers(0, num_slots))]
        holes = draw(st.integers(0, 3))
        values = list(slots)
        for _ in range(holes):
            values.insert(draw(st.integers(0, len(values))), -1)
    else:
        values = draw(st.lists(st.integers(-1, num_slots - 1), max_size=12))
    dtype = draw(st.sampled_from([torch.int64, torch.int32]))
    start = draw(st.integers(0, len(values)))
    end = draw(st.integers(start, len(values)))
    return torch.tensor(values, dtype=dtype), start, end


PROPERTY = settings(max_examples=100, deadline=None)


@PROPERTY
@given(geo=geometries(), seed=st.integers(0, 2**31), data=st.data())
def test_torch_gather_equals_the_per_token_loop(
    geo: Geometry, seed: int, data: st.DataObject
) -> None:
    cache, _ = build(geo, seed)
    slots, start, end = data.draw(mappings(geo.num_slots, unique=False))
    before = random_tensor(cache.chunk_shape(end - start), geo.dtype, torch.Generator())
    fast, slow = before.clone(), before.clone()
    impl = data.draw(st.sampled_from(["auto", "torch"]))
    gather(cache, slots, fast, start=start, end=end, impl=impl)
    naive_gather(cache, slots, slow, start=start, end=end)
    assert torch.equal(as_bytes(fast), as_bytes(slow))
    holes = (slots[start:end] < 0).nonzero().flatten()
    assert torch.equal(as_bytes(fast[:, :, holes]), as_bytes(before[:, :, holes]))


@PROPERTY
@given(geo=geometries(), seed=st.integers(0, 2**31), data=st.data())
def test_torch_scatter_equals_the_per_token_loop_and_touches_only_mapped_slots(
    geo: Geometry, seed: int, data: st.DataObject
) -> None:
    fast_cache, fast_bases = build(geo, seed)
    slow_cache, slow_bases = build(geo, seed)
    untouched = [as_bytes(b).clone() for b in fast_bases]
    slots, start, end = data.draw(mappings(geo.num_slots, unique=True))
    chunk = random_tensor(fast_cache.chunk_shape(end - start), geo.dtype, torch.Generator())
    impl = data.draw(st.sampled_from(["auto", "torch"]))
    scatter(chunk, fast_cache, slots, start=start, end=end, impl=impl)
    naive_scatter(chunk, slow_cache, slots, start=start, end=end)
    for fast, slow in zip(fast_bases, slow_bases, strict=True):
        assert torch.equal(as_bytes(fast), as_bytes(slow))
    # Restoring the mapped slots' rows from the snapshot gives back every byte: nothing else moved.
    restore, _ = build(geo, seed)
    naive_gather(restore, slots, chunk, start=start, end=end)
    naive_scatter(chunk, fast_cache, slots, start=start, end=end)
    for fast, before in zip(fast_bases, untouched, strict=True):
        assert torch.equal(as_bytes(fast), before)


@PROPERTY
@given(geo=geometries(), seed=st.integers(0, 2**31), data=st.data())
def test_gather_then_scatter_round_trips_into_allocator_memory(
    geo: Geometry, seed: int, data: st.DataObject
) -> None:
    cache, bases = build(geo, seed)
    slots, start, end = data.draw(mappings(geo.num_slots, unique=True))
    allocator = FreeListAllocator(1 << 16, pin=False)
    obj = allocator.allocate(cache.chunk_shape(end - start), geo.dtype, cache.memory_format)
    assert obj is not None
    gather(cache, slots, obj, start=start, end=end)
    expected = torch.zeros_like(obj.tensor)
    naive_gather(cache, slots, expected, start=start, end=end)
    mapped = (slots[start:end] >= 0).nonzero().flatten()
    assert torch.equal(as_bytes(obj.tensor[:, :, mapped]), as_bytes(expected[:, :, mapped]))
    snapshot = [as_bytes(b).clone() for b in bases]
    scatter(obj, cache, slots, start=start, end=end)
    for base, before in zip(bases, snapshot, strict=True):
        assert torch.equal(as_bytes(base), before)
    obj.release()


def small_vllm(**kwargs: int) -> list[torch.Tensor]:
    shape = (2, kwargs.get("blocks", 4), kwargs.get("block_size", 4), 2, kwargs.get("size", 8))
    return [torch.randn(shape, dtype=torch.float16) for _ in range(kwargs.get("layers", 2))]


@pytest.mark.parametrize(
    ("make", "fmt", "planes", "row"),
    [
        (lambda: PagedKVCache.vllm_flash(small_vllm()), MemoryFormat.KV_2LTD, 2, 16),
        (
            lambda: PagedKVCache.mla([torch.zeros(4, 4, 24, dtype=torch.bfloat16)] * 1),
            MemoryFormat.KV_MLA_FMT,
            1,
            24,
        ),
        (
            lambda: PagedKVCache.sglang(
                [torch.zeros(16, 2, 8), torch.zeros(16, 2, 8)],
                [torch.zeros(16, 2, 8), torch.zeros(16, 2, 8)],
            ),
            MemoryFormat.KV_2LTD,
            2,
            16,
        ),
    ],
    ids=["vllm_flash", "mla", "sglang"],
)
def test_each_layout_reports_its_geometry(
    make: Callable[[], PagedKVCache], fmt: MemoryFormat, planes: int, row: int
) -> None:
    cache = make()
    assert cache.memory_format is fmt
    assert cache.kv_planes == planes
    assert cache.row_elements == row
    assert cache.num_slots == 16
    assert cache.chunk_shape(5) == (planes, cache.num_layers, 5, row)
    assert cache.slot_stride_bytes == row * cache.dtype.itemsize
    assert cache.plane_pointers().shape == (planes, cache.num_layers)
    assert "layers=" in repr(cache)


def test_vllm_plane_pointers_are_each_layers_k_and_v_addresses_built_once() -> None:
    layers = small_vllm(layers=3)
    cache = PagedKVCache.vllm_flash(layers)
    pointers = cache.plane_pointers()
    assert pointers.dtype == torch.int64
    assert pointers.device == layers[0].device
    assert pointers[0].tolist() == [t.data_ptr() for t in layers]
    assert pointers[1].tolist() == [t.data_ptr() + t.stride(0) * 2 for t in layers]
    assert cache.plane_pointers() is pointers


def test_sglang_plane_pointers_are_the_k_buffers_then_the_v_buffers() -> None:
    ks = [torch.zeros(8, 1, 4) for _ in range(2)]
    vs = [torch.zeros(8, 1, 4) for _ in range(2)]
    cache = PagedKVCache.sglang(ks, vs)
    assert cache.plane_pointers().tolist() == [
        [t.data_ptr() for t in ks],
        [t.data_ptr() for t in vs],
    ]
    assert cache.tensors == (*ks, *vs)


def test_vllm_cache_with_the_kv_dim_inside_the_block_works() -> None:
    # Allocated [num_blocks, block_size, 2, heads, size] and viewed as vLLM's
    # [2, num_blocks, block_size, heads, size]: not contiguous, but slots are 2 rows apart.
    bases = [torch.randn(3, 4, 2, 2, 8) for _ in range(2)]
    layers = [b.permute(2, 0, 1, 3, 4) for b in bases]
    assert not layers[0].is_contiguous()
    cache = PagedKVCache.vllm_flash(layers)
    assert cache.slot_stride_bytes == 2 * 16 * 4
    slots = torch.tensor([0, 5, 11, -1, 7])
    chunk = torch.full(cache.chunk_shape(5), 9.0)
    gather(cache, slots, chunk)
    assert torch.equal(chunk[1, 1, 2], bases[1][2, 3, 1].flatten())
    assert torch.equal(chunk[0, 0, 1], bases[0][1, 1, 0].flatten())
    assert bool((chunk[:, :, 3] == 9.0).all())


def test_vllm_cache_with_blocks_interleaving_k_and_v_is_rejected_naming_the_fix() -> None:
    layers = [torch.zeros(3, 2, 4, 2, 8).permute(1, 0, 2, 3, 4)]
    with pytest.raises(ConfigError, match="does not place its slots at one stride") as info:
        PagedKVCache.vllm_flash(layers)
    assert "block_size 4" in str(info.value)
    assert "[num_blocks, block_size, 2, heads, size]" in str(info.value)
    # With one slot per block (or one block) the slots are uniform again.
    PagedKVCache.vllm_flash([torch.zeros(3, 2, 1, 2, 8).permute(1, 0, 2, 3, 4)])


def test_head_major_rows_are_rejected() -> None:
    layer = torch.zeros(2, 4, 2, 16, 8).transpose(2, 3)  # HND viewed as NHD
    with pytest.raises(ConfigError, match=r"row .* contiguous"):
        PagedKVCache.vllm_flash([layer])


@pytest.mark.parametrize(
    ("layers", "message"),
    [
        ([], "at least one layer"),
        (torch.zeros(2, 2, 2, 2, 2), "not one tensor"),
        ([torch.zeros(2, 2, 2, 2, 2), "layer"], r"layers\[1\] is a str"),
        ([torch.zeros(2, 4, 4, 2, 8), torch.zeros(2, 4, 4, 2, 8).half()], "dtype"),
        ([torch.zeros(2, 4, 4, 2, 8), torch.zeros(2, 5, 4, 2, 8)], "shape"),
        ([torch.zeros(2, 4, 4, 2, 8), torch.zeros(2, 4, 4, 2, 8, device="meta")], "device"),
        (
            [torch.zeros(2, 4, 4, 2, 8), torch.zeros(2, 4, 4, 2, 16)[..., :8]],
            "strides",
        ),
        ([torch.zeros(2, 4, 4, 2, 8, dtype=torch.int32)], "not a KV-cache dtype"),
        ([torch.zeros(3, 4, 4, 2, 8)], r"needs \[2, num_blocks"),
        ([torch.zeros(4, 4, 2, 8)], r"needs \[2, num_blocks"),
        ([torch.zeros(2, 0, 4, 2, 8)], "empty dimension"),
        ([torch.zeros(1, 4, 4, 2, 8).expand(2, -1, -1, -1, -1)], "K and V planes that overlap"),
        ([torch.zeros(2, 1, 4, 2, 8).expand(-1, 3, -1, -1, -1)], "block stride 0"),
    ],
    ids=[
        "empty",
        "one tensor",
        "not a tensor",
        "dtype",
        "shape",
        "device",
        "strides",
        "int dtype",
        "three planes",
        "four dims",
        "zero blocks",
        "expanded kv",
        "expanded blocks",
    ],
)
def test_bad_vllm_layers_are_rejected_with_the_problem_named(layers: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        PagedKVCache.vllm_flash(layers)  # type: ignore[arg-type]


def test_the_same_layer_twice_is_rejected() -> None:
    layer = torch.zeros(2, 4, 4, 2, 8)
    with pytest.raises(ConfigError, match="layer 0 and vLLM flash layer 1 are the same memory"):
        PagedKVCache.vllm_flash([layer, layer])
    buf = torch.zeros(8, 2, 4)
    with pytest.raises(ConfigError, match="K buffer 0 and SGLang V buffer 0"):
        PagedKVCache.sglang([buf], [buf])


def test_overlapping_slots_are_rejected() -> None:
    def overlapping() -> torch.Tensor:
        return torch.zeros(64).as_strided((8, 2, 4), (4, 4, 1))  # slots 4 apart, rows of 8

    with pytest.raises(ConfigError, match="consecutive slots overlap"):
        PagedKVCache.sglang([overlapping()], [overlapping()])


def test_sglang_needs_as_many_v_buffers_as_k_buffers() -> None:
    with pytest.raises(ConfigError, match="2 K buffers but 1 V buffers"):
        PagedKVCache.sglang([torch.zeros(4, 1, 2)] * 2, [torch.zeros(4, 1, 2)])
    with pytest.raises(ConfigError, match="as many V buffers"):
        PagedKVCache(KVLayout.SGLANG, (torch.zeros(4, 1, 2),))


def test_an_unknown_layout_is_rejected() -> None:
    with pytest.raises(ConfigError, match="unknown KV layout 'paged'"):
        PagedKVCache("paged", (torch.zeros(4, 1, 2),))  # type: ignore[arg-type]


@pytest.fixture
def cache() -> PagedKVCache:
    return PagedKVCache.vllm_flash(small_vllm())


def test_gather_rejects_a_chunk_of_the_wrong_shape_naming_both(cache: PagedKVCache) -> None:
    with pytest.raises(ConfigError) as info:
        gather(cache, torch.arange(3), torch.zeros(2, 2, 4, 16, dtype=torch.float16))
    assert "shape (2, 2, 4, 16), expected (2, 2, 3, 16)" in str(info.value)


def test_gather_rejects_a_chunk_of_the_wrong_dtype_naming_both(cache: PagedKVCache) -> None:
    with pytest.raises(
        ConfigError, match=r"dtype torch.float32, expected the cache's torch.float16"
    ):
        gather(cache, torch.arange(3), torch.zeros(2, 2, 3, 16))


def test_scatter_rejects_a_chunk_of_the_wrong_shape(cache: PagedKVCache) -> None:
    with pytest.raises(ConfigError, match="scatter's chunk has shape"):
        scatter(torch.zeros(1, 2, 3, 16, dtype=torch.float16), cache, torch.arange(3))


def test_a_non_contiguous_chunk_is_rejected(cache: PagedKVCache) -> None:
    chunk = torch.zeros(2, 2, 16, 3, dtype=torch.float16).transpose(2, 3)
    with pytest.raises(ConfigError, match="not contiguous"):
        gather(cache, torch.arange(3), chunk)


def test_a_memory_obj_in_another_format_is_rejected(cache: PagedKVCache) -> None:
    obj = MemoryObj.from_tensor(torch.zeros(2, 2, 3, 16, dtype=torch.float16), MemoryFormat.KV_2TD)
    with pytest.raises(ConfigError, match=r"format KV_2TD.*fmt=MemoryFormat\.KV_2LTD"):
        gather(cache, torch.arange(3), obj)
    with pytest.raises(ConfigError, match=r"must be a MemoryObj or a torch\.Tensor"):
        gather(cache, torch.arange(3), [0.0])  # type: ignore[arg-type]


def test_a_slot_past_the_cache_is_rejected_unless_validation_is_off(cache: PagedKVCache) -> None:
    chunk = torch.zeros(cache.chunk_shape(2), dtype=torch.float16)
    with pytest.raises(ConfigError, match="holds slot 16, but the cache has 16 slots"):
        gather(cache, torch.tensor([3, 16]), chunk)
    with pytest.raises(ConfigError, match="holds slot 99"):
        scatter(chunk, cache, torch.tensor([99, 0, 1]), end=2)
    # The range is what is checked: a bad slot outside start:end is never read.
    scatter(chunk, cache, torch.tensor([99, 0, 1]), start=1)
    gather(cache, torch.tensor([1, 2]), chunk, validate=False)


@pytest.mark.parametrize(
    ("slots", "start", "end", "message"),
    [
        (torch.zeros(2, 2, dtype=torch.int64), 0, None, "1-D int64 or int32"),
        (torch.zeros(2), 0, None, "1-D int64 or int32"),
        ([0, 1], 0, None, "must be a torch.Tensor"),
        (torch.arange(4), 3, 2, "start=3, end=2"),
        (torch.arange(4), 0, 5, "does not fit slot_mapping of length 4"),
        (torch.arange(4), -1, None, "start=-1"),
    ],
)
def test_bad_slot_mappings_are_rejected(
    cache: PagedKVCache, slots: object, start: int, end: int | None, message: str
) -> None:
    chunk = torch.zeros(cache.chunk_shape(0), dtype=torch.float16)
    with pytest.raises(ConfigError, match=message):
        gather(cache, slots, chunk, start=start, end=end)  # type: ignore[arg-type]


def test_an_empty_range_copies_nothing() -> None:
    layers = small_vllm()
    cache = PagedKVCache.vllm_flash(layers)
    before = [layer.clone() for layer in layers]
    chunk = torch.full(cache.chunk_shape(0), 7.0, dtype=torch.float16)
    gather(cache, torch.arange(4), chunk, start=2, end=2)
    assert chunk.shape == cache.chunk_shape(0) and chunk.numel() == 0
    scatter(chunk, cache, torch.tensor([], dtype=torch.int64))
    scatter(chunk, cache, torch.arange(4), start=3, end=3)
    assert all(torch.equal(layer, old) for layer, old in zip(layers, before, strict=True))


def test_impl_cuda_on_a_cpu_cache_is_a_clear_error(cache: PagedKVCache) -> None:
    chunk = torch.zeros(cache.chunk_shape(2), dtype=torch.float16)
    with pytest.raises(ConfigError, match=r"impl='cuda' needs a cache on a CUDA device.*cpu"):
        gather(cache, torch.arange(2), chunk, impl="cuda")
    with pytest.raises(ConfigError, match="impl='cuda' needs a cache on a CUDA device"):
        scatter(chunk, cache, torch.arange(2), impl="cuda")


def test_an_unknown_impl_gets_a_did_you_mean(cache: PagedKVCache) -> None:
    chunk = torch.zeros(cache.chunk_shape(2), dtype=torch.float16)
    with pytest.raises(ConfigError, match="unknown impl 'cdua' \\(did you mean 'cuda'\\?\\)"):
        gather(cache, torch.arange(2), chunk, impl="cdua")  # type: ignore[arg-type]
    assert IMPLS == ("auto", "torch", "cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present here")
def test_the_kernel_is_not_available_without_cuda() -> None:
    assert kernel_available() is False


def test_importing_and_using_kvplug_gpu_on_cpu_never_loads_the_kernel() -> None:
    code = (
        "import sys, torch\n"
        "from kvplug.runtime.gpu import PagedKVCache, gather\n"
        "c = PagedKVCache.mla([torch.zeros(2, 2, 4)])\n"
        "gather(c, torch.arange(3), torch.zeros(c.chunk_shape(3)))\n"
        "assert 'kvplug.runtime.gpu.kernel' not in sys.modules\n"
        "assert 'torch.utils.cpp_extension' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_pageable_host_chunk_is_not_for_the_kernel(cache: PagedKVCache) -> None:
    problem = ops._kernel_chunk_problem(cache, torch.zeros(cache.chunk_shape(1)))
    assert problem is not None
    assert "pinned" in problem
    assert "FreeListAllocator" in problem


@pytest.mark.parametrize(
    ("dtype", "size", "offset_bytes", "expected"),
    [
        (torch.float16, 3, 0, 2),  # 6-byte rows
        (torch.float16, 6, 0, 4),
        (torch.float16, 8, 0, 16),
        (torch.float32, 2, 0, 8),
        (torch.float8_e4m3fn, 5, 0, 1),
        (torch.float16, 64, 4, 4),  # rows fine, the cache starts 4 bytes into an allocation
    ],
)
def test_the_kernel_access_width_divides_rows_strides_and_addresses(
    dtype: torch.dtype, size: int, offset_bytes: int, expected: int
) -> None:
    count = offset_bytes // dtype.itemsize
    layer = torch.zeros(count + 2 * 4 * 4 * size, dtype=dtype)[count:].view(2, 4, 4, 1, size)
    cache = PagedKVCache.vllm_flash([layer])
    chunk = FreeListAllocator(1 << 16, pin=False).allocate(cache.chunk_shape(3), dtype)
    assert chunk is not None
    assert ops._vec_bytes(cache, chunk.tensor) == expected
    chunk.release()


def test_auto_falls_back_to_torch_once_with_one_warning_when_the_kernel_fails_to_build(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    class KernelBuildError(KvplugError):
        pass

    calls = []

    def load_kernel() -> types.ModuleType:
        calls.append(1)
        raise KernelBuildError("nvcc: error: no such file ninja")

    fake = types.ModuleType("kvplug.runtime.gpu.kernel")
    fake.KernelBuildError = KernelBuildError  # type: ignore[attr-defined]
    fake.load_kernel = load_kernel  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvplug.runtime.gpu.kernel", fake)
    monkeypatch.setattr(ops, "_kernel_error", None)
    with caplog.at_level(logging.WARNING, logger="kvplug.gpu"):
        assert ops._auto_kernel() is None
        assert ops._auto_kernel() is None
    assert len(calls) == 1
    assert [r.getMessage() for r in caplog.records if "nvcc: error" in r.getMessage()]
    assert len(caplog.records) == 1
