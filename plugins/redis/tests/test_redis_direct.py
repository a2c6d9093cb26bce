"""Direct reads of the Redis and Valkey tiers (kvplug_redis.direct) against real servers: gets
and batched gets received straight into allocator memory over plain TCP, TLS, a unix socket,
Sentinel and Valkey; misses, a full allocator, damaged values, error replies, credentials, a
database other than 0, a restart, a paused server, and a get cancelled mid-reply, which must
never write into memory it no longer owns."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import torch

import kvplug
from kvplug import (
    BackendError,
    BackendTimeout,
    BackendUnavailable,
    CacheKey,
    FreeListAllocator,
    LayoutMismatch,
    MemoryFormat,
    MemoryObj,
)
from kvplug import frame as frame_module
from kvplug import serde as serde_module
from kvplug.errors import CorruptObject
from kvplug.frame import Buffer, FrameReceiver, encode_frame
from kvplug.serde import Serde, register_serde
from kvplug_redis import RedisBackend
from kvplug_redis.direct import DirectConnections, reply_error, restart
from kvplug_testing import RedisServer, SentinelGroup, ValkeyServer
from kvplug_testing.server_fixtures import PASSWORD
from kvplug_testing.tier_checks import (
    fresh_keys,
    make_obj,
    opened,
    reads_back,
    release,
    releasing,
    run,
    same,
)

pytestmark = pytest.mark.redis

LARGE = (2, 64, 256, 1024)
"""64 MiB of fp16: a value a paused server stops sending in the middle of."""


def direct_of(backend: object) -> DirectConnections:
    assert isinstance(backend, RedisBackend)
    assert backend.direct is not None, "kvplug's own connections are off"
    return backend.direct


@pytest.fixture(
    scope="module", params=["redis", "rediss", "unix", "sentinel", "rediss+sentinel", "valkey"]
)
def any_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A server of each kind that direct reads serve, by its kvplug URL."""
    kind = request.param
    if kind.endswith("sentinel"):
        with SentinelGroup(password=PASSWORD, tls=kind.startswith("rediss")) as group:
            yield group.url
        return
    process = (
        ValkeyServer()
        if kind == "valkey"
        else RedisServer(
            tls=kind == "rediss", tls_auth_clients=kind == "rediss", unix_socket=kind == "unix"
        )
    )
    with process:
        yield process.url


# -- round trips ---------------------------------------------------------------------------------


def test_gets_and_batched_gets_are_bit_exact_through_direct_reads(any_url: str) -> None:
    objs = [
        make_obj(1),
        make_obj(2, (2, 4, 256, 1024)),  # 4 MiB: many reads straight into the object
        make_obj(3, (1000,), torch.uint8, MemoryFormat.BINARY_BUFFER),  # not a multiple of 64
        make_obj(4, (3, 5), torch.bfloat16, MemoryFormat.KV_T2D),
        make_obj(5, (0, 8), torch.float32, MemoryFormat.KV_2TD),  # an empty payload
    ]
    keys = fresh_keys(len(objs) + 1)
    allocator = FreeListAllocator(64 << 20, pin=False)

    async def scenario() -> None:
        async with opened(any_url, allocator=allocator) as backend:
            direct = direct_of(backend)
            await backend.batched_put(keys[:-1], objs)
            for key, obj in zip(keys, objs, strict=False):
                got = await backend.get(key)
                assert same(obj, got), key
                release(got)
            many = await backend.batched_get(keys)
            with releasing(*many):
                assert all(same(o, g) for o, g in zip(objs, many, strict=False))
                assert many[-1] is None  # a miss in the same pipeline
            assert await backend.get(keys[-1]) is None
            assert direct.gets == 2 * len(objs) + 2
            assert direct.connects == 1  # one connection served every read in turn
        assert direct.open_connections == 0

    with releasing(*objs):
        run(scenario())
    assert allocator.stats().used == 0


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_an_address_connects_without_an_executor_thread_and_a_name_is_resolved(
    standalone: RedisServer, host: str
) -> None:
    # A lookup runs on a thread of the loop's default executor, which outlives a loop that
    # is only closed (a SyncClient's threads were found left over after close that way).
    url = standalone.url.replace("127.0.0.1", host)
    (key,) = fresh_keys(1)
    obj = make_obj(6)

    async def scenario() -> list[str]:
        before = set(threading.enumerate())
        async with opened(url) as backend:
            await backend.put(key, obj)
            await reads_back(backend, key, obj)
            assert direct_of(backend).gets == 1
        return [t.name for t in set(threading.enumerate()) - before if t.is_alive()]

    with releasing(obj):
        started = run(scenario())
    if host == "127.0.0.1":
        assert started == []


def test_a_32_mib_chunk_round_trips_over_tls_and_plain() -> None:
    obj = make_obj(6, (2, 32, 256, 1024))
    with releasing(obj):
        for server in (RedisServer(), RedisServer(tls=True)):
            with server:

                async def scenario(url: str = server.url) -> None:
                    async with opened(url) as backend:
                        key = fresh_keys(1)[0]
                        await backend.put(key, obj)
                        await reads_back(backend, key, obj)
                        assert direct_of(backend).gets == 1

                run(scenario())


@pytest.mark.parametrize(
    ("off", "direct_gets", "direct_sets"), [("direct_reads", 0, 1), ("direct_writes", 3, 0)]
)
def test_direct_reads_or_writes_off_go_through_the_client_library(
    standalone: RedisServer, off: str, direct_gets: int, direct_sets: int
) -> None:
    key, missing = fresh_keys(2)
    obj = make_obj(7)

    async def scenario() -> None:
        async with opened(standalone.url, **{off: False}) as backend:
            direct = direct_of(backend)
            await backend.put(key, obj)
            got = await backend.get(key)
            many = await backend.batched_get([key, missing])
            with releasing(got, *many):
                assert same(obj, got) and same(obj, many[0]) and many[1] is None
            assert (direct.gets, direct.sets) == (direct_gets, direct_sets)

    with releasing(obj):
        run(scenario())
    both_off = kvplug.create_backend(standalone.url, direct_writes=False, direct_reads=False)
    assert isinstance(both_off, RedisBackend) and both_off.direct is None


def test_puts_sent_from_memory_on_own_connections_read_back_bit_exact_and_exist(
    any_url: str,
) -> None:
    keys = fresh_keys(5)
    objs = [make_obj(80 + n, (2, 4, 64, 256)) for n in range(5)]

    async def scenario() -> None:
        async with opened(any_url) as backend:
            direct = direct_of(backend)
            await backend.put(keys[0], objs[0])
            await backend.batched_put(keys[1:], objs[1:])
            got = await backend.batched_get(keys)
            with releasing(*got):
                assert all(same(obj, one) for obj, one in zip(objs, got, strict=True))
            # TLS writes go through the client library (its encryption copies anyway).
            assert direct.sets == (0 if any_url.startswith("rediss") else 5)
            missing = fresh_keys(1)[0]
            assert await backend.contains(keys[4]) and not await backend.contains(missing)
            assert await backend.batched_contains([*keys, missing, keys[0]]) == 5

    with releasing(*objs):
        run(scenario())


def test_a_batch_larger_than_a_pipeline_is_spread_over_connections(
    standalone: RedisServer,
) -> None:
    shape = (2, 8, 256, 1024)  # 8 MiB each: 10 of them make two pipelines
    keys = fresh_keys(10)
    objs = [make_obj(90 + n, shape) for n in range(10)]

    async def scenario() -> None:
        async with opened(standalone.url) as backend:
            direct = direct_of(backend)
            await backend.batched_put(keys, objs)
            assert (direct.sets, direct.open_connections) == (10, 2)
            for key, obj in zip(keys, objs, strict=True):
                await reads_back(backend, key, obj)

    with releasing(*objs):
        run(scenario())


def test_a_put_to_a_paused_server_times_out_and_leaves_no_part_of_the_value(
    fresh_server: RedisServer,
) -> None:
    """A 64 MiB put that cannot finish (the server stopped mid-value) ends at its deadline,
    aborts its connection, and the server, resumed, drops the half-sent command: the key is
    absent, never a prefix of the value."""
    obj, small = make_obj(95, LARGE), make_obj(96)
    key = fresh_keys(1)[0]

    async def scenario() -> None:
        async with opened(fresh_server.url, timeout=1.0) as backend:
            direct = direct_of(backend)
            await backend.put(fresh_keys(1)[0], small)  # logged in, the server's limits read
            fresh_server.pause()
            try:
                with pytest.raises(BackendTimeout):
                    await backend.put(key, obj)
                assert direct.open_connections == 0, "the timed-out put's connection is open"
            finally:
                fresh_server.resume()
            await asyncio.sleep(0.3)
            assert not await backend.contains(key)
            await backend.put(key, obj)
            await reads_back(backend, key, obj)

    with releasing(obj, small):
        run(scenario())


@pytest.mark.parametrize(
    ("url", "options", "writes_direct"),
    [
        ("redis+cluster://h1:7000", {}, False),
        ("redis+sentinel://h1/mymaster", {"read_from_replicas": True}, True),
        ("valkey://h1", {"direct_reads": "false"}, True),
        ("rediss://h1", {}, False),
    ],
)
def test_cluster_and_replica_reads_and_tls_writes_keep_the_client_library(
    url: str, options: dict[str, Any], writes_direct: bool
) -> None:
    backend = kvplug.create_backend(url, **options)
    assert isinstance(backend, RedisBackend)
    assert (backend.reads_direct, backend.writes_direct) == (
        url.startswith("rediss"),
        writes_direct,
    )


@pytest.fixture
def reversing_serde() -> Iterator[str]:
    """A serde other than naive, registered for one test."""

    class Reverse(Serde):
        name = "test-direct-reverse"

        def encode(self, obj: MemoryObj, key: CacheKey | None = None) -> bytes:
            return bytes(obj.memoryview())[::-1]

        def decode(self, payload: memoryview, out: MemoryObj, key: CacheKey | None = None) -> None:
            if payload.nbytes != out.nbytes:
                raise CorruptObject("size")
            out.memoryview()[:] = bytes(payload)[::-1]

    serdes, instances = dict(serde_module._serdes), dict(serde_module._instances)
    register_serde(Reverse)
    yield Reverse.name
    serde_module._serdes.clear()
    serde_module._serdes.update(serdes)
    serde_module._instances.clear()
    serde_module._instances.update(instances)


def test_another_serde_is_received_into_scratch_and_decoded(
    standalone: RedisServer, reversing_serde: str
) -> None:
    keys = fresh_keys(2)
    obj = make_obj(8)

    async def scenario() -> None:
        async with opened(standalone.url, serde=reversing_serde) as backend:
            await backend.put(keys[0], obj)
            got = await backend.get(keys[0])
            many = await backend.batched_get(keys)
            with releasing(got, *many):
                assert same(obj, got) and same(obj, many[0]) and many[1] is None
            assert direct_of(backend).gets == 3

    with releasing(obj):
        run(scenario())


# -- a full allocator, damaged values, error replies ---------------------------------------------


def test_a_full_allocator_reads_as_a_miss_and_the_connection_goes_on(
    standalone: RedisServer,
) -> None:
    big, small = make_obj(9, (2, 2, 256, 1024)), make_obj(10)  # 2 MiB and 4 KiB
    keys = fresh_keys(2)
    allocator = FreeListAllocator(1 << 20, pin=False)

    async def scenario() -> None:
        async with opened(standalone.url, allocator=allocator) as backend:
            direct = direct_of(backend)
            await backend.batched_put(keys, [big, small])
            assert await backend.get(keys[0]) is None
            await reads_back(backend, keys[1], small)
            many = await backend.batched_get([keys[0], keys[1], keys[0]])
            with releasing(*many):
                assert many[0] is None and same(small, many[1]) and many[2] is None
            assert backend.corrupt_objects == 0
            assert direct.connects == 1

    with releasing(big, small):
        run(scenario())
    assert allocator.stats().used == 0


def _damage(value: bytes, how: str) -> bytes:
    damaged = bytearray(value)
    if how == "payload bit":
        damaged[len(damaged) - 100] ^= 0x01
    elif how == "header bit":
        damaged[20] ^= 0x40
    elif how == "truncated":
        del damaged[len(damaged) // 2 :]
    elif how == "longer":
        damaged += b"\x00" * 64
    elif how == "short garbage":
        damaged = bytearray(b"\x00garbage\xff" * 3)
    else:
        damaged = bytearray(b"\x00garbage\xff" * 700)
    return bytes(damaged)


def _damage_stored(server: RedisServer, backend: object, key: CacheKey, how: str) -> None:
    """Replace the value stored under ``key`` with a damaged copy of it."""
    assert isinstance(backend, RedisBackend)
    name = backend.key_string(key)
    with server.client() as client:
        client.set(name, _damage(client.get(name), how))


@pytest.mark.parametrize(
    "how", ["payload bit", "header bit", "truncated", "longer", "short garbage", "garbage"]
)
def test_a_damaged_value_is_a_counted_deleted_miss(standalone: RedisServer, how: str) -> None:
    keys = fresh_keys(3)
    objs = [make_obj(20 + n, (2, 2, 64, 256)) for n in range(3)]
    allocator = FreeListAllocator(16 << 20, pin=False)

    async def scenario() -> None:
        async with opened(standalone.url, allocator=allocator) as backend:
            assert isinstance(backend, RedisBackend)
            await backend.batched_put(keys, objs)
            for key in keys[:2]:
                _damage_stored(standalone, backend, key, how)
            assert await backend.get(keys[0]) is None
            assert backend.corrupt_objects == 1
            many = await backend.batched_get(keys[1:])
            with releasing(*many):
                assert many[0] is None and same(objs[2], many[1])
            assert backend.corrupt_objects == 2
            with standalone.client() as client:
                names = [backend.key_string(key) for key in keys]
                assert client.exists(*names) == 1  # both damaged values deleted
            assert direct_of(backend).connects == 1  # the damaged values were drained

    with releasing(*objs):
        run(scenario())
    assert allocator.stats().used == 0


def test_values_are_hashed_as_they_arrive_and_damage_in_an_early_piece_is_still_caught(
    standalone: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = fresh_keys(3)
    objs = [make_obj(40 + n, (2, 4, 256, 1024)) for n in range(3)]  # 4 MiB: several hash steps
    allocator = FreeListAllocator(64 << 20, pin=False)
    hashed_whole: list[int] = []
    checksum = frame_module.payload_checksum

    def counting(payload: Buffer) -> int:
        hashed_whole.append(memoryview(payload).nbytes)
        return checksum(payload)

    async def scenario() -> None:
        async with opened(standalone.url, allocator=allocator) as backend:
            assert isinstance(backend, RedisBackend)
            name = backend.key_string(keys[0])
            await backend.batched_put(keys, objs)
            with standalone.client() as client:
                value = bytearray(client.get(name))
                value[len(value) // 4] ^= 1  # about 1 MiB into the payload
                client.set(name, bytes(value))
            monkeypatch.setattr(frame_module, "payload_checksum", counting)
            many = await backend.batched_get(keys)
            with releasing(*many):
                assert many[0] is None and same(objs[1], many[1]) and same(objs[2], many[2])
            await reads_back(backend, keys[2], objs[2])
            assert backend.corrupt_objects == 1
            assert hashed_whole == []  # every checksum was streamed as the bytes came in

    with releasing(*objs):
        run(scenario())
    assert allocator.stats().used == 0


def test_receivers_restarted_for_a_fetch_sent_again_read_the_new_values_only() -> None:
    """What a fetch does when the master moved or the connection broke mid-batch: the
    receivers let go of what the first try gave them and take the second try's values."""
    obj = make_obj(90)
    value = b"".join(bytes(memoryview(part)) for part in encode_frame(obj))
    allocator = FreeListAllocator(1 << 20, pin=False)
    receivers = [FrameReceiver(allocator) for _ in range(3)]
    with releasing(obj):
        receivers[0].receive(_damage(value, "header bit"))
        receivers[1].receive(value)  # holds allocator memory until restarted
        restart(receivers)
        assert allocator.stats().used == 0
        receivers[0].receive(value)
        receivers[1].receive(value)  # receivers[2]: a miss this time
        got = [receiver.finish() for receiver in receivers]
        with releasing(*got):
            assert same(obj, got[0]) and same(obj, got[1]) and got[2] is None
    assert allocator.stats().used == 0


@contextlib.asynccontextmanager
async def paused_mid_value(
    server: RedisServer, pending: asyncio.Future[Any], started: Callable[[], bool]
) -> AsyncIterator[None]:
    """Pause ``server`` once ``pending`` has ``started()`` receiving a value and before it got
    all of it; the body runs while the server is stopped; the server resumes on exit."""
    while not started() and not pending.done():
        await asyncio.sleep(0)
    server.pause()
    try:
        await asyncio.sleep(0.3)
        assert not pending.done(), "the whole value arrived before the pause"
        yield
    finally:
        server.resume()


def test_get_into_receives_into_the_callers_memory_damage_misses_another_size_raises(
    standalone: RedisServer,
) -> None:
    keys = fresh_keys(4)
    objs = [make_obj(40 + n, (2, 2, 64, 256)) for n in range(4)]
    allocator = FreeListAllocator(16 << 20, pin=False)

    async def scenario() -> None:
        async with opened(standalone.url, allocator=allocator) as backend:
            dests = [
                MemoryObj.from_tensor(torch.zeros(objs[0].nbytes, dtype=torch.uint8)) for _ in keys
            ]
            short = MemoryObj.from_tensor(torch.full((objs[0].nbytes // 2,), 7, dtype=torch.uint8))
            await backend.batched_put(keys[:3], objs[:3])
            _damage_stored(standalone, backend, keys[1], "payload bit")
            hits = await backend.batched_get_into(keys, dests)
            connections = direct_of(backend).connects  # the batch was spread over connections
            assert hits == [True, False, True, False]
            assert torch.equal(dests[0].raw, objs[0].raw) and torch.equal(dests[2].raw, objs[2].raw)
            assert backend.corrupt_objects == 1
            assert not await backend.contains(keys[1])  # the damaged value was deleted
            with pytest.raises(LayoutMismatch, match=r"stored as \[2, 2, 64, 256\]"):
                await backend.batched_get_into([keys[0]], [short])
            assert bool((short.raw == 7).all())  # another size: nothing written
            assert all(dest.ref_count == 1 for dest in [*dests, short])
            assert allocator.stats().used == 0  # nothing went through kvplug's own memory
            assert direct_of(backend).connects == connections  # values not taken were drained

    with releasing(*objs):
        run(scenario())


def test_a_cancelled_get_into_never_writes_into_the_callers_memory_afterwards(
    fresh_server: RedisServer,
) -> None:
    obj = make_obj(71, LARGE)
    key = fresh_keys(1)[0]

    async def scenario() -> None:
        async with opened(fresh_server.url, timeout=60) as backend:
            dest = MemoryObj.from_tensor(torch.zeros(obj.nbytes, dtype=torch.uint8))
            await backend.put(key, obj)
            pending = asyncio.ensure_future(backend.batched_get_into([key], [dest]))
            # One reference is the caller's, one get_into's own; a third is the reader's, taken
            # once the header arrived and the payload goes into dest.
            async with paused_mid_value(fresh_server, pending, lambda: dest.ref_count > 2):
                pending.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await pending
                assert dest.ref_count == 1  # the reader let go of the caller's memory
                dest.raw.fill_(0xAB)
            await asyncio.sleep(0.5)  # the server sends the rest of the value now
            intact = bool((dest.raw == 0xAB).all())
            assert intact, "the cancelled get_into wrote into the caller's memory afterwards"
            assert await backend.batched_get_into([key], [dest]) == [True]
            assert torch.equal(dest.raw, obj.raw)

    with releasing(obj):
        run(scenario())


def test_an_error_reply_is_a_backend_error_and_releases_the_batch(
    standalone: RedisServer,
) -> None:
    keys = fresh_keys(3)
    obj = make_obj(30)
    allocator = FreeListAllocator(4 << 20, pin=False)

    async def scenario() -> None:
        async with opened(standalone.url, allocator=allocator) as backend:
            assert isinstance(backend, RedisBackend)
            await backend.batched_put([keys[0], keys[2]], [obj, obj])
            with standalone.client() as client:
                client.lpush(backend.key_string(keys[1]), b"x")
            with pytest.raises(BackendError, match="WRONGTYPE"):
                await backend.get(keys[1])
            with pytest.raises(BackendError, match="WRONGTYPE"):
                await backend.batched_get(keys)
            assert allocator.stats().used == 0  # the objects read around it were released
            await reads_back(backend, keys[2], obj)
            assert direct_of(backend).connects == 1

    with releasing(obj):
        run(scenario())


@pytest.mark.parametrize(
    ("line", "auth", "expected", "says"),
    [
        ("LOADING Redis is loading the dataset in memory", False, BackendUnavailable, "loading"),
        ("READONLY You can't write against a read only replica.", False, BackendUnavailable, ""),
        ("MASTERDOWN Link with MASTER is down", False, BackendUnavailable, "failing over"),
        ("ERR max number of clients reached", True, BackendUnavailable, "unreachable"),
        ("NOAUTH Authentication required.", False, BackendError, "user name and password"),
        ("WRONGPASS invalid username-password pair", False, BackendError, "user name and"),
        ("NOPERM this user has no permissions", False, BackendError, "ACL permissions"),
        ("ERR invalid password", True, BackendError, "user name and password"),
        ("WRONGTYPE Operation against a key", False, BackendError, "rejected by the server"),
    ],
)
def test_error_replies_become_the_errors_the_client_libraries_give(
    line: str, auth: bool, expected: type[Exception], says: str
) -> None:
    for url in ("redis://h1", "valkey://h1"):
        backend = kvplug.create_backend(url)
        assert isinstance(backend, RedisBackend)
        error = backend._translate(reply_error(backend._lib.exceptions, line, auth=auth), "get")
        assert type(error) is expected, (url, error)
        assert says in str(error) and line in str(error)


# -- connection set-up: credentials and the database ---------------------------------------------


def _direct_round_trip(url: str, **options: Any) -> int:
    """Put and get one object through ``url``; the number of direct ``GET`` s."""
    key = fresh_keys(1)[0]
    obj = make_obj(40)

    async def scenario() -> int:
        async with opened(url, **options) as backend:
            await backend.put(key, obj)
            await reads_back(backend, key, obj)
            return direct_of(backend).gets

    with releasing(obj):
        return run(scenario())


def test_direct_connections_log_in_with_a_password_or_an_acl_user(
    password_server: RedisServer,
) -> None:
    address = f"127.0.0.1:{password_server.port}"
    assert _direct_round_trip(password_server.url) == 1
    assert _direct_round_trip(f"redis://alice:alice-pw@{address}") == 1
    assert _direct_round_trip(f"redis://{address}", username="alice", password="alice-pw") == 1


def test_refused_credentials_and_permissions_name_the_credentials(
    password_server: RedisServer,
) -> None:
    address = f"127.0.0.1:{password_server.port}"
    key = fresh_keys(1)[0]

    async def get_without_open(url: str) -> None:
        backend = kvplug.create_backend(url)  # not opened: the get is the first contact
        try:
            await backend.get(key)
        finally:
            await backend.close()

    refused = {
        "wrong password": f"redis://:n0t-the-pw@{address}",
        "no password": f"redis://{address}",
        "no GET permission": f"redis://blind:blind-pw@{address}",
    }
    for why, url in refused.items():
        with pytest.raises(BackendError, match="user name and password") as error:
            run(get_without_open(url))
        assert "n0t-the-pw" not in str(error.value), why


def test_a_database_other_than_0_is_selected(standalone: RedisServer) -> None:
    key = fresh_keys(1)[0]
    obj = make_obj(41)

    async def scenario() -> str:
        async with opened(f"{standalone.url}/3") as backend:
            assert isinstance(backend, RedisBackend)
            await backend.put(key, obj)
            await reads_back(backend, key, obj)
            assert direct_of(backend).gets == 1
            return backend.key_string(key)

    with releasing(obj):
        name = run(scenario())
    with standalone.client(db=3) as client:
        assert client.exists(name) == 1
    with standalone.client() as client:
        assert client.exists(name) == 0


# -- event loops ---------------------------------------------------------------------------------


@pytest.mark.parametrize("direct_reads", [True, False], ids=["direct", "client"])
def test_a_backend_used_from_another_threads_loop_closes_that_loops_connections_with_it(
    standalone: RedisServer, direct_reads: bool
) -> None:
    """An engine opens the backend on one loop and uses it from a worker's ``asyncio.run``:
    the worker's loop gets connections of its own, closed when that loop ends, and the
    opening loop goes on with its own."""
    keys = fresh_keys(2)
    obj = make_obj(95)
    home = asyncio.new_event_loop()

    async def round_trip(backend: kvplug.Backend, key: CacheKey) -> None:
        await backend.put(key, obj)
        got = await backend.batched_get(keys)
        with releasing(*got):
            assert same(obj, got[keys.index(key)])

    backend = home.run_until_complete(
        kvplug.open_backend(standalone.url, direct_reads=direct_reads)
    )
    assert isinstance(backend, RedisBackend)
    try:
        home.run_until_complete(round_trip(backend, keys[0]))
        failures: list[BaseException] = []

        def worker() -> None:
            try:
                asyncio.run(round_trip(backend, keys[1]))
            except BaseException as error:
                failures.append(error)

        thread = threading.Thread(target=worker)
        thread.start()
        thread.join(60)
        assert not thread.is_alive() and not failures, failures
        if backend.direct is not None:
            # The worker dropped the opening loop's idle connection (a connection serves the
            # loop that opened it), and its own closed with its loop.
            assert backend.direct.open_connections == 0
        worker_clients = backend._clients
        assert worker_clients.loop is not None and worker_clients.loop.is_closed()
        assert worker_clients.keeper is None  # it ran at the loop's shutdown
        home.run_until_complete(round_trip(backend, keys[0]))
        assert backend._clients.loop is home
        home.run_until_complete(backend.close())
        if backend.direct is not None:
            assert backend.direct.open_connections == 0
    finally:
        home.run_until_complete(backend.close())
        obj.release()
        home.close()


# -- outages, deadlines, cancellation ------------------------------------------------------------


def test_a_restart_fails_fast_then_reads_again_without_reopening(
    fresh_server: RedisServer,
) -> None:
    key = fresh_keys(1)[0]
    obj = make_obj(50)

    async def scenario() -> None:
        async with opened(fresh_server.url, timeout=2.0) as backend:
            direct = direct_of(backend)
            await backend.put(key, obj)
            await reads_back(backend, key, obj)
            fresh_server.stop()
            await asyncio.to_thread(fresh_server.start)
            await backend.put(key, obj)
            # The pooled connection died with the server: the get retries on a new one.
            await reads_back(backend, key, obj)
            assert direct.connects == 2
            fresh_server.stop()
            started = time.monotonic()
            with pytest.raises(BackendUnavailable):
                await backend.get(key)
            assert time.monotonic() - started < 1.0  # refused, not waiting for the deadline
            await asyncio.to_thread(fresh_server.start)
            await backend.put(key, obj)
            await reads_back(backend, key, obj)

    with releasing(obj):
        run(scenario())


def test_a_paused_server_times_out_and_the_stale_reply_is_never_read(
    fresh_server: RedisServer,
) -> None:
    keys = fresh_keys(2)
    objs = [make_obj(60), make_obj(61)]
    deadline = 0.5
    allocator = FreeListAllocator(4 << 20, pin=False)

    async def scenario() -> None:
        async with opened(fresh_server.url, timeout=deadline, allocator=allocator) as backend:
            await backend.batched_put(keys, objs)
            release(await backend.get(keys[0]))  # a pooled connection exists
            fresh_server.pause()
            try:
                started = time.monotonic()
                with pytest.raises(BackendTimeout):
                    await backend.get(keys[0])
                assert time.monotonic() - started < deadline + 0.5
                with pytest.raises(BackendTimeout):
                    await backend.batched_get(keys)
            finally:
                fresh_server.resume()
            # The server now answers the timed-out GETs on their connections; those were
            # aborted, so this get cannot take keys[0]'s late reply for its own.
            await reads_back(backend, keys[1], objs[1])
            assert direct_of(backend).connects == 3

    with releasing(*objs):
        run(scenario())
    assert allocator.stats().used == 0


def test_a_cancelled_get_never_writes_into_memory_it_gave_back(fresh_server: RedisServer) -> None:
    """Cancel a 64 MiB get while its reply is arriving (the server paused mid-value), hand the
    same allocator memory to a new object, let the server send the rest: the new object's
    bytes must stay as written."""
    obj = make_obj(70, LARGE)
    key = fresh_keys(1)[0]
    allocator = FreeListAllocator(obj.nbytes, pin=False)

    async def scenario() -> None:
        async with opened(fresh_server.url, timeout=60, allocator=allocator) as backend:
            await backend.put(key, obj)
            pending = asyncio.ensure_future(backend.get(key))
            async with paused_mid_value(fresh_server, pending, lambda: allocator.stats().used > 0):
                pending.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await pending
                assert allocator.stats().used == 0
                reuse = allocator.allocate(LARGE, torch.float16)
                assert reuse is not None and reuse.offset == 0
                reuse.raw.fill_(0xAB)
            await asyncio.sleep(0.5)  # the server sends the rest of the value now
            intact = bool((reuse.raw == 0xAB).all())  # not in the assert: no 64 MiB repr
            reuse.release()
            assert intact, "the cancelled get wrote into memory it had given back"
            await reads_back(backend, key, obj)

    with releasing(obj):
        run(scenario())


def test_close_aborts_a_direct_read_in_flight(fresh_server: RedisServer) -> None:
    obj = make_obj(80, LARGE)
    key = fresh_keys(1)[0]
    allocator = FreeListAllocator(obj.nbytes, pin=False)

    async def scenario() -> None:
        backend = await kvplug.open_backend(fresh_server.url, allocator=allocator, timeout=60)
        direct = direct_of(backend)
        await backend.put(key, obj)
        pending = asyncio.ensure_future(backend.get(key))
        async with paused_mid_value(fresh_server, pending, lambda: allocator.stats().used > 0):
            await backend.close()
            with pytest.raises(kvplug.BackendClosed):
                await pending
            assert allocator.stats().used == 0
        assert direct.open_connections == 0

    with releasing(obj):
        run(scenario())
