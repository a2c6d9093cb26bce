"""kvplug.runtime.gpu.offload and load on the CPU: round trips, misses, errors, memory and depth.

Without CUDA the pipeline runs one chunk after the other through the torch gather and scatter;
what it guarantees (bytes, prefix loads, ownership, bounded memory) is the same, and is
checked here. The overlap on a GPU is checked in tests/test_gpu_pipeline_cuda.py.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import pytest
import torch

import kvplug
from kvplug import CacheKey, FreeListAllocator, MemoryObj
from kvplug.backend import Backend, Capabilities
from kvplug.errors import BackendUnavailable, CapacityExceeded, ConfigError
from kvplug.runtime.config import Config
from kvplug.runtime.gpu import DEFAULT_DEPTH, PagedKVCache, gather, load, offload, pipeline, scatter
from kvplug.runtime.sync import SyncClient

U8 = torch.uint8
BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE, LAYERS = 24, 16, 2, 32, 3
CHUNK = 16
CHUNK_BYTES = 2 * LAYERS * CHUNK * HEADS * HEAD_SIZE * 2  # fp16 vLLM flash chunk of 16 tokens


def random_layers(seed: int, dtype: torch.dtype = torch.float16) -> list[torch.Tensor]:
    """vLLM flash layers of random bytes (any bit pattern, NaNs included)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (2, BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE * dtype.itemsize)
    return [
        torch.randint(0, 256, shape, dtype=U8, generator=gen).view(dtype) for _ in range(LAYERS)
    ]


def scattered_slots(tokens: int, seed: int = 1) -> torch.Tensor:
    """``tokens`` slots over blocks in random order (a partial last block allowed)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(BLOCKS, generator=gen)
    return (blocks[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).flatten()[:tokens]


def keys_for(count: int, model: str = "pipeline") -> list[CacheKey]:
    return [CacheKey(model, 1, 0, 1000 + n) for n in range(count)]


def chunk_bytes(cache: PagedKVCache, slots: torch.Tensor, index: int) -> torch.Tensor:
    """Chunk ``index`` of ``slots`` as read straight from the cache, in bytes."""
    part = slots[index * CHUNK : (index + 1) * CHUNK]
    out = torch.empty(cache.chunk_shape(part.numel()), dtype=cache.dtype)
    gather(cache, part, out, impl="torch")
    return out.view(U8)


def slot_bytes(layers: list[torch.Tensor], slots: torch.Tensor) -> list[torch.Tensor]:
    """The bytes of ``slots`` in every plane of every layer (to compare cache contents)."""
    rows = []
    for layer in layers:
        flat = layer.view(U8).reshape(2, BLOCKS * BLOCK_SIZE, -1)
        rows.append(flat[:, slots].clone())
    return rows


@pytest.fixture
def cpu_client() -> Iterator[SyncClient]:
    with SyncClient("cpu://?max_size=16MiB") as client:
        yield client


@pytest.fixture
def cpu_backend() -> Iterator[Backend]:
    backend = asyncio.run(kvplug.open_backend("cpu://?max_size=16MiB"))
    yield backend
    asyncio.run(backend.close())


class Scripted(Backend):
    """A store in a dict whose objects live in the given allocator (gets return copies there).

    ``fail_put_at`` / ``fail_get_at``: the n-th put or get (from 1) raises BackendUnavailable.
    ``delay``: seconds each operation sleeps, so several are in flight at once. It records the
    allocator's live objects and the operations in flight at their highest.
    """

    capabilities = Capabilities(remove=True)

    def __init__(self, url: str, *, allocator: FreeListAllocator, **kwargs: Any) -> None:
        super().__init__(url, allocator=allocator, **kwargs)
        self.pool = allocator
        self.data: dict[CacheKey, tuple[bytes, tuple[int, ...], torch.dtype]] = {}
        self.fail_put_at = 0
        self.fail_get_at = 0
        self.delay = 0.0
        self.puts = 0
        self.gets = 0
        self.active = 0
        self.most_active = 0
        self.most_objects = 0
        self._lock = threading.Lock()

    def _enter(self) -> None:
        with self._lock:
            self.active += 1
            self.most_active = max(self.most_active, self.active)
            self.most_objects = max(self.most_objects, self.pool.stats().object_count)

    def _leave(self) -> None:
        with self._lock:
            self.active -= 1

    async def _put(self, key: CacheKey, obj: MemoryObj) -> None:
        self._enter()
        try:
            self.puts += 1
            number = self.puts
            await asyncio.sleep(self.delay)
            if number == self.fail_put_at:
                raise BackendUnavailable(f"put number {number} fails on purpose")
            self.data[key] = (obj.raw.numpy().tobytes(), obj.shape, obj.dtype)
        finally:
            self._leave()

    async def _get(self, key: CacheKey) -> MemoryObj | None:
        self._enter()
        try:
            self.gets += 1
            number = self.gets
            await asyncio.sleep(self.delay)
            if number == self.fail_get_at:
                raise BackendUnavailable(f"get number {number} fails on purpose")
            found = self.data.get(key)
            if found is None:
                return None
            raw, shape, dtype = found
            obj = self.pool.allocate(shape, dtype)
            assert obj is not None
            obj.raw.copy_(torch.frombuffer(bytearray(raw), dtype=U8))
            with self._lock:
                self.most_objects = max(self.most_objects, self.pool.stats().object_count)
            return obj
        finally:
            self._leave()

    async def _contains(self, key: CacheKey) -> bool:
        return key in self.data

    async def _remove(self, key: CacheKey) -> bool:
        return self.data.pop(key, None) is not None


def scripted(capacity: int = 1 << 20) -> tuple[Scripted, FreeListAllocator]:
    pool = FreeListAllocator(capacity, pin=False)
    backend = Scripted("scripted://", allocator=pool)
    asyncio.run(backend.open())
    return backend, pool


# -- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("driven_by", ["sync_client", "backend"])
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_offload_then_load_round_trips_every_chunk_bit_exact_through_cpu(
    driven_by: str, depth: int, request: pytest.FixtureRequest
) -> None:
    store = request.getfixturevalue("cpu_client" if driven_by == "sync_client" else "cpu_backend")
    layers = random_layers(seed=depth)
    cache = PagedKVCache.vllm_flash(layers)
    slots = scattered_slots(5 * CHUNK + 7)  # 6 chunks, the last one of 7 tokens
    keys = keys_for(6)
    expected = [chunk_bytes(cache, slots, n) for n in range(6)]
    before = slot_bytes(layers, slots)

    offload(cache, slots, keys, store, chunk_tokens=CHUNK, depth=depth)

    backend = store.backend if isinstance(store, SyncClient) else store
    for n, key in enumerate(keys):
        got = asyncio.run(backend.get(key))
        assert got is not None, n
        assert got.shape == cache.chunk_shape(7 if n == 5 else CHUNK)
        assert torch.equal(got.raw, expected[n].flatten()), f"chunk {n} differs"
        got.release()
    for layer in layers:
        layer.view(U8).zero_()
    assert load(cache, slots, keys, store, chunk_tokens=CHUNK, depth=depth) == 6
    for n, (now, then) in enumerate(zip(slot_bytes(layers, slots), before, strict=True)):
        assert torch.equal(now, then), f"layer {n} differs after the load"


def test_offload_allocates_in_the_cpu_tier_so_it_keeps_the_chunks_without_a_copy(
    cpu_client: SyncClient,
) -> None:
    cache = PagedKVCache.vllm_flash(random_layers(seed=3))
    offload(cache, scattered_slots(4 * CHUNK), keys_for(4), cpu_client, chunk_tokens=CHUNK)
    stats = cpu_client.backend.allocator.stats()
    assert stats.object_count == 4, "a chunk was copied, or a copy was left behind"
    assert stats.used == 4 * CHUNK_BYTES


def test_offload_and_load_through_a_store_of_tiers() -> None:
    config = Config.from_dict({"tiers": ["cpu://?max_size=8MiB"]})
    layers = random_layers(seed=4)
    cache = PagedKVCache.vllm_flash(layers)
    slots = scattered_slots(3 * CHUNK)
    before = slot_bytes(layers, slots)
    with SyncClient(config) as client:
        offload(cache, slots, keys_for(3), client, chunk_tokens=CHUNK)
        for layer in layers:
            layer.view(U8).zero_()
        assert load(cache, slots, keys_for(3), client, chunk_tokens=CHUNK) == 3
    assert all(torch.equal(a, b) for a, b in zip(slot_bytes(layers, slots), before, strict=True))


@pytest.mark.parametrize("layout", ["mla", "sglang"])
def test_other_layouts_round_trip(layout: str, cpu_client: SyncClient) -> None:
    gen = torch.Generator().manual_seed(5)
    if layout == "mla":
        layers = [torch.randn(8, 16, 24, generator=gen).to(torch.bfloat16) for _ in range(2)]
        cache = PagedKVCache.mla(layers)
    else:
        layers = [torch.randn(128, 2, 8, generator=gen).half() for _ in range(4)]
        cache = PagedKVCache.sglang(layers[:2], layers[2:])
    slots = torch.randperm(100, generator=gen)[:40]
    saved = [layer.clone() for layer in layers]
    keys = keys_for(3, model=layout)
    offload(cache, slots, keys, cpu_client, chunk_tokens=CHUNK)
    for layer in layers:
        layer.zero_()
    assert load(cache, slots, keys, cpu_client, chunk_tokens=CHUNK) == 3
    for layer, old in zip(layers, saved, strict=True):
        rows = 8 * 16 if layout == "mla" else 128  # slots per layer
        now, then = layer.reshape(rows, -1)[slots], old.reshape(rows, -1)[slots]
        assert torch.equal(now.view(U8), then.view(U8))


def test_negative_slots_are_neither_stored_over_nor_written(cpu_client: SyncClient) -> None:
    layers = random_layers(seed=6)
    cache = PagedKVCache.vllm_flash(layers)
    slots = scattered_slots(2 * CHUNK).clone()
    skipped = int(slots[3])
    slots[3] = -1
    keys = keys_for(2)
    offload(cache, slots, keys, cpu_client, chunk_tokens=CHUNK)
    sentinel = layers[0].view(U8).reshape(2, BLOCKS * BLOCK_SIZE, -1)[:, skipped].clone()
    assert load(cache, slots, keys, cpu_client, chunk_tokens=CHUNK) == 2
    now = layers[0].view(U8).reshape(2, BLOCKS * BLOCK_SIZE, -1)[:, skipped]
    assert torch.equal(now, sentinel)


# -- misses -----------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_a_miss_stops_the_load_at_the_first_missing_chunk(
    depth: int, cpu_client: SyncClient
) -> None:
    layers = random_layers(seed=7)
    cache = PagedKVCache.vllm_flash(layers)
    slots = scattered_slots(6 * CHUNK)
    keys = keys_for(6)
    before = slot_bytes(layers, slots)
    offload(cache, slots, keys, cpu_client, chunk_tokens=CHUNK)
    assert cpu_client.remove(keys[2]).result()
    used = cpu_client.backend.allocator.stats().used
    for layer in layers:
        layer.view(U8).zero_()

    assert load(cache, slots, keys, cpu_client, chunk_tokens=CHUNK, depth=depth) == 2

    after = slot_bytes(layers, slots)
    for now, then in zip(after, before, strict=True):
        assert torch.equal(now[:, : 2 * CHUNK], then[:, : 2 * CHUNK])
        assert not now[:, 2 * CHUNK :].any(), "a chunk after the miss was written"
    assert cpu_client.backend.allocator.stats().used == used, "a read object was not released"


def test_a_load_of_keys_never_stored_loads_nothing(cpu_client: SyncClient) -> None:
    layers = random_layers(seed=8)
    cache = PagedKVCache.vllm_flash(layers)
    before = [layer.clone() for layer in layers]
    assert load(cache, scattered_slots(CHUNK), keys_for(1, "absent"), cpu_client) == 0
    assert (
        load(
            cache, scattered_slots(2 * CHUNK), keys_for(2, "absent"), cpu_client, chunk_tokens=CHUNK
        )
        == 0
    )
    assert all(torch.equal(a.view(U8), b.view(U8)) for a, b in zip(layers, before, strict=True))


def test_a_blackhole_store_takes_every_chunk_and_keeps_nothing() -> None:
    pool = FreeListAllocator(1 << 20, pin=False)
    hole = asyncio.run(kvplug.open_backend("blackhole://", allocator=pool))
    cache = PagedKVCache.vllm_flash(random_layers(seed=9))
    slots = scattered_slots(4 * CHUNK)
    with SyncClient(hole) as client:
        offload(cache, slots, keys_for(4), client, chunk_tokens=CHUNK)
        assert hole.puts == 4  # type: ignore[attr-defined]
        assert load(cache, slots, keys_for(4), client, chunk_tokens=CHUNK) == 0
    assert pool.stats().used == 0 and pool.memcheck()


# -- errors release everything ----------------------------------------------------------------


@pytest.mark.parametrize("driven_by", ["sync_client", "backend"])
@pytest.mark.parametrize("failing", [1, 3, 6])
def test_a_failing_put_raises_after_releasing_every_chunk(driven_by: str, failing: int) -> None:
    backend, pool = scripted()
    backend.fail_put_at = failing
    backend.delay = 0.002
    cache = PagedKVCache.vllm_flash(random_layers(seed=10))
    store: SyncClient | Backend = SyncClient(backend) if driven_by == "sync_client" else backend
    try:
        with pytest.raises(BackendUnavailable, match="fails on purpose") as raised:
            offload(cache, scattered_slots(6 * CHUNK), keys_for(6), store, chunk_tokens=CHUNK)
        assert "kvplug.gpu.offload stopped" in "".join(raised.value.__notes__)
        assert pool.stats().used == 0, "a chunk of the failed offload is still allocated"
        assert pool.memcheck()
        assert backend.active == 0, "a put was still running when offload raised"
        # The chunks before the failing put were stored (by a sequential driver, all of them).
        assert len(backend.data) >= (failing - 1 if driven_by == "backend" else 0)
    finally:
        if isinstance(store, SyncClient):
            store.close()
        else:
            asyncio.run(backend.close())


@pytest.mark.parametrize("driven_by", ["sync_client", "backend"])
@pytest.mark.parametrize("depth", [1, 3])
def test_a_failing_get_raises_after_releasing_every_read_object(driven_by: str, depth: int) -> None:
    backend, pool = scripted()
    cache = PagedKVCache.vllm_flash(random_layers(seed=11))
    slots = scattered_slots(6 * CHUNK)
    store: SyncClient | Backend = SyncClient(backend) if driven_by == "sync_client" else backend
    try:
        offload(cache, slots, keys_for(6), store, chunk_tokens=CHUNK)
        assert pool.stats().used == 0
        backend.fail_get_at = 3
        backend.delay = 0.002
        with pytest.raises(BackendUnavailable, match="fails on purpose") as raised:
            load(cache, slots, keys_for(6), store, chunk_tokens=CHUNK, depth=depth)
        assert "kvplug.gpu.load stopped" in "".join(raised.value.__notes__)
        assert pool.stats().used == 0, "an object read by the failed load is still allocated"
        assert backend.active == 0, "a get was still running when load raised"
    finally:
        if isinstance(store, SyncClient):
            store.close()
        else:
            asyncio.run(backend.close())


def test_no_memory_for_a_chunk_raises_capacity_exceeded_and_releases_the_rest() -> None:
    backend, pool = scripted(capacity=CHUNK_BYTES + 4096)  # room for one chunk
    backend.delay = 0.01
    cache = PagedKVCache.vllm_flash(random_layers(seed=12))
    with SyncClient(backend) as client:
        with pytest.raises(CapacityExceeded, match="no memory for a chunk"):
            offload(cache, scattered_slots(4 * CHUNK), keys_for(4), client, chunk_tokens=CHUNK)
        assert pool.stats().used == 0 and backend.active == 0


def test_a_stored_object_of_another_shape_is_refused_and_released(cpu_client: SyncClient) -> None:
    cache = PagedKVCache.vllm_flash(random_layers(seed=13))
    keys = keys_for(2)
    wrong = cpu_client.backend.allocator.allocate((2, LAYERS, CHUNK, 32), torch.float16)
    assert wrong is not None
    cpu_client.put(keys[0], wrong).result()
    wrong.release()
    used = cpu_client.backend.allocator.stats().used
    with pytest.raises(ConfigError, match="shape"):
        load(cache, scattered_slots(2 * CHUNK), keys, cpu_client, chunk_tokens=CHUNK)
    assert cpu_client.backend.allocator.stats().used == used


# -- depth ------------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_offload_keeps_at_most_depth_chunks_in_flight_and_overlaps_up_to_it(depth: int) -> None:
    backend, pool = scripted()
    backend.delay = 0.02
    cache = PagedKVCache.vllm_flash(random_layers(seed=14))
    with SyncClient(backend) as client:
        offload(
            cache, scattered_slots(8 * CHUNK), keys_for(8), client, depth=depth, chunk_tokens=CHUNK
        )
    assert len(backend.data) == 8
    assert backend.most_objects == depth, "chunks in memory at once"
    assert backend.most_active == depth, "puts in flight at once"
    assert pool.stats().used == 0


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_load_keeps_at_most_depth_chunks_in_flight(depth: int) -> None:
    backend, pool = scripted()
    cache = PagedKVCache.vllm_flash(random_layers(seed=15))
    slots = scattered_slots(8 * CHUNK)
    with SyncClient(backend) as client:
        offload(cache, slots, keys_for(8), client, chunk_tokens=CHUNK)
        backend.delay = 0.01
        backend.most_active = backend.most_objects = 0
        assert load(cache, slots, keys_for(8), client, depth=depth, chunk_tokens=CHUNK) == 8
    assert 1 <= backend.most_objects <= depth, "chunks in memory at once"
    # Gets run ahead of the scatters (with a host cache a chunk is scattered at once).
    assert backend.most_active == depth, "gets in flight at once"
    assert pool.stats().used == 0


def test_the_default_depth_overlaps_one_copy_with_one_store_operation() -> None:
    assert DEFAULT_DEPTH == 2


# -- the event discipline, with simulated asynchronous copies ----------------------------------


class LazyCopy:
    """Stands for a CUDA event: the copy it guards happens only when it is waited for (or,
    with ``finishes_alone``, when it is polled), so work that does not wait sees stale bytes."""

    def __init__(self, work: Callable[[], None], finishes_alone: bool) -> None:
        self.work: Callable[[], None] | None = work
        self.finishes_alone = finishes_alone

    def query(self) -> bool:
        if self.finishes_alone:
            self.synchronize()
        return self.work is None

    def synchronize(self) -> None:
        if self.work is not None:
            work, self.work = self.work, None
            work()


class LazyCopier:
    """Replaces the pipeline's GPU copier on the CPU: gathers and scatters become LazyCopy."""

    made: ClassVar[list[LazyCopy]] = []
    finishes_alone: ClassVar[bool] = False

    def __init__(self, cache: PagedKVCache, stream: object) -> None:
        self.cache = cache

    def _lazy(self, work: Callable[[], None]) -> LazyCopy:
        event = LazyCopy(work, self.finishes_alone)
        self.made.append(event)
        return event

    def gather(
        self, slots: torch.Tensor, obj: MemoryObj, start: int, end: int, impl: str
    ) -> LazyCopy:
        return self._lazy(
            lambda: gather(self.cache, slots, obj, start=start, end=end, validate=False)
        )

    def scatter(
        self, obj: MemoryObj, slots: torch.Tensor, start: int, end: int, impl: str
    ) -> LazyCopy:
        # A released object raises RefCountError here: its memory was freed under the copy.
        return self._lazy(
            lambda: scatter(obj, self.cache, slots, start=start, end=end, validate=False)
        )


@pytest.fixture(params=[False, True], ids=["waited_for", "finishing_alone"])
def lazy_copies(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> type[LazyCopier]:
    monkeypatch.setattr(pipeline, "_Copier", LazyCopier)
    monkeypatch.setattr(LazyCopier, "made", [])
    monkeypatch.setattr(LazyCopier, "finishes_alone", request.param)
    return LazyCopier


@pytest.mark.parametrize("driven_by", ["sync_client", "backend"])
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_puts_get_only_finished_copies_and_loads_release_only_after_their_scatter(
    driven_by: str, depth: int, lazy_copies: type[LazyCopier]
) -> None:
    backend, pool = scripted()
    pool.buffer.fill_(0xAA)  # what a put of an unfinished gather would see
    layers = random_layers(seed=30)
    cache = PagedKVCache.vllm_flash(layers)
    slots = scattered_slots(5 * CHUNK)
    keys = keys_for(5)
    expected = [chunk_bytes(cache, slots, n).numpy().tobytes() for n in range(5)]
    before = slot_bytes(layers, slots)
    store: SyncClient | Backend = SyncClient(backend) if driven_by == "sync_client" else backend
    try:
        offload(cache, slots, keys, store, chunk_tokens=CHUNK, depth=depth)
        for n, key in enumerate(keys):
            assert backend.data[key][0] == expected[n], f"put {n} got an unfinished copy"
        for layer in layers:
            layer.view(U8).zero_()
        assert load(cache, slots, keys, store, chunk_tokens=CHUNK, depth=depth) == 5
    finally:
        if isinstance(store, SyncClient):
            store.close()
        else:
            asyncio.run(backend.close())
    assert all(event.work is None for event in lazy_copies.made), "a copy was never waited for"
    assert all(torch.equal(a, b) for a, b in zip(slot_bytes(layers, slots), before, strict=True))
    assert pool.stats().used == 0


@pytest.mark.parametrize("depth", [2, 3])
def test_errors_wait_for_every_queued_copy_before_releasing(
    depth: int, lazy_copies: type[LazyCopier]
) -> None:
    backend, pool = scripted()
    cache = PagedKVCache.vllm_flash(random_layers(seed=31))
    slots = scattered_slots(6 * CHUNK)
    with SyncClient(backend) as client:
        backend.fail_put_at = 2
        with pytest.raises(BackendUnavailable):
            offload(cache, slots, keys_for(6), client, chunk_tokens=CHUNK, depth=depth)
        assert all(event.work is None for event in lazy_copies.made), "a gather was abandoned"
        assert pool.stats().used == 0
        backend.fail_put_at = 0
        offload(cache, slots, keys_for(6), client, chunk_tokens=CHUNK)
        lazy_copies.made.clear()
        backend.fail_get_at = backend.gets + 3
        with pytest.raises(BackendUnavailable):
            load(cache, slots, keys_for(6), client, chunk_tokens=CHUNK, depth=depth)
        assert len(lazy_copies.made) == 2, "scatters queued before the failing get"
        assert all(event.work is None for event in lazy_copies.made), "a scatter was abandoned"
        assert pool.stats().used == 0


# -- arguments --------------------------------------------------------------------------------


def test_one_key_per_chunk_is_required(cpu_client: SyncClient) -> None:
    cache = PagedKVCache.vllm_flash(random_layers(seed=16))
    with pytest.raises(ConfigError, match=r"2 keys for 40 tokens in chunks of 16: that is 3"):
        offload(cache, scattered_slots(40), keys_for(2), cpu_client, chunk_tokens=CHUNK)
    with pytest.raises(ConfigError, match="each needs one key"):
        load(cache, scattered_slots(40), keys_for(4), cpu_client, chunk_tokens=CHUNK)
    assert cpu_client.backend.allocator.stats().used == 0


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("depth", 0, "depth must be an int >= 1"),
        ("depth", 1.5, "depth must be an int >= 1"),
        ("chunk_tokens", 0, "chunk_tokens must be a positive int"),
        ("impl", "cude", "did you mean 'cuda'"),
    ],
)
def test_bad_options_are_refused_with_the_fix(
    option: str, value: Any, message: str, cpu_client: SyncClient
) -> None:
    cache = PagedKVCache.vllm_flash(random_layers(seed=17))
    with pytest.raises(ConfigError, match=message):
        offload(cache, scattered_slots(16), keys_for(1), cpu_client, **{option: value})
    assert cpu_client.backend.allocator.stats().used == 0


def test_slots_past_the_cache_are_refused_before_anything_moves(cpu_client: SyncClient) -> None:
    cache = PagedKVCache.vllm_flash(random_layers(seed=18))
    with pytest.raises(ConfigError, match="holds slot 9999"):
        offload(cache, torch.tensor([1, 9999]), keys_for(1), cpu_client)
    assert cpu_client.backend.allocator.stats().object_count == 0


def test_a_store_of_another_type_is_refused() -> None:
    cache = PagedKVCache.vllm_flash(random_layers(seed=19))
    with pytest.raises(ConfigError, match="SyncClient or an opened kvplug Backend"):
        offload(cache, scattered_slots(16), keys_for(1), "cpu://")  # type: ignore[arg-type]


def test_a_backend_cannot_be_driven_from_a_thread_running_an_event_loop(
    cpu_backend: Backend,
) -> None:
    cache = PagedKVCache.vllm_flash(random_layers(seed=20))

    async def inside_a_loop() -> None:
        offload(cache, scattered_slots(16), keys_for(1), cpu_backend)

    with pytest.raises(ConfigError, match=r"asyncio.to_thread"):
        asyncio.run(inside_a_loop())


def test_an_empty_mapping_does_nothing(cpu_client: SyncClient) -> None:
    cache = PagedKVCache.vllm_flash(random_layers(seed=21))
    empty = torch.empty(0, dtype=torch.int64)
    offload(cache, empty, [], cpu_client)
    assert load(cache, empty, [], cpu_client) == 0
