"""KvplugTier against vLLM's own scheduler-side code: built by ``SecondaryTierFactory`` from a
``secondary_tiers`` entry (``"type": "kvplug"``, registered by kvplug-vllm's entry point), under
vLLM's ``TieringOffloadingManager`` with its CPU primary tier in shared memory, for ``cpu://``,
``file://`` and a real redis-server (tenants also for a real kvplug lm-server and a tiers
config); also while the store is down or paused, through cache resets with transfers in flight,
and under vLLM's back-pressure detector."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import shutil
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from vllm import SamplingParams
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    _create_req_context,
)
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_offload.base import LookupResult, Medium, ReqContext, make_offload_key
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.request import Request

import kvplug
from kvplug import MemoryFormat, MemoryObj
from kvplug.errors import ConfigError, KvplugError
from kvplug.stats import summarize
from kvplug_testing import LMServerProcess, RedisServer, free_port
from kvplug_vllm import KvplugTier
from kvplug_vllm.plugin import TIER_TYPE, register
from kvplug_vllm.testing import (
    ROW_BYTES,
    Engine,
    before_vllm,
    chunk_keys,
    offloading_config,
    payloads,
)

Start = Callable[..., Engine]


def needs_vllm(series: tuple[int, int], feature: str) -> pytest.MarkDecorator:
    """Skips a test of ``feature`` on a vLLM before ``series``, saying so."""
    reason = before_vllm(series, feature)
    return pytest.mark.skipif(reason is not None, reason=reason or "")


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (bash scripts/setup.sh installs it)")
    with RedisServer() as server:
        yield server


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A redis-server of this test's own, to stop, pause and restart."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (bash scripts/setup.sh installs it)")
    with RedisServer() as server:
        yield server


@pytest.fixture(params=["file", "redis"])
def shared_store(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    """Tier settings for a store that outlives an engine."""
    if request.param == "file":
        return {"url": f"file://{tmp_path}/kv"}
    server: RedisServer = request.getfixturevalue("redis_server")
    server.client().flushall()
    return {"url": server.url, "options": {"timeout": 5}}


@pytest.fixture(scope="module")
def lm_server() -> Iterator[LMServerProcess]:
    with LMServerProcess(["--max-memory", "256MiB"]) as server:
        yield server


@pytest.fixture(params=["cpu", "file", "redis", "lm", "store"])
def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    """Tier settings for each kind of built-in store: host memory, a directory, a real
    redis-server, a real kvplug lm-server (shared by the module's tests: each test's own
    ``model_identity`` keeps their keys apart), and a tiers config (host memory in front of a
    directory)."""
    own = {"model_identity": f"test-{uuid.uuid4().hex}"}
    if request.param == "cpu":
        return {"url": "cpu://?max_size=64MiB", **own}
    if request.param == "file":
        return {"url": f"file://{tmp_path}/kv", **own}
    if request.param == "redis":
        redis: RedisServer = request.getfixturevalue("redis_server")
        return {"url": redis.url, "options": {"timeout": 5}, **own}
    if request.param == "lm":
        lm: LMServerProcess = request.getfixturevalue("lm_server")
        return {"url": lm.url, **own}
    tiers = tmp_path / "tiers.yaml"
    tiers.write_text(f"tiers:\n  - cpu://?max_size=64MiB\n  - file://{tmp_path}/tiered\n")
    return {"config": str(tiers), **own}


def stored_then_stopped(
    start: Start, tier: dict[str, Any], keys: list[Any], data: list[bytes], **config: Any
) -> None:
    """An earlier engine with ``tier`` that stored ``data`` under ``keys`` and shut down."""
    writer = start(tier, **config)
    writer.offload(keys, data)
    writer.settle()
    writer.close()


# -- the round trip -----------------------------------------------------------------------------


def test_an_engine_restart_finds_the_cascaded_chunks_and_promotes_them_bit_exact(
    start: Start, shared_store: dict[str, Any]
) -> None:
    first = start(shared_store)
    keys = chunk_keys(6)
    data = payloads(6, ROW_BYTES)
    assert first.offload(keys, data) == keys
    first.settle()
    assert first.tier.health().counters.writes == 6
    first.close()

    second = start(shared_store)  # an empty primary tier
    unknown = chunk_keys(2, seed=99)
    assert second.fetch([*keys, *unknown]) == [*data, None, None]
    health = second.tier.health()
    assert health.counters.hits == 6 and health.healthy


def test_health_counters_are_the_stores_own(start: Start, shared_store: dict[str, Any]) -> None:
    keys = chunk_keys(4)
    data = payloads(4, ROW_BYTES)
    stored_then_stopped(start, shared_store, keys[:3], data[:3])
    second = start(shared_store)
    assert second.fetch(keys) == [*data[:3], None]  # the fourth: a lookup miss, never loaded
    counters = second.tier.health().counters
    assert counters == summarize(second.tier._client.backend.operation_stats())
    assert (counters.reads, counters.hits, counters.misses) == (3, 3, 0)
    assert (counters.bytes_read, counters.writes, counters.errors) == (3 * ROW_BYTES, 0, 0)
    assert counters.lookups >= 4 and counters.lookup_hits >= 3


def test_a_lookup_answers_retry_then_the_promotion_is_pending_then_a_hit(
    start: Start, tmp_path: Path
) -> None:
    store = {"url": f"file://{tmp_path}/kv"}
    keys = chunk_keys(2)
    data = payloads(2, ROW_BYTES)
    stored_then_stopped(start, store, keys, data)

    second = start(store)
    manager = second.manager
    context = second.request()
    seen: list[LookupResult] = []
    deadline = time.monotonic() + 30
    while not seen or seen[-1] is not LookupResult.HIT:
        assert time.monotonic() < deadline, f"no HIT after {seen}"
        with second.locked():
            answer = manager.lookup(keys[0], context)
        if not seen or seen[-1] is not answer:
            seen.append(answer)
        second.step()
        time.sleep(0.005)
    assert seen == [LookupResult.RETRY, LookupResult.HIT_PENDING, LookupResult.HIT]
    second.finish(context)
    assert second.read(keys[:1]) == data[:1]


@pytest.mark.parametrize("url", ["cpu://?max_size=64MiB", "file"])
def test_chunks_the_primary_tier_evicted_come_back_from_kvplug(
    start: Start, tmp_path: Path, url: str
) -> None:
    engine = start({"url": f"file://{tmp_path}/kv" if url == "file" else url}, chunks=4)
    keys = chunk_keys(12)
    data = payloads(12, ROW_BYTES)
    for i in range(0, 12, 4):  # three requests; the primary tier keeps four chunks
        engine.offload(keys[i : i + 4], data[i : i + 4])
        engine.settle()
    assert engine.fetch(keys[:4]) == data[:4]
    assert engine.tier.health().counters.hits == 4
    expected = Medium.CPU if url.startswith("cpu") else Medium.STORAGE
    assert engine.tier.medium is expected


def test_a_chunk_already_stored_is_not_written_again(start: Start, tmp_path: Path) -> None:
    store = {"url": f"file://{tmp_path}/kv"}
    keys = chunk_keys(3)
    data = payloads(3, ROW_BYTES)
    stored_then_stopped(start, store, keys[:2], data[:2])
    second = start(store)
    second.offload(keys, data)
    second.settle()
    health = second.tier.health()
    assert (health.counters.writes, health.chunks_skipped) == (1, 2)


def test_a_load_that_misses_some_chunks_keeps_the_others_and_recomputes_the_rest(
    start: Start, redis_server: RedisServer
) -> None:
    redis_server.client().flushall()
    store = {"url": redis_server.url}
    keys = chunk_keys(3)
    data = payloads(3, ROW_BYTES)
    stored_then_stopped(start, store, keys, data)

    second = start(store)
    manager = second.manager
    context = second.request()
    deadline = time.monotonic() + 30
    while True:  # until the tier has answered HIT and the promotions are queued
        with second.locked():
            answers = [manager.lookup(key, context) for key in keys]
        if all(answer is LookupResult.HIT_PENDING for answer in answers):
            break
        assert time.monotonic() < deadline, answers
        second.step()
        time.sleep(0.005)
    victim = second.tier._keys([keys[1]], "")[0]
    assert redis_server.client().delete(second.tier._client.backend.key_string(victim)) == 1
    second.settle()  # submits the load; one of its chunks is gone
    second.finish(context)
    assert second.lookup(keys) == ["HIT", "MISS", "HIT"]
    assert second.read([keys[0], keys[2]]) == [data[0], data[2]]
    counters = second.tier.health().counters
    assert (counters.hits, counters.misses) == (2, 1)


# -- what is in a key ---------------------------------------------------------------------------


def test_other_weights_dtypes_or_layouts_are_misses_never_their_bytes(
    start: Start, tmp_path: Path
) -> None:
    url = f"file://{tmp_path}/kv"
    keys = chunk_keys(2)
    data = payloads(2, ROW_BYTES)
    stored_then_stopped(start, {"url": url, "model_identity": "checkpoint-1"}, keys, data)

    for tier, config in [
        ({"model_identity": "checkpoint-2"}, {}),
        ({"model_identity": "checkpoint-1"}, {"dtype": "float16"}),
        ({"model_identity": "checkpoint-1"}, {"model": "kvplug-test/other"}),
        ({"model_identity": "checkpoint-1"}, {"layers": ("model.layers.0.attn",)}),
        ({"model_identity": "checkpoint-1"}, {"tp_size": 2}),
    ]:
        reader = start({"url": url, **tier}, **config)
        assert reader.lookup(keys) == ["MISS", "MISS"], (tier, config)
        reader.close()
    same = start({"url": url, "model_identity": "checkpoint-1"})
    assert same.fetch(keys) == data


def test_a_stored_row_of_another_size_fails_the_load_loudly_naming_both_sizes(
    start: Start, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A value under the reader's own key whose size is not its row's (written by a build with
    another layout under the same key): the load fails, counted and logged with kvplug's
    LayoutMismatch, instead of turning into a silent miss."""
    url = f"file://{tmp_path}/kv"
    keys = chunk_keys(1)
    stored_then_stopped(start, {"url": url}, keys, payloads(1, ROW_BYTES))
    asyncio.run(_replace_every_value_with_half_of_it(url))
    reader = start({"url": url})
    with caplog.at_level(logging.WARNING):
        assert reader.lookup(keys) == ["MISS"]
    health = reader.tier.health()
    assert health.failed_loads == 1, health
    assert (health.counters.errors, health.counters.misses) == (1, 0), health  # one failed call
    error = health.last_error or ""
    assert error.startswith("LayoutMismatch: ") and f"({ROW_BYTES} bytes)" in error, error
    assert f"({ROW_BYTES // 2} bytes)" in error, error
    assert any("LayoutMismatch" in record.getMessage() for record in caplog.records)


async def _replace_every_value_with_half_of_it(url: str) -> None:
    backend = await kvplug.open_backend(url)
    try:
        for key in [key async for key in backend.list_keys()]:
            half = torch.zeros(ROW_BYTES // 2, dtype=torch.uint8)
            await backend.put(key, MemoryObj.from_tensor(half, MemoryFormat.BINARY))
    finally:
        await backend.close()


def test_parallelism_agnostic_rows_are_shared_across_tp_sizes(start: Start, tmp_path: Path) -> None:
    url = f"file://{tmp_path}/kv"
    keys = chunk_keys(2)
    data = payloads(2, ROW_BYTES)
    stored_then_stopped(start, {"url": url}, keys, data, tp_size=1, agnostic=True)
    reader = start({"url": url}, tp_size=2, agnostic=True)
    assert reader.fetch(keys) == data


def test_a_retrained_local_checkpoint_is_a_new_key_space(start: Start, tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights-v1")
    url = f"file://{tmp_path}/kv"
    keys = chunk_keys(1)
    data = payloads(1, ROW_BYTES)
    stored_then_stopped(start, {"url": url}, keys, data, model=str(model))
    assert start({"url": url}, model=str(model)).fetch(keys) == data
    (model / "model.safetensors").write_bytes(b"weights-v2, retrained")
    assert start({"url": url}, model=str(model)).lookup(keys) == ["MISS"]


# -- tenants ------------------------------------------------------------------------------------

TEAM_A = {"kvplug_tenant": "team-a"}
TEAM_B = {"kvplug_tenant": "team b/2"}  # percent-encoded in the key


def stored_tenants(engine: Engine) -> Counter[str]:
    """How many chunks of ``engine``'s key space its store holds, by tenant ("": none), read
    from the keys the store lists."""
    tier = engine.tier
    backend = tier._client.backend

    async def tenants() -> Counter[str]:
        return Counter(
            [key.tenant async for key in backend.list_keys() if tier._namespace.owns(key)]
        )

    return tier._client.run(tenants()).result(30)


def test_the_same_chunks_under_two_tenants_never_hit_each_other(
    start: Start, any_store: dict[str, Any]
) -> None:
    """The same OffloadKeys (what requests of two tenants with the same tokens and no
    cache_salt share) stored by tenant A: B's and untagged lookups miss, B stores its own bytes
    beside A's, and each tenant reads back its own."""
    engine = start(any_store)
    keys = chunk_keys(3)
    mine, yours = payloads(3, ROW_BYTES, seed=1), payloads(3, ROW_BYTES, seed=2)
    engine.offload(keys, mine, params=TEAM_A)
    engine.settle()
    engine.reset()  # the primary tier forgets: every lookup below asks kvplug
    assert engine.lookup(keys, params=TEAM_B) == ["MISS"] * 3
    assert engine.lookup(keys) == ["MISS"] * 3
    engine.offload(keys, yours, params=TEAM_B)
    engine.settle()
    assert engine.tier.health().chunks_skipped == 0  # B's own chunks, stored beside A's
    assert stored_tenants(engine) == {"team-a": 3, "team b/2": 3}

    engine.reset()
    assert engine.fetch(keys, params=TEAM_A) == mine
    engine.reset()
    assert engine.fetch(keys, params=TEAM_B) == yours
    assert engine.tier.health().counters.hits == 6


@pytest.mark.parametrize("server", ["redis", "lm"])
def test_tiers_of_two_tenants_on_one_server_never_read_each_others_chunks(
    start: Start, request: pytest.FixtureRequest, server: str
) -> None:
    """Two clients (two engines, each with its tier's ``tenant``) on one Redis or lm:// server:
    B misses what A stored and stores its own; another engine of tenant A reads A's."""
    running: RedisServer | LMServerProcess = request.getfixturevalue(f"{server}_server")
    store = {"url": running.url, "model_identity": f"test-{uuid.uuid4().hex}"}
    team_a = start({**store, "tenant": "team-a"})
    team_b = start({**store, "tenant": "team-b"})
    keys = chunk_keys(3)
    mine, yours = payloads(3, ROW_BYTES, seed=3), payloads(3, ROW_BYTES, seed=4)
    team_a.offload(keys, mine)
    team_a.settle()
    assert team_b.lookup(keys) == ["MISS"] * 3
    team_b.offload(keys, yours)
    team_b.settle()
    assert team_b.tier.health().counters.writes == 3
    assert stored_tenants(team_b) == {"team-a": 3, "team-b": 3}

    assert start({**store, "tenant": "team-a"}).fetch(keys) == mine
    assert start({**store, "tenant": "team-b"}).fetch(keys) == yours
    assert start(store).lookup(keys) == ["MISS"] * 3  # an engine of no tenant


def test_vllm_salts_block_hashes_and_passes_the_tenant_only_in_kv_transfer_params(
    start: Start, tmp_path: Path
) -> None:
    """What vLLM's own code gives the tier: a Request's ``cache_salt`` is folded into its
    block hashes (vLLM's request block hasher), and the connector scheduler's ReqContext
    (``_create_req_context``) carries ``kv_transfer_params``, not the salt. The chunks of a
    request naming its tenant there are stored under that tenant."""
    init_none_hash(sha256_cbor)
    hasher = get_request_block_hasher(16, sha256_cbor)

    def vllm_request(tenant: str) -> Request:
        params = SamplingParams(
            max_tokens=1, extra_args={"kv_transfer_params": {"kvplug_tenant": tenant}}
        )
        return Request(
            f"request-{tenant}",
            list(range(64)),
            params,
            None,
            cache_salt=tenant,
            block_hasher=hasher,
        )

    a, b = vllm_request("team-a"), vllm_request("team-b")
    assert len(a.block_hashes) == 4 and not set(a.block_hashes) & set(b.block_hashes)
    context = _create_req_context(a)
    assert "cache_salt" not in {field.name for field in dataclasses.fields(context)}
    assert context.kv_transfer_params == TEAM_A

    engine = start({"url": f"file://{tmp_path}/kv"})
    keys = [make_offload_key(block_hash, 0) for block_hash in a.block_hashes]
    data = payloads(4, ROW_BYTES)
    engine.offload(keys, data, params=context.kv_transfer_params)
    engine.settle()
    assert stored_tenants(engine) == {"team-a": 4}
    engine.reset()
    assert engine.lookup(keys, params=_create_req_context(b).kv_transfer_params) == ["MISS"] * 4
    assert engine.fetch(keys, params=TEAM_A) == data


@pytest.mark.parametrize(
    ("tier_tenant", "params", "words"),
    [
        (None, {"kvplug_tenant": 7}, "got 7"),
        (None, {"kvplug_tenant": "x" * 129}, "has 129 characters"),
        (None, {"kvplug_tenant": ""}, "non-empty string"),
        (None, {"kvplug_tenant": "a\x00b"}, "NUL"),
        ("team-a", {"kvplug_tenant": "team-b"}, "serves tenant 'team-a' only"),
    ],
    ids=["not-a-string", "too-long", "empty", "nul", "another-tenant"],
)
def test_a_request_naming_no_valid_tenant_is_served_without_the_tier(
    start: Start,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    tier_tenant: str | None,
    params: dict[str, Any],
    words: str,
) -> None:
    """It never falls back to another tenant's keys nor to keys without a tenant: its lookups
    miss without asking the store and its stores finish failed, while the tier stays healthy
    and serves every other request."""
    tier: dict[str, Any] = {"url": f"file://{tmp_path}/kv"}
    if tier_tenant is not None:
        tier["tenant"] = tier_tenant
    engine = start(tier)
    keys = chunk_keys(2)
    data = payloads(2, ROW_BYTES)
    engine.offload(keys, data)  # a request naming no tenant: the tier's own, or none
    engine.settle()
    engine.reset()
    asked = engine.tier.health().counters.lookups
    with caplog.at_level(logging.WARNING, logger="kvplug.vllm"):
        assert engine.lookup(keys, params=params) == ["MISS", "MISS"]
        engine.offload(chunk_keys(2, seed=5), data, params=params)
        engine.settle()
    health = engine.tier.health()
    assert health.refused_requests == 2 and health.healthy, health
    assert (health.counters.lookups, health.counters.writes) == (asked, 2), health
    assert health.failed_stores == 0, health
    assert "served without this tier" in caplog.text and words in caplog.text, caplog.text
    assert engine.fetch(keys) == data
    expected = tier_tenant or ""
    assert stored_tenants(engine) == {expected: 2}


# -- failures -----------------------------------------------------------------------------------


def test_a_store_that_goes_down_gives_misses_and_failed_jobs_then_recovers(
    start: Start, own_redis: RedisServer
) -> None:
    store = {"url": own_redis.url, "options": {"timeout": 1}, "lookup_timeout": 2}
    keys = chunk_keys(4)
    data = payloads(4, ROW_BYTES)
    engine = start(store, chunks=2)
    engine.offload(keys[:2], data[:2])
    engine.settle()
    own_redis.stop()
    engine.offload(keys[2:], data[2:])  # evicts the first two from the primary tier
    engine.settle()
    assert engine.lookup(keys[:2]) == ["MISS", "MISS"]
    health = engine.tier.health()
    assert not health.healthy and health.failed_stores >= 1 and health.failed_lookups >= 1
    assert "Connection refused" in (health.last_error or "") or health.last_error

    own_redis.start()  # the same port, an empty server: what was stored is gone
    more = chunk_keys(2, seed=7)
    engine.offload(more, data[:2])
    engine.settle()
    assert engine.tier.health().healthy
    restarted = start(store)
    assert restarted.fetch(more) == data[:2]


def test_a_paused_store_fails_jobs_within_the_task_timeout(
    start: Start, own_redis: RedisServer
) -> None:
    store = {
        "url": own_redis.url,
        "options": {"timeout": 30},
        "task_timeout": 1,
        "lookup_timeout": 1,
    }
    engine = start(store)
    keys = chunk_keys(2)
    data = payloads(2, ROW_BYTES)
    own_redis.pause()
    try:
        started = time.monotonic()
        engine.offload(keys, data)
        engine.settle(timeout=30)
        assert engine.lookup(chunk_keys(1, seed=5)) == ["MISS"]
        assert time.monotonic() - started < 20
    finally:
        own_redis.resume()
    health = engine.tier.health()
    assert health.failed_stores == 1 and health.jobs_in_flight == 0


def test_a_cache_reset_waits_for_transfers_in_flight(start: Start, own_redis: RedisServer) -> None:
    engine = start({"url": own_redis.url, "options": {"timeout": 30}, "task_timeout": 2})
    keys = chunk_keys(4)
    own_redis.pause()
    try:
        engine.offload(keys, payloads(4, ROW_BYTES))
        assert engine.tier.health().jobs_in_flight == 1
        started = time.monotonic()
        engine.reset()  # vLLM's reset_cache asserts every job has finished
        assert time.monotonic() - started >= 1
    finally:
        own_redis.resume()
    assert engine.tier.health().jobs_in_flight == 0


@pytest.mark.parametrize("on_reset", ["forget", "keep", None], ids=["forget", "keep", "default"])
def test_what_was_stored_before_a_cache_reset_is_kept_unless_told_to_forget(
    start: Start, tmp_path: Path, on_reset: str | None
) -> None:
    """vLLM's secondary tiers keep their data through sleep, weight updates and resume (its
    reset_cache drains them and resets only the primary tier): so does kvplug's by default."""
    setting = {} if on_reset is None else {"on_reset": on_reset}
    engine = start({"url": f"file://{tmp_path}/kv", **setting})
    keys = chunk_keys(3)
    data = payloads(3, ROW_BYTES)
    engine.offload(keys, data)
    engine.settle()
    engine.reset()
    if on_reset == "forget":
        assert engine.lookup(keys) == ["MISS"] * 3
        engine.offload(keys[:1], data[:1])  # stored again, in the new epoch
        engine.settle()
        engine.reset()
        assert engine.lookup(keys[:1]) == ["MISS"]
    else:
        assert engine.fetch(keys) == data  # promoted from kvplug: the primary tier was reset
        assert engine.tier.health().counters.hits == 3
        engine.reset()
        assert engine.fetch(keys) == data


def test_stores_beyond_max_queued_chunks_are_refused_at_once_as_failed_jobs(
    start: Start, own_redis: RedisServer
) -> None:
    engine = start(
        {
            "url": own_redis.url,
            "options": {"timeout": 30},
            "task_timeout": 3,
            "max_queued_chunks": 2,
        },
        chunks=16,
    )
    own_redis.pause()
    try:
        for seed in range(3):
            engine.offload(chunk_keys(2, seed=seed), payloads(2, ROW_BYTES, seed=seed))
        health = engine.tier.health()
        assert health.refused_stores == 2 and health.jobs_in_flight == 1
    finally:
        own_redis.resume()
    engine.settle()
    stored = engine.tier.health().counters.writes
    engine.offload(chunk_keys(2, seed=9), payloads(2, ROW_BYTES, seed=9))  # accepted again
    engine.settle()
    health = engine.tier.health()
    assert (health.refused_stores, health.counters.writes) == (2, stored + 2)


@needs_vllm(
    (0, 33),
    "failed stores reaching the back-pressure detector (EMABackpressureDetector's "
    "failure_threshold, BackpressureDetector.on_store_failed)",
)
def test_refused_stores_trip_vllms_backpressure_detector(
    start: Start, own_redis: RedisServer
) -> None:
    detector = {"backpressure_cls": "EMABackpressureDetector", "failure_threshold": 2}
    engine = start(
        {
            "url": own_redis.url,
            "options": {"timeout": 30},
            "task_timeout": 3,
            "max_queued_chunks": 2,
            "backpressure": detector,
        },
        chunks=16,
    )
    assert engine.tier.bp_detector is not None
    own_redis.pause()
    try:
        for seed in range(3):
            engine.offload(chunk_keys(2, seed=seed), payloads(2, ROW_BYTES, seed=seed))
        engine.step()  # the manager takes finished jobs once per step
        engine.step()
        health = engine.tier.health()
        assert health.refused_stores == 2 and health.jobs_in_flight == 1
        assert engine.tier.bp_detector.is_under_pressure()
    finally:
        own_redis.resume()
    engine.settle()


def test_drain_jobs_returns_only_when_no_copy_touches_the_primary_tier(
    start: Start, tmp_path: Path
) -> None:
    engine = start({"url": f"file://{tmp_path}/kv", "max_queued_chunks": 16}, chunks=16)
    tier = engine.tier
    keys = chunk_keys(16)
    data = payloads(16, ROW_BYTES)
    context = ReqContext(req_id="direct")
    for job_id, at in enumerate(range(0, 16, 4)):
        for row, chunk in enumerate(data[at : at + 4], start=at):
            engine.rows[row] = np.frombuffer(chunk, dtype=np.int8)
        tier.submit_store(
            TransferJob(job_id, keys[at : at + 4], list(range(at, at + 4)), False, context)
        )
    tier.drain_jobs()
    assert tier.health().jobs_in_flight == 0
    assert all(result.success for result in tier.get_finished_jobs())
    assert tier.health().counters.writes == 16
    restarted = start({"url": f"file://{tmp_path}/kv"})
    assert restarted.fetch(keys[:4]) == data[:4]


# -- configuration ------------------------------------------------------------------------------


def spec_manager(tier: dict[str, Any]) -> Any:
    return OffloadingSpecFactory.create_spec(
        offloading_config([{"type": "kvplug", **tier}])
    ).get_manager()


@pytest.mark.parametrize(
    ("tier", "words"),
    [
        ({"url": "cpu://", "on_rest": "keep"}, ["'on_rest'", "did you mean 'on_reset'"]),
        ({"url": "cpu://", "config": "/x.yaml"}, ["both url and config"]),
        ({}, ["neither url nor config"]),
        ({"url": "cpu://", "on_reset": "drop"}, ["on_reset must be one of"]),
        ({"url": "cpu://", "task_timeout": 0}, ["task_timeout must be a positive"]),
        ({"url": "cpu://", "max_queued_chunks": 0}, ["max_queued_chunks"]),
        ({"url": "cpu://", "locality": "far"}, ["locality must be one of"]),
        ({"url": "cpu://", "model_identity": ""}, ["model_identity"]),
        ({"url": "cpu://", "tenant": 5}, ["KvplugTier: tenant is refused", "got 5"]),
        ({"url": "cpu://", "tenant": "t" * 129}, ["tenant is refused", "has 129 characters"]),
        ({"url": "cpu://", "tenant": ""}, ["tenant is refused", "non-empty string"]),
        ({"url": "cpu://", "tenant": "a\x00"}, ["tenant is refused", "NUL"]),
    ],
)
def test_a_bad_tier_config_names_the_key_and_the_fix(
    tier: dict[str, Any], words: list[str]
) -> None:
    with pytest.raises(ConfigError) as raised:
        spec_manager(tier)
    for word in words:
        assert word in str(raised.value)


def test_an_unreachable_store_fails_the_start_unless_told_otherwise(
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = f"redis://:hunter2-secret@127.0.0.1:{free_port()}"
    with pytest.raises(KvplugError) as raised:
        spec_manager({"url": url, "options": {"timeout": 1}})
    assert "did not answer at start" in str(raised.value)
    assert "hunter2" not in str(raised.value)
    with caplog.at_level(logging.DEBUG):
        manager = spec_manager({"url": url, "options": {"timeout": 1}, "check_on_start": False})
        try:
            (tier,) = manager.secondary_tiers
            assert list(tier._lookups.batch_lookup(chunk_keys(1), ReqContext("x"))) == [False]
        finally:
            manager.shutdown()
    assert "KvplugTier on redis://" in caplog.text
    assert "hunter2" not in caplog.text


def test_the_module_path_form_loads_the_same_tier(tmp_path: Path) -> None:
    manager = OffloadingSpecFactory.create_spec(
        offloading_config(
            [{"type": "KvplugTier", "module_path": "kvplug_vllm.tier", "url": f"file://{tmp_path}"}]
        )
    ).get_manager()
    try:
        assert isinstance(manager.secondary_tiers[0], KvplugTier)
    finally:
        manager.shutdown()


def test_the_plugin_registers_once_and_never_replaces_another_packages_kvplug(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = SecondaryTierFactory._registry
    assert SecondaryTierFactory.get_tier_class({"type": TIER_TYPE}) is KvplugTier
    register()  # vLLM may load general plugins more than once in a process
    assert SecondaryTierFactory.get_tier_class({"type": TIER_TYPE}) is KvplugTier
    ours = registry.pop(TIER_TYPE)
    try:
        SecondaryTierFactory.register_tier(
            TIER_TYPE, "vllm.v1.kv_offload.tiering.fs.manager", "FileSystemTierManager"
        )
        with caplog.at_level(logging.WARNING, logger="kvplug.vllm"):
            register()
        assert (
            SecondaryTierFactory.get_tier_class({"type": TIER_TYPE}).__name__
            == "FileSystemTierManager"
        )
        assert "already registered" in caplog.text
    finally:
        registry[TIER_TYPE] = ours


def test_kv_events_name_the_chunks_stored_when_vllm_publishes_events(
    engines: list[Engine], tmp_path: Path
) -> None:
    config = offloading_config(
        [{"type": "kvplug", "url": f"file://{tmp_path}", "enable_kv_events": True}]
    )
    config = type(config)(**{**config.__dict__, "enable_kv_cache_events": True})
    engine = Engine(config)
    engines.append(engine)
    keys = chunk_keys(2)
    engine.offload(keys, payloads(2, ROW_BYTES))
    engine.settle()
    stored = [event for event in engine.tier.take_events()]
    assert [event.keys for event in stored] == [keys]
    assert not stored[0].removed and stored[0].medium is Medium.STORAGE
    assert list(engine.tier.take_events()) == []


def test_a_job_kvplug_cannot_run_finishes_failed_and_is_counted(
    start: Start, tmp_path: Path
) -> None:
    engine = start({"url": f"file://{tmp_path}/kv"})
    tier = engine.tier
    context = ReqContext(req_id="bad")
    not_a_key = b"\x01\x02"  # shorter than a group index: no OffloadKey vLLM makes
    tier.submit_store(TransferJob(1, [not_a_key], [0], False, context))
    tier.submit_load(TransferJob(2, [not_a_key], [1], True, context))
    tier.drain_jobs()
    results = {result.job_id: result.success for result in tier.get_finished_jobs()}
    assert results == {1: False, 2: False}
    health = tier.health()
    assert (health.failed_stores, health.failed_loads, health.jobs_in_flight) == (1, 1, 0)
    assert "OffloadKey" in (health.last_error or "")


def _interval_becomes(expected: float, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if abs(sys.getswitchinterval() - expected) <= expected * 0.05:
            return True
        time.sleep(0.01)
    return False


@pytest.mark.parametrize("interval", [0.001, None], ids=["lowered", "left-alone"])
def test_the_switch_interval_is_lowered_only_while_a_lookup_is_in_flight(
    start: Start, own_redis: RedisServer, interval: float | None
) -> None:
    before = sys.getswitchinterval()
    engine = start({"url": own_redis.url, "lookup_timeout": 30, "gil_switch_interval": interval})
    own_redis.pause()
    try:
        context = engine.request()
        with engine.locked():
            assert engine.manager.lookup(chunk_keys(1)[0], context) is LookupResult.RETRY
        engine.step()  # the lookup thread asks the paused store
        if interval is None:
            time.sleep(1)
            assert sys.getswitchinterval() == before
        else:
            assert _interval_becomes(interval), sys.getswitchinterval()
    finally:
        own_redis.resume()
    assert _interval_becomes(before), sys.getswitchinterval()
    engine.finish(context)


def test_the_switch_interval_is_restored_after_promotions_and_failed_loads(
    start: Start, tmp_path: Path
) -> None:
    before = sys.getswitchinterval()
    store = {"url": f"file://{tmp_path}/kv"}
    keys = chunk_keys(4)
    data = payloads(4, ROW_BYTES)
    stored_then_stopped(start, store, keys, data)
    engine = start(store)
    shutil.rmtree(tmp_path / "kv")  # every load now misses: failed jobs
    assert engine.fetch(keys[:2]) == [None, None]
    stored_then_stopped(start, store, keys, data)
    assert start(store).fetch(keys) == data
    assert sys.getswitchinterval() == before


@pytest.mark.parametrize("value", [0, -1, "fast", True])
def test_a_bad_gil_switch_interval_names_the_key(value: object) -> None:
    with pytest.raises(ConfigError, match="gil_switch_interval"):
        spec_manager({"url": "cpu://", "gil_switch_interval": value})
