"""kvplug's CUDA copy kernel against the torch path and the per-token loops, byte for byte.

The CUDA tests run on a GPU machine (scripts/gpu-test.sh) and are skipped elsewhere; the loader
tests at the end run everywhere.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kvplug import FreeListAllocator, KvplugError, MemoryFormat
from kvplug.runtime.gpu import PagedKVCache, gather, scatter
from kvplug.runtime.gpu.kernel import (
    SOURCE_FILES,
    KernelBuildError,
    build_name,
    kernel_sources,
    load_kernel,
)
from kvplug.runtime.gpu.reference import naive_gather, naive_scatter

ROOT = Path(__file__).resolve().parents[1]
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU: run scripts/gpu-test.sh on the GPU machine",
)
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]
LAYOUTS = ["vllm_flash", "vllm_flash_permuted", "vllm_flash_padded_offset", "mla", "sglang"]
LOCATIONS = ["pinned", "cuda"]


@dataclass(frozen=True)
class Geometry:
    layers: int
    num_blocks: int
    block_size: int
    heads: int
    head_size: int

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size


REGULAR = Geometry(layers=3, num_blocks=8, block_size=16, heads=4, head_size=64)
# 3 x 5 elements: 15 bytes a row in fp8, 30 in fp16, 60 in fp32, so vectors narrower than 16.
ODD = Geometry(layers=2, num_blocks=5, block_size=4, heads=3, head_size=5)
# 16 KiB rows (fp16): several passes of every thread over one row.
WIDE = Geometry(layers=2, num_blocks=3, block_size=16, heads=32, head_size=256)


def random_bytes(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype)


def make_cache(
    layout: str, dtype: torch.dtype, g: Geometry, seed: int = 0
) -> tuple[PagedKVCache, list[torch.Tensor]]:
    """A CUDA cache of random bytes and the tensors that own its memory (same seed, same bytes)."""
    nb, bs, heads, size = g.num_blocks, g.block_size, g.heads, g.head_size
    row = heads * size
    owners: list[torch.Tensor] = []

    def owned(numel: int, index: int) -> torch.Tensor:
        tensor = random_bytes(numel, dtype, seed * 1000 + index).cuda()
        owners.append(tensor)
        return tensor

    if layout == "vllm_flash":
        layers = [owned(2 * nb * bs * row, i).view(2, nb, bs, heads, size) for i in range(g.layers)]
        return PagedKVCache.vllm_flash(layers), owners
    if layout == "vllm_flash_permuted":
        # Allocated [num_blocks, block_size, 2, heads, size]: K and V of a slot side by side.
        layers = [
            owned(2 * nb * bs * row, i).view(nb, bs, 2, heads, size).permute(2, 0, 1, 3, 4)
            for i in range(g.layers)
        ]
        return PagedKVCache.vllm_flash(layers), owners
    if layout == "vllm_flash_padded_offset":
        # 3 spare elements after each slot's row and the tensor one element into its storage,
        # so the slot stride is not the row and the addresses are only element-aligned.
        stride = row + 3
        layers = [
            owned(1 + 2 * nb * bs * stride, i).as_strided(
                (2, nb, bs, heads, size), (nb * bs * stride, bs * stride, stride, size, 1), 1
            )
            for i in range(g.layers)
        ]
        return PagedKVCache.vllm_flash(layers), owners
    if layout == "mla":
        layers = [owned(nb * bs * row, i).view(nb, bs, row) for i in range(g.layers)]
        return PagedKVCache.mla(layers), owners
    assert layout == "sglang"
    ks = [owned(nb * bs * row, i).view(nb * bs, heads, size) for i in range(g.layers)]
    vs = [owned(nb * bs * row, 100 + i).view(nb * bs, heads, size) for i in range(g.layers)]
    return PagedKVCache.sglang(ks, vs), owners


def slot_mapping(g: Geometry, tokens: int, seed: int) -> torch.Tensor:
    """Distinct random slots, every fifth one -1 (a token that must not move)."""
    generator = torch.Generator().manual_seed(seed)
    slots = torch.randperm(g.num_slots, generator=generator)[:tokens].clone()
    slots[::5] = -1
    return slots.cuda()


def chunk_like(cache: PagedKVCache, tokens: int, location: str, seed: int) -> torch.Tensor:
    shape = cache.chunk_shape(tokens)
    numel = shape[0] * shape[1] * shape[2] * shape[3]
    data = random_bytes(numel, cache.dtype, seed).view(shape)
    if location == "pinned":
        return data.pin_memory()
    return data.cuda()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))


RANGES = [(0, None), (3, 17)]


def token_count(g: Geometry) -> int:
    return min(37, g.num_slots)


def check_gather(cache: PagedKVCache, slots: torch.Tensor, location: str) -> None:
    for start, end in RANGES:
        tokens = (len(slots) if end is None else end) - start
        fast = chunk_like(cache, tokens, location, seed=7)
        torch_out = chunk_like(cache, tokens, location, seed=7)
        naive_out = chunk_like(cache, tokens, "cuda", seed=7)
        gather(cache, slots, fast, start=start, end=end, impl="cuda")
        gather(cache, slots, torch_out, start=start, end=end, impl="torch")
        naive_gather(cache, slots, naive_out, start=start, end=end)
        assert same_bytes(fast, torch_out), (start, end)
        assert same_bytes(fast, naive_out), (start, end)


def check_scatter(
    build: Callable[[], tuple[PagedKVCache, list[torch.Tensor]]],
    slots: torch.Tensor,
    location: str,
) -> None:
    for start, end in RANGES:
        tokens = (len(slots) if end is None else end) - start
        (fast, fast_mem), (slow, slow_mem), (naive, naive_mem) = build(), build(), build()
        chunk = chunk_like(fast, tokens, location, seed=11)
        scatter(chunk, fast, slots, start=start, end=end, impl="cuda")
        scatter(chunk, slow, slots, start=start, end=end, impl="torch")
        naive_scatter(chunk.cuda(), naive, slots, start=start, end=end)
        torch.cuda.synchronize()
        for a, b, c in zip(fast_mem, slow_mem, naive_mem, strict=True):
            assert same_bytes(a, b), (start, end)
            assert same_bytes(a, c), (start, end)


@needs_cuda
@pytest.mark.parametrize("location", LOCATIONS)
@pytest.mark.parametrize("geometry", [REGULAR, ODD], ids=["regular", "odd-rows"])
@pytest.mark.parametrize("dtype", DTYPES, ids=[str(d).removeprefix("torch.") for d in DTYPES])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_kernel_gather_matches_torch_and_the_token_loop(
    layout: str, dtype: torch.dtype, geometry: Geometry, location: str
) -> None:
    cache, _ = make_cache(layout, dtype, geometry)
    check_gather(cache, slot_mapping(geometry, token_count(geometry), seed=1), location)


@needs_cuda
@pytest.mark.parametrize("location", LOCATIONS)
@pytest.mark.parametrize("geometry", [REGULAR, ODD], ids=["regular", "odd-rows"])
@pytest.mark.parametrize("dtype", DTYPES, ids=[str(d).removeprefix("torch.") for d in DTYPES])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_kernel_scatter_matches_torch_and_the_token_loop(
    layout: str, dtype: torch.dtype, geometry: Geometry, location: str
) -> None:
    slots = slot_mapping(geometry, token_count(geometry), seed=2)
    check_scatter(lambda: make_cache(layout, dtype, geometry), slots, location)


@needs_cuda
@pytest.mark.parametrize("location", LOCATIONS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["float16", "float32"])
def test_kernel_moves_wide_rows_in_several_passes(dtype: torch.dtype, location: str) -> None:
    slots = slot_mapping(WIDE, token_count(WIDE), seed=3)
    cache, _ = make_cache("vllm_flash", dtype, WIDE)
    check_gather(cache, slots, location)
    check_scatter(lambda: make_cache("vllm_flash", dtype, WIDE), slots, location)


@needs_cuda
def test_kernel_round_trips_a_chunk_through_a_pinned_memory_object() -> None:
    g = Geometry(layers=4, num_blocks=32, block_size=16, heads=8, head_size=128)
    source, _ = make_cache("vllm_flash", torch.bfloat16, g, seed=1)
    target, _ = make_cache("vllm_flash", torch.bfloat16, g, seed=2)
    allocator = FreeListAllocator(1 << 24)
    obj = allocator.allocate(source.chunk_shape(256), torch.bfloat16, MemoryFormat.KV_2LTD)
    assert obj is not None and obj.tensor.is_pinned()
    slots = torch.randperm(g.num_slots)[:256].cuda()
    gather(source, slots, obj.tensor, impl="cuda")
    scatter(obj.tensor, target, slots, impl="cuda")
    for plane in range(2):
        for layer in range(g.layers):
            assert same_bytes(
                source.slot_rows(plane, layer)[slots], target.slot_rows(plane, layer)[slots]
            )
    obj.release()
    assert allocator.stats().used == 0


@needs_cuda
def test_transfer_runs_on_the_current_stream_without_synchronizing() -> None:
    cache, _ = make_cache("vllm_flash", torch.float16, REGULAR)
    slots = slot_mapping(REGULAR, 40, seed=4)
    expected = chunk_like(cache, 40, "cuda", seed=5)
    gather(cache, slots, expected, impl="torch")
    out = chunk_like(cache, 40, "cuda", seed=5)
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        load_kernel().transfer(
            out, cache.plane_pointers(), slots, cache.slot_stride_bytes, 16, True
        )
    side.synchronize()
    assert same_bytes(out, expected)


def _transfer_args(
    cache: PagedKVCache, chunk: torch.Tensor, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int, bool]:
    return chunk, cache.plane_pointers(), slots, cache.slot_stride_bytes, 2, True


@needs_cuda
def test_an_unpinned_host_chunk_is_a_clear_error() -> None:
    cache, _ = make_cache("vllm_flash", torch.float16, REGULAR)
    slots = slot_mapping(REGULAR, 8, seed=6)
    chunk = torch.zeros(cache.chunk_shape(8), dtype=torch.float16)
    with pytest.raises(RuntimeError, match="not in pinned"):
        load_kernel().transfer(*_transfer_args(cache, chunk, slots))
    with pytest.raises((KvplugError, RuntimeError), match="pinned"):
        gather(cache, slots, chunk, impl="cuda")
    torch.cuda.synchronize()  # the context is still usable


@needs_cuda
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("slots_int32", "slot_mapping must be an int64 CUDA tensor"),
        ("slots_on_host", "slot_mapping must be an int64 CUDA tensor"),
        ("slots_too_few", "one per token"),
        ("pointers_shape", "plane_pointers must be a contiguous"),
        ("vec_3", "vec_bytes must be 1, 2, 4, 8 or 16"),
        ("vec_too_wide", "must divide the row"),
        ("chunk_3d", "must be 4-D"),
        ("chunk_strided", "must be contiguous"),
        ("stride_below_row", "slots would overlap"),
    ],
)
def test_transfer_rejects_bad_arguments_with_clear_messages(change: str, message: str) -> None:
    cache, _ = make_cache("vllm_flash", torch.float16, ODD)
    slots = slot_mapping(ODD, 8, seed=6)
    chunk, pointers, slots, stride, vec, to_chunk = _transfer_args(
        cache, chunk_like(cache, 8, "cuda", seed=1), slots
    )
    if change == "slots_int32":
        slots = slots.int()
    elif change == "slots_on_host":
        slots = slots.cpu()
    elif change == "slots_too_few":
        slots = slots[:-1]
    elif change == "pointers_shape":
        pointers = pointers.flatten()
    elif change == "vec_3":
        vec = 3
    elif change == "vec_too_wide":
        vec = 16  # a row of 15 fp16 elements is 30 bytes
    elif change == "chunk_3d":
        chunk = chunk[0]
    elif change == "chunk_strided":
        chunk = chunk.transpose(0, 1)
    elif change == "stride_below_row":
        stride = 2
    with pytest.raises(RuntimeError, match=message):
        load_kernel().transfer(chunk, pointers, slots, stride, vec, to_chunk)


@needs_cuda
def test_the_kernel_is_built_once_per_process() -> None:
    assert load_kernel() is load_kernel()
    assert load_kernel().__name__ == build_name(kernel_sources())


@needs_cuda
def test_a_source_that_does_not_compile_is_a_kernel_build_error(tmp_path: Path) -> None:
    for name in SOURCE_FILES:
        shutil.copy(kernel_sources() / name, tmp_path / name)
    for name in ("kvplug_copy.cu", "binding.cpp"):
        text = (tmp_path / name).read_text()
        (tmp_path / name).write_text("#error kvplug-test-broken-source\n" + text)
    with pytest.raises(KernelBuildError, match="kvplug-test-broken-source") as first:
        load_kernel(tmp_path)
    assert "CUDA_HOME" in str(first.value) and "impl='torch'" in str(first.value)
    with pytest.raises(KernelBuildError, match="kvplug-test-broken-source"):
        load_kernel(tmp_path)  # remembered, not compiled again


# The loader, wherever torch is.


def test_the_sources_are_found_in_the_repository() -> None:
    assert kernel_sources() == ROOT / "csrc"
    assert {p.name for p in (ROOT / "csrc").iterdir()} >= set(SOURCE_FILES)


def test_the_wheel_ships_the_sources_next_to_the_package() -> None:
    config = tomllib.loads((ROOT / "core" / "pyproject.toml").read_text())
    force_include = config["tool"]["hatch"]["build"]["targets"]["wheel"]["force-include"]
    assert force_include == {"../csrc": "kvplug/csrc"}  # where kernel_sources() looks first


def test_edited_sources_get_a_new_build_name(tmp_path: Path) -> None:
    for name in SOURCE_FILES:
        shutil.copy(kernel_sources() / name, tmp_path / name)
    before = build_name(tmp_path)
    assert before == build_name(kernel_sources())
    (tmp_path / "kvplug_copy.h").write_text((tmp_path / "kvplug_copy.h").read_text() + "\n")
    assert build_name(tmp_path) != before and build_name(tmp_path).startswith("kvplug_copy_")


def test_missing_sources_are_a_kernel_build_error(tmp_path: Path) -> None:
    (tmp_path / "kvplug_copy.cu").write_text("")
    with pytest.raises(KernelBuildError, match=r"missing kvplug_copy\.h, binding\.cpp"):
        load_kernel(tmp_path)


@pytest.mark.skipif(torch.version.cuda is not None, reason="needs a CPU-only build of torch")
def test_a_cpu_build_of_torch_is_a_kernel_build_error_naming_the_fix() -> None:
    with pytest.raises(KernelBuildError, match=r"build without CUDA.*impl='torch'"):
        load_kernel()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks its message without CUDA")
def test_the_gpu_benchmark_says_it_needs_cuda() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_gpu_copy.py")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "needs a CUDA GPU" in done.stdout
