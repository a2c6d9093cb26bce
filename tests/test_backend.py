"""The Backend and BytesBackend bases: framing, ownership, batching defaults, options."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch

from kvplug import (
    Backend,
    BackendClosed,
    BackendTimeout,
    BackendUnavailable,
    BytesBackend,
    CacheKey,
    Capabilities,
    CapacityExceeded,
    FreeListAllocator,
    MemoryFormat,
    MemoryObj,
    NotSupported,
    RefCountError,
    UnknownOption,
)
from kvplug.backend import Buffer, BytesBackendOptions, RawValues, Wrapper, Wraps
from kvplug.inline import run_inline
from kvplug.runtime.sync import SyncClient
from kvplug.stats import summarize
from kvplug_testing.threads import loop_thread


class DictBytes(BytesBackend):
    """A byte store in a dict, with switches to make it fail."""

    capabilities = Capabilities(remove=True)

    def __init__(self, url: Any = "dict://", **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self.values: dict[str, bytes] = {}
        self.fail_puts = False

    async def get_bytes(self, key: str) -> Buffer | None:
        return self.values.get(key)

    async def put_bytes(self, key: str, parts: Sequence[Buffer]) -> None:
        if self.fail_puts:
            raise ConnectionError("store went away")
        self.values[key] = b"".join(parts)

    async def contains_bytes(self, key: str) -> bool:
        return key in self.values

    async def remove_bytes(self, key: str) -> bool:
        return self.values.pop(key, None) is not None


class NoDelete(DictBytes):
    capabilities = Capabilities()


DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.uint8,
]


def key(n: int, model: str = "m") -> CacheKey:
    return CacheKey(model, 1, 0, n)


@pytest.fixture
def allocator() -> FreeListAllocator:
    return FreeListAllocator(1 << 24)


def run(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


def filled(allocator: FreeListAllocator, shape: tuple[int, ...], dtype: torch.dtype, seed: int):
    obj = allocator.allocate(shape, dtype, MemoryFormat.KV_2LTD)
    assert obj is not None
    generator = torch.Generator().manual_seed(seed)
    obj.raw.copy_(torch.randint(0, 256, (obj.nbytes,), dtype=torch.uint8, generator=generator))
    return obj


@pytest.mark.parametrize("dtype", DTYPES)
def test_bytes_backend_round_trip_is_bit_exact(allocator, dtype) -> None:
    backend = DictBytes(allocator=allocator)
    obj = filled(allocator, (2, 3, 17, 24), dtype, 1)

    async def main() -> None:
        await backend.put(key(1), obj)
        got = await backend.get(key(1))
        assert got is not None
        assert (got.shape, got.dtype, got.fmt) == (obj.shape, obj.dtype, obj.fmt)
        assert torch.equal(got.raw, obj.raw)
        assert got.data_ptr() != obj.data_ptr()
        got.release()

    run(main())
    obj.release()
    assert allocator.stats().used == 0


@pytest.mark.parametrize("damage", ["flip_payload", "flip_header", "truncate", "extend", "junk"])
def test_damaged_value_is_a_counted_miss_and_removed(allocator, damage) -> None:
    backend = DictBytes(allocator=allocator)
    obj = filled(allocator, (2, 2, 8, 16), torch.float16, 2)
    run(backend.put(key(1), obj))
    obj.release()
    stored = bytearray(backend.values["m@1@0@1@half"])
    if damage == "flip_payload":
        stored[-1] ^= 0x40
    elif damage == "flip_header":
        stored[20] ^= 0x01
    elif damage == "truncate":
        del stored[-5:]
    elif damage == "extend":
        stored += b"\0"
    else:
        stored = bytearray(b"not a frame at all")
    backend.values["m@1@0@1@half"] = bytes(stored)
    assert run(backend.get(key(1))) is None
    assert backend.corrupt_objects == 1
    assert "m@1@0@1@half" not in backend.values
    assert allocator.stats().used == 0


def test_put_releases_its_reference_on_failure(allocator) -> None:
    backend = DictBytes(allocator=allocator)
    backend.fail_puts = True
    obj = filled(allocator, (4, 4), torch.float32, 3)
    with pytest.raises(BackendUnavailable, match="store went away"):
        run(backend.put(key(1), obj))
    assert obj.ref_count == 1
    obj.release()
    assert allocator.stats().object_count == 0


def test_batched_defaults_align_and_count_prefixes(allocator) -> None:
    backend = DictBytes(allocator=allocator)
    objs = [filled(allocator, (64,), torch.float16, n) for n in range(4)]

    async def main() -> None:
        await backend.batched_put([key(0), key(1), key(3)], [objs[0], objs[1], objs[3]])
        got = await backend.batched_get([key(3), key(2), key(0)])
        assert got[1] is None
        assert got[0] is not None and torch.equal(got[0].raw, objs[3].raw)
        assert got[2] is not None and torch.equal(got[2].raw, objs[0].raw)
        for obj in got:
            if obj is not None:
                obj.release()
        assert await backend.batched_contains([key(0), key(1), key(2), key(3)]) == 2
        assert await backend.batched_contains([key(2), key(0)]) == 0
        assert await backend.batched_contains([]) == 0

    run(main())
    for obj in objs:
        obj.release()
    assert allocator.stats().used == 0


def test_batched_get_releases_what_it_read_when_one_get_fails(allocator) -> None:
    class FailsOnSecond(DictBytes):
        async def get_bytes(self, key: str) -> Buffer | None:
            if key.endswith("@2@half"):
                raise ConnectionError("lost")
            return await super().get_bytes(key)

    backend = FailsOnSecond(allocator=allocator)
    obj = filled(allocator, (64,), torch.float16, 0)
    run(backend.batched_put([key(1), key(3)], [obj, obj]))
    obj.release()
    with pytest.raises(BackendUnavailable, match="lost"):
        run(backend.batched_get([key(1), key(2), key(3)]))
    assert allocator.stats().used == 0


def test_batched_put_rejects_mismatched_lengths(allocator) -> None:
    with pytest.raises(ValueError, match="2 keys but 1 objects"):
        run(DictBytes(allocator=allocator).batched_put([key(1), key(2)], [object()]))  # type: ignore[list-item]


def test_keys_of_other_namespaces_do_not_collide(allocator) -> None:
    backend = DictBytes(allocator=allocator)
    a = filled(allocator, (16,), torch.float32, 1)
    run(backend.put(key(1, "model-a"), a))
    assert run(backend.get(key(1, "model-b"))) is None
    assert run(backend.contains(CacheKey("model-a", 2, 1, 1))) is False
    a.release()


def test_options_merge_url_query_and_explicit_values() -> None:
    backend = DictBytes("dict://?timeout=2.5&key_prefix=a:", timeout=4)
    assert isinstance(backend.options, BytesBackendOptions)
    assert backend.options.timeout == 4.0
    assert backend.options.key_prefix == "a:"
    assert backend.key_string(key(9)) == "a:m@1@0@9@half"


def test_unknown_and_invalid_options_are_explained() -> None:
    with pytest.raises(UnknownOption, match="Did you mean 'timeout'"):
        DictBytes("dict://?timout=3")
    with pytest.raises(UnknownOption, match="timeout"):
        DictBytes("dict://?timeout=-1")
    with pytest.raises(Exception, match="unknown serde 'zstd-nope'"):
        DictBytes("dict://?serde=zstd-nope")


def test_undeclared_capabilities_raise_not_supported(allocator) -> None:
    backend = NoDelete(allocator=allocator)
    with pytest.raises(NotSupported):
        run(backend.remove(key(1)))
    with pytest.raises(NotSupported):
        run(backend.pin(key(1)))
    with pytest.raises(NotSupported):
        run(backend.unpin(key(1)))
    with pytest.raises(NotSupported):
        backend.list_keys()
    assert Capabilities(pin=True, list_keys=True).declared() == ("pin", "list_keys")


class HangingBytes(DictBytes):
    async def get_bytes(self, key: str) -> Buffer | None:
        await asyncio.sleep(5)
        return None


def test_deadline_turns_a_hang_into_backend_timeout_naming_the_operation_and_key() -> None:
    backend = HangingBytes("dict://?timeout=0.05")

    async def main() -> None:
        with pytest.raises(
            BackendTimeout,
            match=r"get of m@1@0@1@half on dict://\?timeout=0\.05 took longer than 0\.05 s",
        ):
            await backend.get(key(1))
        assert backend.operation_stats()["get"].errors == 1

    run(main())


def test_closed_backend_refuses_operations(allocator) -> None:
    backend = DictBytes(allocator=allocator)

    async def main() -> None:
        async with backend:
            pass
        await backend.close()
        assert backend.closed
        for operation in (backend.get(key(1)), backend.contains(key(1)), backend.remove(key(1))):
            with pytest.raises(BackendClosed):
                await operation

    run(main())


# -- the template: what the base does for every backend ------------------------------------------


class CountingHooks(DictBytes):
    """Counts the calls that reach each hook, so a test can tell the base stopped one."""

    def __init__(self, url: Any = "dict://", **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self.reached: list[str] = []

    async def get_bytes(self, key: str) -> Buffer | None:
        self.reached.append("get_bytes")
        return await super().get_bytes(key)

    async def put_bytes(self, key: str, parts: Sequence[Buffer]) -> None:
        self.reached.append("put_bytes")
        await super().put_bytes(key, parts)


@pytest.mark.parametrize("operation", ["get", "put", "close", "batched_get", "list_keys"])
def test_a_backend_that_defines_a_public_operation_is_refused_naming_the_hook(
    operation: str,
) -> None:
    async def public(self: Any, *args: Any) -> None:
        return None

    with pytest.raises(TypeError, match=rf"defines {operation}, .*the hook instead: _{operation}"):
        type("Overrides", (DictBytes,), {operation: public})


@pytest.mark.parametrize(
    ("capability", "missing"),
    [
        ("pin", "_pin, _unpin"),
        ("list_keys", "_list_keys"),
        ("native_batching", "batched_get_bytes|receive_frames, batched_put_bytes"),
    ],
)
def test_declaring_a_capability_without_its_hooks_is_refused(capability: str, missing: str) -> None:
    with pytest.raises(TypeError, match=rf"declares the '{capability}' capability but does not "):
        type("Claims", (DictBytes,), {"capabilities": Capabilities(**{capability: True})})
    try:
        type("Claims", (DictBytes,), {"capabilities": Capabilities(**{capability: True})})
    except TypeError as error:
        assert missing in str(error)


def test_a_vendor_name_that_would_replace_the_templates_own_is_refused_at_class_creation() -> None:
    async def _read(self: Any, keys: Any, dests: Any) -> None:
        return None

    with pytest.raises(TypeError, match=r"defines or assigns _read, .*Rename yours"):
        type("HasAReadHelper", (DictBytes,), {"_read": _read})

    class Plain(Backend):  # _read is a byte store's internal, free for a plain Backend
        async def _read(self, key: CacheKey) -> None:
            return None

    with pytest.raises(TypeError, match=r"defines or assigns _closed, _counters"):

        class KeepsItsOwnState(DictBytes):
            def __init__(self, url: str) -> None:
                super().__init__(url)
                self._closed = False

            def stop(self) -> None:
                def later() -> None:
                    self._counters = threading.Lock()

                later()

    class ReadsTheState(DictBytes):  # reading the template's state is no clash
        def is_done(self) -> bool:
            return self._closed

    assert Plain.__name__ and ReadsTheState.__name__


def test_a_byte_store_without_remove_bytes_cannot_declare_remove() -> None:
    namespace = {
        "capabilities": Capabilities(remove=True),
        "remove_bytes": BytesBackend.remove_bytes,
    }
    with pytest.raises(TypeError, match="implement remove_bytes"):
        type("NoRemoveBytes", (DictBytes,), namespace)


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda b, obj: b.get("m@1@0@1@half"), "get needs a kvplug.CacheKey, got str"),
        (lambda b, obj: b.put(key(1), obj.tensor), "put needs a kvplug.MemoryObj, got Tensor"),
        (lambda b, obj: b.batched_get(key(1)), "batched_get needs a sequence of kvplug.CacheKey"),
        (lambda b, obj: b.batched_put([key(1)], []), "batched_put got 1 keys but 0 objects"),
        (lambda b, obj: b.get_into(key(1), None), "get_into needs a kvplug.MemoryObj, got None"),
    ],
    ids=["key-type", "object-type", "keys-not-a-sequence", "length-mismatch", "no-destination"],
)
def test_bad_arguments_are_refused_before_any_hook_runs(allocator, call: Any, error: str) -> None:
    backend = CountingHooks(allocator=allocator)
    obj = filled(allocator, (4, 8), torch.float16, 1)

    async def main() -> None:
        with pytest.raises((TypeError, ValueError), match=error):
            await call(backend, obj)

    run(main())
    obj.release()
    assert backend.reached == []


def test_a_freed_object_is_refused_by_put(allocator) -> None:
    backend = CountingHooks(allocator=allocator)
    obj = filled(allocator, (4, 8), torch.float16, 1)
    obj.release()
    with pytest.raises(RefCountError, match="already freed"):
        run(backend.put(key(1), obj))
    assert backend.reached == []


def test_operation_stats_count_calls_hits_misses_bytes_and_errors(allocator) -> None:
    backend = DictBytes(allocator=allocator)
    obj = filled(allocator, (4, 8), torch.float16, 1)

    async def main() -> None:
        await backend.put(key(1), obj)
        for n in (1, 2, 1):
            got = await backend.get(key(n))
            if got is not None:
                got.release()
        backend.fail_puts = True
        with pytest.raises(BackendUnavailable):
            await backend.put(key(3), obj)
        assert await backend.batched_contains([key(1), key(2), key(1)]) == 1

    run(main())
    obj.release()
    stats = backend.operation_stats()
    assert (stats["get"].calls, stats["get"].hits, stats["get"].misses) == (3, 2, 1)
    assert stats["get"].bytes == 2 * obj.nbytes
    assert (stats["put"].calls, stats["put"].errors, stats["put"].bytes) == (2, 1, obj.nbytes)
    assert stats["put"].keys == 1  # the failed put handled no key
    # batched_contains: the leading present key is a hit, each key after the first miss a miss
    assert (stats["batched_contains"].hits, stats["batched_contains"].misses) == (1, 2)
    assert stats["get"].seconds > 0
    assert sum(stats["get"].latency_counts) == 3 and sum(stats["put"].latency_counts) == 2
    stats["get"].calls = 100
    stats["get"].latency_counts[0] = 100
    again = backend.operation_stats()["get"]
    assert again.calls == 3 and sum(again.latency_counts) == 3  # a copy
    summary = summarize(backend.operation_stats())
    assert (summary.reads, summary.hits, summary.misses, summary.hit_rate) == (3, 2, 1, 2 / 3)
    assert (summary.writes, summary.bytes_written, summary.bytes_read) == (
        1,
        obj.nbytes,
        2 * obj.nbytes,
    )
    assert (summary.lookups, summary.lookup_hits, summary.errors) == (3, 1, 1)


def test_a_hook_returning_the_wrong_thing_is_an_error_that_leaks_nothing(allocator) -> None:
    class ReturnsATensor(DictBytes):
        async def _get(self, key: CacheKey) -> Any:
            return torch.zeros(4)

    class ReturnsTooFew(DictBytes):
        async def _batched_get(self, keys: Sequence[CacheKey]) -> Any:
            return [await self._get(keys[0])]

    obj = filled(allocator, (4, 8), torch.float16, 1)

    async def main() -> None:
        with pytest.raises(TypeError, match=r"ReturnsATensor._get returned Tensor"):
            await ReturnsATensor(allocator=allocator).get(key(1))
        short = ReturnsTooFew(allocator=allocator)
        await short.put(key(1), obj)
        with pytest.raises(TypeError, match=r"returned 1 results for 2 keys"):
            await short.batched_get([key(1), key(1)])

    run(main())
    obj.release()
    assert allocator.stats().used == 0


def test_a_hook_that_waits_runs_to_its_result_its_error_or_its_cancellation() -> None:
    finished: list[str] = []

    class Waits(DictBytes):
        async def get_bytes(self, key: str) -> Buffer | None:
            try:
                await asyncio.sleep(0)
                await asyncio.sleep(0.01)
                if key.startswith("boom"):
                    raise ConnectionError("lost")
                if key.startswith("slow"):
                    await asyncio.sleep(60)
                return self.values.get(key)
            finally:
                finished.append(key.partition("@")[0])

    async def main() -> None:
        backend = Waits("dict://?timeout=30")
        assert await backend.get(key(1)) is None
        with pytest.raises(BackendUnavailable, match="lost"):
            await backend.get(key(1, model="boom"))
        task = asyncio.ensure_future(backend.get(key(1, model="slow")))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert backend.operation_stats()["get"].errors == 2

    run(main())
    assert finished == ["m", "boom", "slow"]


def test_close_runs_its_hook_once_and_gives_up_on_one_that_hangs(caplog) -> None:
    closes: list[int] = []

    class HangsOnClose(DictBytes):
        async def _close(self) -> None:
            closes.append(1)
            await asyncio.sleep(60)

    async def main() -> None:
        backend = HangsOnClose("dict://?timeout=0.1")
        await asyncio.gather(backend.close(), backend.close(), backend.close())
        await backend.close()
        with pytest.raises(BackendClosed):
            await backend.get(key(1))

    run(main())
    assert closes == [1]
    assert "took longer than 0.1 s and was abandoned" in caplog.text


def test_a_wrapper_forwards_to_the_inner_backend_and_keeps_its_capabilities(allocator) -> None:
    class Tap(Wrapper):
        pass

    inner = DictBytes(allocator=allocator)
    wrapper = Tap("tap://", inner=inner)
    obj = filled(allocator, (4, 8), torch.float16, 2)
    dest = filled(allocator, (4, 8), torch.float16, 3)

    async def main() -> None:
        await wrapper.put(key(1), obj)
        assert await wrapper.get_into(key(1), dest)
        assert torch.equal(dest.raw, obj.raw)
        assert await wrapper.batched_contains([key(1), key(2)]) == 1
        assert await wrapper.remove(key(1))
        await wrapper.close()
        assert inner.closed

    run(main())
    obj.release()
    dest.release()
    assert isinstance(wrapper, Wraps) and wrapper.inner is inner
    assert wrapper.capabilities is inner.capabilities and wrapper.allocator is inner.allocator
    assert inner.operation_stats()["get_into"].hits == 1


# -- byte stores: batched and zero-copy hooks ------------------------------------------------------


class StreamingBytes(DictBytes):
    """A byte store whose transport hands values over in small pieces (like a socket), through
    the zero-copy hook, and whose batched hooks count their calls."""

    capabilities = Capabilities(remove=True, native_batching=True)
    PIECE = 7

    def __init__(self, url: Any = "dict://", **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self.batches: list[str] = []

    async def receive_frames(self, keys: Sequence[str], receivers: Sequence[Any]) -> None:
        self.batches.append("receive")
        for name, receiver in zip(keys, receivers, strict=True):
            value = self.values.get(name)
            if value is None:
                continue
            receiver.start(len(value))
            prefix = value[: self.PIECE * 10]
            size = receiver.header_len(prefix)
            sink = receiver.take_header(value[:size])
            rest = memoryview(value)[size:]
            assert len(rest) == receiver.remaining
            for start in range(0, len(rest), self.PIECE):
                if sink is not None:
                    sink[start : start + self.PIECE] = rest[start : start + self.PIECE]

    async def batched_put_bytes(
        self, keys: Sequence[str], values: Sequence[Sequence[Buffer]]
    ) -> None:
        self.batches.append("put")
        for name, parts in zip(keys, values, strict=True):
            self.values[name] = b"".join(parts)

    async def batched_exists_bytes(self, keys: Sequence[str]) -> list[bool]:
        self.batches.append("contains")
        return [name in self.values for name in keys]


def test_a_streaming_byte_store_reads_into_the_callers_memory_bit_exact(allocator) -> None:
    backend = StreamingBytes(allocator=allocator)
    objs = [filled(allocator, (3, 5, 7), dtype, n) for n, dtype in enumerate(DTYPES)]
    keys = [key(n) for n in range(len(objs))]

    async def main() -> None:
        await backend.batched_put(keys, objs)
        got = await backend.batched_get([*keys, key(99)])
        assert got[-1] is None
        for expected, obj in zip(objs, got, strict=False):
            assert obj is not None and torch.equal(obj.raw, expected.raw)
            assert obj.dtype == expected.dtype and obj.shape == expected.shape
            obj.release()
        dests = [filled(allocator, (3, 5, 7), obj.dtype, 50) for obj in objs]
        before = allocator.stats().object_count
        assert await backend.batched_get_into(keys, dests) == [True] * len(keys)
        assert allocator.stats().object_count == before  # no object of its own: zero-copy
        for expected, dest in zip(objs, dests, strict=True):
            assert torch.equal(dest.raw, expected.raw)
            dest.release()
        assert await backend.batched_contains([*keys, key(99)]) == len(keys)

    run(main())
    for obj in objs:
        obj.release()
    assert backend.batches == ["put", "receive", "receive", "contains"]
    assert allocator.stats().used == 0


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
def test_a_damaged_value_read_through_the_receiver_is_counted_and_removed(
    allocator, damage: str
) -> None:
    backend = StreamingBytes(allocator=allocator)
    obj = filled(allocator, (64, 16), torch.float16, 4)
    name = backend.key_string(key(1))

    async def main() -> None:
        await backend.put(key(1), obj)
        value = bytearray(backend.values[name])
        if damage == "flip":
            value[-3] ^= 0x40
        elif damage == "truncate":
            del value[len(value) // 2 :]
        else:
            value[:] = b"not a frame at all"
        backend.values[name] = bytes(value)
        dest = filled(allocator, (64, 16), torch.float16, 5)
        assert await backend.get_into(key(1), dest) is False
        dest.release()

    run(main())
    obj.release()
    assert backend.corrupt_objects == 1
    assert name not in backend.values
    assert allocator.stats().used == 0


def test_a_byte_store_that_cannot_delete_counts_damage_and_keeps_serving_misses(allocator) -> None:
    class CannotDelete(DictBytes):
        capabilities = Capabilities()
        remove_bytes = BytesBackend.remove_bytes

    backend = CannotDelete(allocator=allocator)
    obj = filled(allocator, (4, 8), torch.float16, 1)
    name = backend.key_string(key(1))

    async def main() -> None:
        await backend.put(key(1), obj)
        backend.values[name] = backend.values[name][:-1]
        assert await backend.get(key(1)) is None
        assert await backend.get(key(1)) is None

    run(main())
    obj.release()
    assert backend.corrupt_objects == 2
    assert name in backend.values


def test_raw_values_read_and_overwrite_the_stored_frame(allocator) -> None:
    backend = DictBytes(allocator=allocator)
    obj = filled(allocator, (4, 8), torch.float16, 1)

    async def main() -> None:
        assert await backend.read_raw(key(1)) is None
        await backend.put(key(1), obj)
        frame = await backend.read_raw(key(1))
        assert frame == backend.values[backend.key_string(key(1))]
        await backend.write_raw(key(1), b"junk")
        assert await backend.get(key(1)) is None

    run(main())
    obj.release()
    assert isinstance(backend, RawValues)


# -- counters under concurrency -------------------------------------------------------------------

THREADS = 8
ROUNDS = 1500


@contextlib.contextmanager
def frequent_thread_switches() -> Iterator[None]:
    """Switch threads every microsecond, so that an unguarded ``+=`` loses updates."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


@pytest.mark.parametrize("how", ["sync_client", "stepped", "own_loops"])
def test_counters_are_exact_while_many_threads_operate_at_once(how: str) -> None:
    """cpu:// runs its operations on the caller's thread (runs_inline), engine threads many at
    a time: no call may be lost from the counters, and every snapshot taken meanwhile adds up
    (each call counted once, with its outcome)."""
    client = SyncClient("cpu://?max_size=16MiB")
    backend = client.backend
    assert backend.runs_inline
    stored = MemoryObj.from_tensor(torch.ones(16))
    client.put(key(0), stored).result()
    torn: list[dict[str, object]] = []
    running = threading.Event()
    running.set()

    def operate(thread: int) -> None:
        def one_round(get: Callable[..., Any], contains: Callable[..., Any]) -> None:
            got = get(key(0))
            assert got is not None
            got.release()
            assert get(key(1000 + thread)) is None
            assert contains(key(0))

        if how == "sync_client":
            for _ in range(ROUNDS):
                one_round(lambda k: client.get(k).result(), lambda k: client.contains(k).result())
        elif how == "stepped":
            for _ in range(ROUNDS):
                one_round(
                    lambda k: run_inline(backend.get(k)), lambda k: run_inline(backend.contains(k))
                )
        else:

            async def rounds() -> None:
                for _ in range(ROUNDS):
                    got = await backend.get(key(0))
                    assert got is not None
                    got.release()
                    assert await backend.get(key(1000 + thread)) is None
                    assert await backend.contains(key(0))

            asyncio.run(rounds())

    def watch() -> None:
        while running.is_set():
            try:
                snapshot = backend.operation_stats()
            except Exception as error:  # "dictionary changed size during iteration"
                torn.append({"operation_stats() raised": repr(error)})
                continue
            for name, stats in snapshot.items():
                if name in ("get", "contains") and stats.calls != (
                    stats.errors + stats.hits + stats.misses
                ):
                    torn.append({name: (stats.calls, stats.errors, stats.hits, stats.misses)})

    with frequent_thread_switches():
        watcher = threading.Thread(target=watch)
        watcher.start()
        with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
            for done in [pool.submit(operate, n) for n in range(THREADS)]:
                done.result()
        running.clear()
        watcher.join()
    stats = backend.operation_stats()
    client.close()
    stored.release()
    gets = 2 * THREADS * ROUNDS
    assert (stats["get"].calls, stats["get"].hits, stats["get"].misses) == (
        gets,
        gets // 2,
        gets // 2,
    )
    assert stats["get"].bytes == gets // 2 * stored.nbytes
    assert (stats["contains"].calls, stats["contains"].hits) == (THREADS * ROUNDS,) * 2
    assert stats["get"].errors == stats["contains"].errors == 0
    assert torn == [], f"snapshots that failed or did not add up: {torn[:3]}"


class FillsUp(DictBytes):
    """Takes two values, then refuses every put as full."""

    async def put_bytes(self, key: str, parts: Sequence[Buffer]) -> None:
        if len(self.values) >= 2:
            raise CapacityExceeded(f"{key}: this store holds two values; nothing was stored")
        await super().put_bytes(key, parts)


def test_a_batched_put_that_stored_part_of_its_keys_says_which(allocator) -> None:
    backend = FillsUp(allocator=allocator)
    objs = [filled(allocator, (4, 4), torch.float32, n) for n in range(4)]
    with pytest.raises(CapacityExceeded, match="2 stored and 2 not") as refused:
        run(backend.batched_put([key(n) for n in range(4)], objs))
    assert refused.value.stored == (True, True, False, False)
    assert isinstance(refused.value.__cause__, CapacityExceeded)
    assert [run(backend.contains(key(n))) for n in range(4)] == [True, True, False, False]
    for obj in objs:
        obj.release()


class WritesOnItsHomeLoop(DictBytes):
    """A loop-bound backend whose get_into writes the destination step by step on its loop."""

    loop_bound = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ended = threading.Event()

    async def _get_into(self, key: CacheKey, dest: MemoryObj) -> bool:
        try:
            for step in range(200):
                await asyncio.sleep(0.005)
                dest.raw[step] = 1
        finally:
            self.ended.set()
        return True


def test_a_call_from_another_loop_cancelled_returns_once_the_home_loop_let_go(allocator) -> None:
    backend = WritesOnItsHomeLoop(allocator=allocator)
    with loop_thread() as home:
        asyncio.run_coroutine_threadsafe(backend.contains(key(0)), home).result(5)  # binds it

        async def cancelled_read() -> tuple[bool, int]:
            dest = MemoryObj.from_tensor(torch.zeros(4096, dtype=torch.uint8))
            reading = asyncio.ensure_future(backend.get_into(key(1), dest))
            await asyncio.sleep(0.05)
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reading
            return backend.ended.is_set(), dest.ref_count

        ended, refs = asyncio.run(cancelled_read())
        assert ended, "the call returned while its home loop was still writing the buffer"
        assert refs == 1


class ReadsAtItsOwnPace(Backend):
    """Gets that each allocate their object, one after another a few milliseconds apart."""

    async def _get(self, key: CacheKey) -> MemoryObj | None:
        await asyncio.sleep(0.002 * (1 + key.chunk_hash % 8))
        obj = self.allocator.allocate((64, 64), torch.float32)
        assert obj is not None
        return obj

    async def _put(self, key: CacheKey, obj: MemoryObj) -> None:
        raise NotImplementedError

    async def _contains(self, key: CacheKey) -> bool:
        return True


def test_a_cancelled_batched_get_leaves_none_of_what_it_read_allocated(allocator) -> None:
    async def main() -> None:
        backend = ReadsAtItsOwnPace("pace://", allocator=allocator)
        keys = [key(n) for n in range(8)]
        for delay in (0.003, 0.005, 0.009, 0.013):
            reading = asyncio.ensure_future(backend.batched_get(keys))
            await asyncio.sleep(delay)  # some reads have finished, others not
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                for obj in await reading:
                    if obj is not None:
                        obj.release()
            assert allocator.stats().object_count == 0, f"cancelled after {delay} s"

    run(main())
