"""Sentinel failovers in which the old master survives (paused and resumed, or deposed by a
planned ``SENTINEL FAILOVER``), against real redis-server/valkey-server and sentinel
processes, plain and over TLS: under a concurrent load of puts and gets, no read returns an
older version of a key than one acknowledged before the read began, and a reply that the
deposed master sends after the switch is never used."""

from __future__ import annotations

import asyncio
import random
import struct
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import kvplug
from kvplug import BackendTimeout, BackendUnavailable, CacheKey, MemoryObj
from kvplug.frame import encode_frame
from kvplug_redis import RedisBackend
from kvplug_redis.sentinel import Answer, choose
from kvplug_testing import SentinelGroup, TLSUnsupported, open_backend_for_failover
from kvplug_testing.server_family import REDIS, VALKEY

pytestmark = [pytest.mark.redis, pytest.mark.slow]

SHAPE = (2, 1, 16, 64)
KEYS = 48
READERS = 4
WRITERS = 4
DEADLINE = 2.0
TAG = struct.Struct("<qq")


def started(request: pytest.FixtureRequest) -> Iterator[SentinelGroup]:
    family, tls = request.param
    if tls:
        family.skip_without_tls()
    try:
        with family.sentinel_group(tls=tls) as group:
            yield group
    except TLSUnsupported as error:
        pytest.skip(f"{family.name} over TLS: {error}")


@pytest.fixture(
    params=[(REDIS, False), (REDIS, True), (VALKEY, False), (VALKEY, True)],
    ids=["redis", "rediss", "valkey", "valkeys"],
)
def group(request: pytest.FixtureRequest) -> Iterator[SentinelGroup]:
    """Redis and Valkey, each plain and over TLS."""
    yield from started(request)


@pytest.fixture(params=[(REDIS, False), (VALKEY, False)], ids=["redis", "valkey"])
def plain_group(request: pytest.FixtureRequest) -> Iterator[SentinelGroup]:
    """Redis and Valkey without TLS, for what does not depend on the transport."""
    yield from started(request)


def key_of(model: str, n: int) -> CacheKey:
    return CacheKey(model, 1, 0, n)


def version_of(n: int, version: int) -> MemoryObj:
    """Key ``n``'s value at ``version``: seeded bytes led by (n, version)."""
    generator = torch.Generator().manual_seed(n * 100_003 + version)
    size = int(torch.tensor(SHAPE).prod()) * 2
    raw = torch.randint(0, 256, (size,), generator=generator, dtype=torch.uint8)
    raw[: TAG.size] = torch.frombuffer(bytearray(TAG.pack(n, version)), dtype=torch.uint8)
    return MemoryObj.from_tensor(raw.view(torch.float16).reshape(SHAPE))


def read_version(n: int, got: MemoryObj) -> int:
    """The version ``got`` holds, checked to be exactly key ``n``'s value at it."""
    tagged_n, version = (int(x) for x in TAG.unpack(bytes(got.memoryview()[: TAG.size])))
    assert tagged_n == n, f"key {n} read key {tagged_n}'s value"
    expected = version_of(n, version)
    try:
        assert torch.equal(expected.raw, got.raw), f"key {n} version {version}: other bytes"
    finally:
        expected.release()
    return version


class Load:
    """Readers that check every read against the versions acknowledged before it began."""

    def __init__(self, backend: kvplug.Backend, model: str) -> None:
        self.backend = backend
        self.model = model
        self.acked = dict.fromkeys(range(KEYS), 0)
        self.stale: list[str] = []
        self.reads = 0
        self.failed = 0
        self.running = True

    async def put(self, n: int, version: int, deadline: float) -> None:
        """Put until acknowledged (failures are retried until ``deadline``)."""
        obj = version_of(n, version)
        try:
            while True:
                try:
                    await self.backend.put(key_of(self.model, n), obj)
                    self.acked[n] = version
                    return
                except (BackendUnavailable, BackendTimeout):
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.05)
        finally:
            obj.release()

    async def write_all(self, version: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout

        async def writer(first: int) -> None:
            for n in range(first, KEYS, WRITERS):
                await self.put(n, version, deadline)

        await asyncio.gather(*(writer(w) for w in range(WRITERS)))

    async def check(self, n: int) -> None:
        """Read key ``n``; record it when it is older than the version acknowledged before
        the read began (a miss counts as version 0)."""
        floor = self.acked[n]
        got = await self.backend.get(key_of(self.model, n))
        self.reads += 1
        version = 0
        if got is not None:
            try:
                version = read_version(n, got)
            finally:
                got.release()
        if version < floor:
            self.stale.append(f"key {n}: read version {version} after {floor} was acknowledged")

    async def reader(self, seed: int) -> None:
        rng = random.Random(seed)
        while self.running:
            try:
                await self.check(rng.randrange(KEYS))
            except (BackendUnavailable, BackendTimeout):
                self.failed += 1
                await asyncio.sleep(0.02)

    async def read_for(self, seconds: float) -> int:
        """Keep the readers going ``seconds`` longer; the reads they made meanwhile."""
        before = self.reads
        await asyncio.sleep(seconds)
        return self.reads - before


@pytest.mark.parametrize("how", ["pause", "planned"])
def test_reads_follow_the_sentinels_when_the_old_master_lives_on(
    group: SentinelGroup, how: str
) -> None:
    """Versions 1 are written and replicated; the master is paused until the sentinels promote
    the replica (or deposed by ``SENTINEL FAILOVER`` and left running); versions 2 are written
    once every sentinel names the new master; the old master resumes; versions 3 are written,
    and the readers go on until the sentinels have made the old master a replica (which drops
    what was written to it after the switch). Four readers run throughout, and no read, nor the
    final read of every key, may return an older version than the one acknowledged before it
    began (nor a miss)."""

    async def scenario() -> None:
        backend = await open_backend_for_failover(group.url, timeout=DEADLINE)
        assert isinstance(backend, RedisBackend) and backend.tracker is not None
        interval = backend.options.master_check_interval
        load = Load(backend, f"failover-{how}-{random.randrange(10**9)}")
        readers: list[asyncio.Future[None]] = []
        try:
            await load.write_all(1)
            with group.master.client() as client:
                assert client.execute_command("WAIT", 1, 5000) >= 1
            readers = [asyncio.ensure_future(load.reader(seed)) for seed in range(READERS)]
            await load.read_for(0.5)
            if how == "pause":
                old = await asyncio.to_thread(group.pause_master)
            else:
                old = await asyncio.to_thread(group.planned_failover)
            new = await asyncio.to_thread(group.wait_for_failover, old)
            await asyncio.to_thread(group.wait_until_all_name, new)
            await load.read_for(1.5 * interval)
            await load.write_all(2)
            group.resume_all()
            reads_after_resume = await load.read_for(1.0)
            await load.write_all(3)
            await asyncio.to_thread(group.wait_until_replica, old)
            reads_after_resume += await load.read_for(1.0)
            load.running = False
            await asyncio.gather(*readers)
            for n in range(KEYS):
                await load.check(n)
            assert not load.stale, f"{len(load.stale)} stale reads: {load.stale[:5]}"
            assert reads_after_resume > 0, "no read was served after the old master came back"
            assert set(load.acked.values()) == {3}
            assert backend.tracker.current == new
            assert backend.tracker.history[-1].new == new, list(backend.tracker.history)
        finally:
            load.running = False
            await asyncio.gather(*readers, return_exceptions=True)
            await backend.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("direct_reads", [True, False], ids=["direct", "client"])
def test_a_reply_that_arrives_after_the_master_changed_is_not_used(
    plain_group: SentinelGroup, direct_reads: bool
) -> None:
    """A get is sent to the master, which is paused before it answers; the sentinels promote
    the replica, another client writes version 2 there, and the old master is resumed, so
    the get's reply (version 1) arrives from a server that is no longer master. The backend
    must drop it and read the new master's version 2."""
    group = plain_group

    async def scenario() -> None:
        backend = await kvplug.open_backend(group.url, timeout=30.0, direct_reads=direct_reads)
        assert isinstance(backend, RedisBackend)
        key = key_of(f"late-reply-{random.randrange(10**9)}", 7)
        first, second = version_of(7, 1), version_of(7, 2)
        try:
            await backend.put(key, first)
            got = await backend.get(key)  # warms a connection to the master
            assert got is not None
            got.release()
            with group.master.client() as client:
                assert client.execute_command("WAIT", 1, 5000) >= 1
            old = await asyncio.to_thread(group.pause_master)
            pending = asyncio.ensure_future(backend.get(key))
            await asyncio.sleep(0.3)
            assert not pending.done()
            new = await asyncio.to_thread(group.wait_for_failover, old)
            await asyncio.to_thread(group.wait_until_all_name, new)
            name = backend.key_string(key)
            header, payload = encode_frame(second, backend.serde)
            with group.server_at(new).client() as client:
                client.set(name, bytes(header) + bytes(memoryview(payload)))
            await asyncio.sleep(2 * backend.options.master_check_interval)
            group.resume_all()
            got = await asyncio.wait_for(pending, 30.0)
            assert got is not None
            try:
                assert read_version(7, got) == 2, "the deposed master's late reply was used"
            finally:
                got.release()
        finally:
            first.release()
            second.release()
            await backend.close()

    asyncio.run(scenario())


# -- the tracker's choice, from the answers sentinels give during a failover ---------------------

A, B = ("10.0.0.1", 6379), ("10.0.0.2", 6379)


@pytest.mark.parametrize(
    ("answers", "current", "epoch", "expected"),
    [
        ([Answer(A, 0), Answer(A, 0), Answer(A, 0)], None, -1, Answer(A, 0)),
        # the failover's new epoch wins over sentinels that have not heard of it yet
        ([Answer(A, 0), Answer(A, 0), Answer(B, 1)], A, 0, Answer(B, 1)),
        # a sentinel that lags behind one already followed is not followed back
        ([Answer(A, 0)], B, 1, None),
        # nor are two of three that have not heard of the failover while its leader is busy
        ([Answer(A, 0), Answer(A, 0)], B, 1, None),
        # unless every sentinel says so (they were rebuilt)
        ([Answer(A, 0), Answer(A, 0), Answer(A, 0)], B, 1, Answer(A, 0)),
        # a tie at one epoch keeps the master in use
        ([Answer(A, 2), Answer(B, 2)], B, 2, Answer(B, 2)),
        ([], A, 0, None),
    ],
)
def test_the_tracker_follows_the_newest_config_epoch(
    answers: list[Answer],
    current: tuple[str, int] | None,
    epoch: int,
    expected: Answer | None,
) -> None:
    assert choose(answers, current=current, epoch=epoch, sentinels=3) == expected


def test_a_burst_of_200_tasks_reuses_warm_connections_and_asks_the_sentinels_little(
    group: SentinelGroup,
) -> None:
    """200 tasks put and get at once: the backend opens a bounded number of connections at a
    time and reuses them (far fewer than one per task), and asks the sentinels about once per
    ``master_check_interval``, not once per new connection."""
    tasks = 200

    async def scenario() -> dict[str, Any]:
        backend = await kvplug.open_backend(group.url, timeout=30.0)
        assert isinstance(backend, RedisBackend)
        assert backend.tracker is not None and backend.direct is not None
        model = f"burst-{random.randrange(10**9)}"
        objs = [version_of(n, 1) for n in range(tasks)]

        async def task(n: int) -> bool:
            await backend.put(key_of(model, n), objs[n])
            got = await backend.get(key_of(model, n))
            if got is None:
                return False
            try:
                return read_version(n, got) == 1
            finally:
                got.release()

        try:
            asked_before = backend.tracker.questions
            started = time.monotonic()
            results = await asyncio.gather(*(task(n) for n in range(tasks)))
            return {
                "ok": sum(results),
                "seconds": round(time.monotonic() - started, 2),
                "direct_connects": backend.direct.connects,
                "connections": backend._clients.budget.connected,
                "questions": backend.tracker.questions - asked_before,
                "interval": backend.options.master_check_interval,
            }
        finally:
            for obj in objs:
                obj.release()
            await backend.close()

    outcome = asyncio.run(scenario())
    print(f"\n200 tasks at once: {outcome}")
    assert outcome["ok"] == tasks
    # kvplug's own connections carry every put and get: 400 operations here.
    assert outcome["direct_connects"] <= tasks // 3, outcome
    assert outcome["connections"] <= tasks // 4, outcome
    assert outcome["questions"] <= 5 + 2 * outcome["seconds"] / outcome["interval"], outcome


def test_a_failover_of_the_master_in_use_is_logged_with_what_the_sentinels_said(
    plain_group: SentinelGroup, caplog: pytest.LogCaptureFixture
) -> None:
    group = plain_group

    async def scenario() -> tuple[tuple[str, int], tuple[str, int], str]:
        backend = await open_backend_for_failover(group.url, timeout=DEADLINE)
        assert isinstance(backend, RedisBackend) and backend.tracker is not None
        try:
            await backend.ping()
            old = await asyncio.to_thread(group.planned_failover)
            new = await asyncio.to_thread(group.wait_for_failover, old)
            for _ in range(100):
                if backend.tracker.current == new:
                    break
                await asyncio.sleep(0.1)
            return old, new, str(backend.tracker.history[-1])
        finally:
            await backend.close()

    with caplog.at_level("WARNING", logger="kvplug.redis"):
        old, new, change = asyncio.run(scenario())
    assert change.startswith(f"{old[0]}:{old[1]} -> {new[0]}:{new[1]} (config epoch ")
    assert any(
        "the master moved" in r.getMessage() and change in r.getMessage() for r in caplog.records
    )
