"""kvplug.runtime.gpu.offload and load on a CUDA cache: ordering against the streams, bytes, errors.

These run on a GPU machine (scripts/gpu-test.sh) and are skipped elsewhere; the CPU behaviour
of the same functions is tested in tests/test_gpu_pipeline.py. Slow copies are made with
``torch.cuda._sleep`` queued ahead of them on the copy stream, so that a put or a release that
did not wait for its copy would see (or free) memory the GPU has not written yet.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import torch
from test_gpu_pipeline import Scripted  # type: ignore[import-not-found]

from kvplug import CacheKey, FreeListAllocator
from kvplug.errors import BackendUnavailable
from kvplug.runtime.gpu import Impl, PagedKVCache, gather, kernel_available, load, offload
from kvplug.runtime.sync import SyncClient

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU: run scripts/gpu-test.sh on the GPU machine",
)

U8 = torch.uint8
BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE, LAYERS = 64, 16, 8, 128, 4
CHUNK = 64
SLEEP_CYCLES = 200_000_000  # about 0.1 s of one SM: far longer than issuing the whole call
IMPLS: list[Impl] = ["cuda", "torch"]


def cuda_layers(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (2, BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE * 2)
    return [
        torch.randint(0, 256, shape, dtype=U8, generator=gen).view(torch.float16).cuda()
        for _ in range(LAYERS)
    ]


def scattered_slots(tokens: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(BLOCKS, generator=gen)
    return (blocks[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).flatten()[:tokens]


def keys_for(count: int, model: str = "pipeline-cuda") -> list[CacheKey]:
    return [CacheKey(model, 1, 0, 2000 + n) for n in range(count)]


def host_chunks(cache: PagedKVCache, slots: torch.Tensor, count: int) -> list[bytes]:
    """Every chunk's bytes as the torch gather reads them (the reference)."""
    chunks = []
    for n in range(count):
        part = slots[n * CHUNK : (n + 1) * CHUNK]
        out = torch.empty(cache.chunk_shape(part.numel()), dtype=cache.dtype)
        gather(cache, part, out, impl="torch")
        chunks.append(out.view(U8).numpy().tobytes())
    return chunks


def slot_bytes(layers: list[torch.Tensor], slots: torch.Tensor) -> list[torch.Tensor]:
    index = slots.cuda()
    return [layer.view(U8).reshape(2, BLOCKS * BLOCK_SIZE, -1)[:, index].cpu() for layer in layers]


def pinned_scripted(capacity: int = 64 << 20) -> tuple[Scripted, FreeListAllocator]:
    pool = FreeListAllocator(capacity)  # pinned: CUDA is present
    assert pool.buffer.is_pinned()
    pool.buffer.fill_(0xAA)  # stale bytes that no chunk holds
    backend = Scripted("scripted://", allocator=pool)
    asyncio.run(backend.open())
    return backend, pool


@pytest.fixture
def cpu_client() -> Iterator[SyncClient]:
    with SyncClient("cpu://?max_size=256MiB") as client:
        yield client


def slow_stream() -> torch.cuda.Stream:
    """A copy stream whose next work starts only after a long sleep."""
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES)  # type: ignore[no-untyped-call]
    return stream


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("mapping", ["cpu_int64", "cpu_int32", "cuda_int64"])
def test_round_trip_is_bit_exact(
    impl: Impl, depth: int, mapping: str, cpu_client: SyncClient
) -> None:
    if impl == "cuda" and not kernel_available():
        pytest.fail("the copy kernel does not build on this CUDA machine")
    layers = cuda_layers(seed=depth)
    cache = PagedKVCache.vllm_flash(layers)
    slots = scattered_slots(5 * CHUNK + 9)
    expected = host_chunks(cache, slots, 6)
    before = slot_bytes(layers, slots)
    given = slots.to(torch.int32) if mapping == "cpu_int32" else slots
    given = given.cuda() if mapping == "cuda_int64" else given
    keys = keys_for(6)

    offload(cache, given, keys, cpu_client, chunk_tokens=CHUNK, depth=depth, impl=impl)
    for n, key in enumerate(keys):
        got = cpu_client.get(key).result()
        assert got is not None
        assert got.raw.numpy().tobytes() == expected[n], f"chunk {n} differs"
        got.release()

    for layer in layers:
        layer.zero_()
    assert load(cache, given, keys, cpu_client, chunk_tokens=CHUNK, depth=depth, impl=impl) == 6
    for n, (now, then) in enumerate(zip(slot_bytes(layers, slots), before, strict=True)):
        assert torch.equal(now, then), f"layer {n} differs after the load"


@pytest.mark.parametrize("impl", IMPLS)
def test_a_put_is_handed_only_finished_copies(impl: Impl) -> None:
    backend, pool = pinned_scripted()
    cache = PagedKVCache.vllm_flash(cuda_layers(seed=10))
    slots = scattered_slots(4 * CHUNK)
    expected = host_chunks(cache, slots, 4)
    stream = slow_stream()
    with SyncClient(backend) as client:
        offload(cache, slots, keys_for(4), client, chunk_tokens=CHUNK, stream=stream, impl=impl)
    for n, key in enumerate(keys_for(4)):
        assert backend.data[key][0] == expected[n], f"put {n} saw bytes the copy had not written"
    assert pool.stats().used == 0


def test_offload_reads_the_cache_only_after_the_callers_stream_wrote_it(
    cpu_client: SyncClient,
) -> None:
    layers = cuda_layers(seed=11)
    cache = PagedKVCache.vllm_flash(layers)
    slots = scattered_slots(3 * CHUNK)
    engine = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with torch.cuda.stream(engine):
        torch.cuda._sleep(SLEEP_CYCLES)  # type: ignore[no-untyped-call]
        for layer in layers:
            layer.fill_(3.0)  # the "forward pass", still queued when offload is called
        offload(cache, slots, keys_for(3), cpu_client, chunk_tokens=CHUNK)
    for key in keys_for(3):
        got = cpu_client.get(key).result()
        assert got is not None
        assert bool((got.tensor == 3.0).all()), "the gather ran before the caller's stream"
        got.release()


def test_load_writes_the_cache_only_after_the_callers_stream_and_is_visible_on_return(
    cpu_client: SyncClient,
) -> None:
    layers = cuda_layers(seed=12)
    cache = PagedKVCache.vllm_flash(layers)
    slots = scattered_slots(3 * CHUNK)
    before = slot_bytes(layers, slots)
    offload(cache, slots, keys_for(3), cpu_client, chunk_tokens=CHUNK)
    engine = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with torch.cuda.stream(engine):
        torch.cuda._sleep(SLEEP_CYCLES)  # type: ignore[no-untyped-call]
        for layer in layers:
            layer.zero_()  # queued before the load: the load must land after it
        assert load(cache, slots, keys_for(3), cpu_client, chunk_tokens=CHUNK) == 3
        now = slot_bytes(layers, slots)
    assert all(torch.equal(a, b) for a, b in zip(now, before, strict=True))


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_a_miss_stops_the_load_and_writes_nothing_after_it(
    depth: int, cpu_client: SyncClient
) -> None:
    layers = cuda_layers(seed=13)
    cache = PagedKVCache.vllm_flash(layers)
    slots = scattered_slots(5 * CHUNK)
    keys = keys_for(5)
    before = slot_bytes(layers, slots)
    offload(cache, slots, keys, cpu_client, chunk_tokens=CHUNK)
    assert cpu_client.remove(keys[3]).result()
    for layer in layers:
        layer.zero_()
    assert load(cache, slots, keys, cpu_client, chunk_tokens=CHUNK, depth=depth) == 3
    for now, then in zip(slot_bytes(layers, slots), before, strict=True):
        assert torch.equal(now[:, : 3 * CHUNK], then[:, : 3 * CHUNK])
        assert not now[:, 3 * CHUNK :].any()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("depth", [2, 3])
def test_a_failing_put_waits_for_every_queued_copy_before_releasing(impl: Impl, depth: int) -> None:
    backend, pool = pinned_scripted()
    backend.fail_put_at = 1
    cache = PagedKVCache.vllm_flash(cuda_layers(seed=14))
    stream = slow_stream()
    with SyncClient(backend) as client:
        with pytest.raises(BackendUnavailable, match="fails on purpose"):
            offload(
                cache, scattered_slots(6 * CHUNK), keys_for(6), client,
                chunk_tokens=CHUNK, depth=depth, stream=stream, impl=impl,
            )  # fmt: skip
        assert stream.query(), "offload raised while a copy into its memory was still queued"
        assert pool.stats().used == 0


@pytest.mark.parametrize("depth", [2, 3])
def test_a_failing_get_waits_for_every_queued_scatter_before_releasing(depth: int) -> None:
    backend, pool = pinned_scripted()
    layers = cuda_layers(seed=15)
    cache = PagedKVCache.vllm_flash(layers)
    slots = scattered_slots(6 * CHUNK)
    with SyncClient(backend) as client:
        offload(cache, slots, keys_for(6), client, chunk_tokens=CHUNK)
        backend.fail_get_at = 3
        backend.delay = 0.01
        stream = slow_stream()
        with pytest.raises(BackendUnavailable, match="fails on purpose"):
            load(cache, slots, keys_for(6), client, chunk_tokens=CHUNK, depth=depth, stream=stream)
        assert stream.query(), "load raised while a scatter from its memory was still queued"
        assert pool.stats().used == 0
