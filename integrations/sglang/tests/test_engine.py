"""A real SGLang engine (``sglang.Engine`` on ``--device cpu``) serving a random-weight Llama
model with kvplug as HiCache L3, each engine a process of its own
(:mod:`kvplug_sglang.testing_engine`, with its CPU shims for what SGLang 0.5.23 lacks on a CPU
machine):

- after ``flush_cache()`` and from a new engine process, the prefix comes back from kvplug
  (SGLang's ``cached_tokens_details`` says ``storage``) and greedy outputs equal the recompute's;
- another model name is a miss, then keeps its own pages beside the first model's;
- a bad kvplug URL stops the engine's start with kvplug's message;
- SGLang's CPU gaps are still the ones the shims replace (the day SGLang closes one, the test
  says which shim to drop).

The time to first token (recompute, SGLang's own device cache, kvplug after a flush, kvplug in a
new engine) is printed as a row and kept in ``sglang-engine-ttft.json`` under pytest's
``--basetemp`` (the test's temporary directory).
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
from sglang.srt.mem_cache.storage import StorageBackendFactory

from kvplug.errors import KvplugError
from kvplug_sglang.testing_engine import (
    ENGINE_ENVIRONMENT,
    SHIMMED_SGLANG,
    EngineProcess,
    kvplug_extra_config,
)
from kvplug_testing.engine_process import EngineStartFailed
from kvplug_testing.models import build_random_llama

PAGE = 16
PROMPT_TOKENS = 2000
PROMPTS = 3
MAX_TOKENS = 8
STORED_TOKENS = PROMPT_TOKENS // PAGE * PAGE
"""The tokens of a prompt in whole pages; SGLang keeps the last one for the prefill."""
if STORED_TOKENS == PROMPT_TOKENS:
    STORED_TOKENS -= PAGE

_ENGINE_MODULES = ("uvloop", "fastapi", "uvicorn", "openai", "xgrammar", "setproctitle")
_missing = [name for name in _ENGINE_MODULES if importlib.util.find_spec(name) is None]
pytestmark = pytest.mark.slow


@pytest.fixture
def engine_requirements() -> None:
    """Fails (never skips) the engine tests when what SGLang's engine imports is missing."""
    if _missing:
        pytest.fail(
            f"SGLang's engine needs {', '.join(_missing)} here: bash scripts/setup-engines.sh "
            "installs them (integrations/sglang/requirements-cpu.txt)"
        )


needs_engine = pytest.mark.usefixtures("engine_requirements")


def engine_kwargs(url: str, *, model_name: str | None = None, **more: Any) -> dict[str, Any]:
    """``sglang.Engine`` arguments: HiCache with kvplug at ``url`` as L3, the zero-copy
    ``page_first_direct`` host layout with the ``direct`` I/O backend (what the CPU shim
    copies), a small KV cache. A request waits for its prefetch from L3 (``wait_complete``):
    under SGLang's default ``timeout`` policy a prefetch slower than about 1.5 s, as on a busy
    2-core machine, is dropped for a recompute, and the test would measure the machine."""
    kwargs: dict[str, Any] = {
        "enable_hierarchical_cache": True,
        "hicache_storage_backend": "dynamic",
        "hicache_storage_backend_extra_config": kvplug_extra_config(url, **more),
        "hicache_mem_layout": "page_first_direct",
        "hicache_io_backend": "direct",
        "hicache_storage_prefetch_policy": "wait_complete",
        "hicache_size": 1,
        "page_size": PAGE,
        "max_total_tokens": 16384,
        "mem_fraction_static": 0.4,
        "log_level": "warning",
    }
    if model_name is not None:
        kwargs["served_model_name"] = model_name
    return kwargs


@dataclass
class Served:
    """What the first engine saw, for the later ones to compare with."""

    model_dir: Path
    store: Path
    prompts: list[list[int]]
    recompute: list[dict[str, Any]]
    """Each prompt computed from nothing: the reference outputs."""
    flushed: list[dict[str, Any]]
    """Each prompt after ``flush_cache()``."""
    ttft: dict[str, list[float]] = field(default_factory=dict)


def stored_objects(store: Path) -> int:
    from kvplug_disk.layout import SUFFIX

    return sum(1 for _ in store.glob(f"*/*{SUFFIX}"))


def wait_for_objects(store: Path, count: int, timeout: float = 120.0) -> None:
    """Until ``store`` holds ``count`` objects: SGLang backs pages up to L3 on a thread of its
    own after the request has returned."""
    deadline = time.monotonic() + timeout
    while stored_objects(store) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{stored_objects(store)} of {count} objects stored in {timeout} s")
        time.sleep(0.5)


def generate(engine: EngineProcess, prompt: list[int]) -> dict[str, Any]:
    return engine.ask({"op": "generate", "prompt": prompt, "max_tokens": MAX_TOKENS})


def storage_tokens(answer: dict[str, Any]) -> int:
    details = answer["cached_details"] or {}
    assert details.get("storage_backend", "KvplugHiCacheStorage") == "KvplugHiCacheStorage"
    return int(details.get("storage", 0))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_random_llama(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Served]:
    """The first engine: every prompt computed (the reference), then SGLang's own device
    cache hit; it waits until the pages are in kvplug, then flushes the cache and reads them
    back from kvplug."""
    root = tmp_path_factory.mktemp("sglang-engine")
    store = root / "store"
    rng = random.Random(35)
    prompts = [[rng.randrange(1, 32000) for _ in range(PROMPT_TOKENS)] for _ in range(PROMPTS)]
    with EngineProcess(model_dir, engine_kwargs(f"file://{store}"), root / "a.log") as engine:
        recompute = [generate(engine, prompt) for prompt in prompts]
        local = [generate(engine, prompt) for prompt in prompts]
        wait_for_objects(store, PROMPTS * STORED_TOKENS // PAGE * 2)  # K and V per page
        assert engine.ask({"op": "flush"})["flushed"]
        flushed = [generate(engine, prompt) for prompt in prompts]
    result = Served(model_dir, store, prompts, recompute, flushed)
    result.ttft = {
        "recompute": [answer["ttft"] for answer in recompute],
        "sglang device cache": [answer["ttft"] for answer in local],
        "kvplug after flush": [answer["ttft"] for answer in flushed],
    }
    for answer in recompute:
        assert answer["cached"] == 0
        assert len(answer["tokens"]) == MAX_TOKENS
    for answer, reference in zip(local, recompute, strict=True):
        assert answer["cached_details"]["device"] == STORED_TOKENS
        assert answer["tokens"] == reference["tokens"]
    yield result
    rows = {name: statistics.median(values) for name, values in result.ttft.items()}
    print("\nSGLang engine TTFT, median of", PROMPTS, "prompts of", PROMPT_TOKENS, "tokens (s):")
    for name, seconds in rows.items():
        print(f"  {name:22s} {seconds:.3f}")
    (tmp_path_factory.getbasetemp() / "sglang-engine-ttft.json").write_text(
        json.dumps({"prompt_tokens": PROMPT_TOKENS, "ttft": result.ttft}, indent=1)
    )


@needs_engine
def test_after_a_flush_the_prefix_comes_back_from_kvplug_with_the_recomputes_outputs(
    served: Served,
) -> None:
    for answer, reference in zip(served.flushed, served.recompute, strict=True):
        assert storage_tokens(answer) == STORED_TOKENS
        assert answer["cached_details"]["device"] == 0
        assert answer["tokens"] == reference["tokens"]


@needs_engine
def test_a_new_engine_gets_the_prefix_from_kvplug_with_the_recomputes_outputs(
    served: Served, tmp_path: Path
) -> None:
    kwargs = engine_kwargs(f"file://{served.store}")
    with EngineProcess(served.model_dir, kwargs, tmp_path / "b.log") as engine:
        answers = [generate(engine, prompt) for prompt in served.prompts]
    served.ttft["kvplug new engine"] = [answer["ttft"] for answer in answers]
    for answer, reference in zip(answers, served.recompute, strict=True):
        assert storage_tokens(answer) == STORED_TOKENS
        assert answer["tokens"] == reference["tokens"]


@needs_engine
def test_another_model_name_misses_then_keeps_its_own_pages_beside(
    served: Served, tmp_path: Path
) -> None:
    before = stored_objects(served.store)
    kwargs = engine_kwargs(f"file://{served.store}", model_name="another-model")
    with EngineProcess(served.model_dir, kwargs, tmp_path / "c.log") as engine:
        missed = generate(engine, served.prompts[0])
        wait_for_objects(served.store, before + STORED_TOKENS // PAGE * 2)
        assert engine.ask({"op": "flush"})["flushed"]
        hit = generate(engine, served.prompts[0])
    assert missed["cached"] == 0
    assert storage_tokens(hit) == STORED_TOKENS
    for answer in (missed, hit):
        assert answer["tokens"] == served.recompute[0]["tokens"]


@needs_engine
def test_a_bad_kvplug_url_stops_the_engine_start_with_kvplugs_message(
    model_dir: Path, tmp_path: Path, storage_config: Callable[..., Any]
) -> None:
    extra = json.loads(kvplug_extra_config("nosuch://host/kv"))
    with pytest.raises(KvplugError) as expected:  # kvplug's own message, built as SGLang does
        StorageBackendFactory.create_backend("dynamic", storage_config(extra_config=extra), None)
    message = str(expected.value).splitlines()[0]
    log = tmp_path / "d.log"
    with pytest.raises(EngineStartFailed) as failed:
        EngineProcess(model_dir, engine_kwargs("nosuch://host/kv"), log).start()
    assert message in log.read_text(errors="replace"), failed.value


_GAPS = textwrap.dedent(
    """
    import importlib.util, json, sys
    from kvplug_sglang.testing_engine import serve_torchvision_placeholders_if_needed
    serve_torchvision_placeholders_if_needed()
    gaps = {"sgl_kernel": importlib.util.find_spec("sgl_kernel") is None}
    try:
        import sglang.srt.mem_cache.memory_pool
    except ModuleNotFoundError as error:
        gaps["import"] = str(error)
    from kvplug_sglang.testing_engine import install_cpu_shims
    try:  # installs the sgl_kernel placeholder, then checks the other two gaps
        install_cpu_shims()
        gaps["shims"] = "installed"
    except RuntimeError as error:
        gaps["shims"] = str(error)
    from sglang.srt.mem_cache.pool_host import common
    import torch
    try:  # what SGLang's own allocation does on this machine
        common.alloc_with_host_register(
            (4,), torch.bfloat16, "cpu", True, common.HostTensorAllocator()
        )
        gaps["pinned"] = "allocated"
    except Exception as error:
        gaps["pinned"] = f"{type(error).__name__}: {error}"
    print(json.dumps(gaps))
    """
)


def test_sglangs_cpu_gaps_are_still_the_ones_the_shims_replace() -> None:
    """Without kvplug's shims SGLang SHIMMED_SGLANG cannot run HiCache on a CPU device: its
    memory pool imports sgl_kernel, its host pools register memory with CUDA, and its host
    pool has no CPU copy ops (install_cpu_shims checks that last one). When SGLang closes a
    gap, this fails and names it."""
    assert version("sglang") == SHIMMED_SGLANG
    result = subprocess.run(
        [sys.executable, "-c", _GAPS],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **ENGINE_ENVIRONMENT},
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    gaps = json.loads(result.stdout.strip().splitlines()[-1])
    assert gaps["sgl_kernel"], "sgl_kernel is installed here: is its CPU build on the index now?"
    assert gaps["import"] == "No module named 'sgl_kernel'"
    assert gaps["shims"] == "installed"  # the host-register and transfer-op gaps are as written
    assert gaps["pinned"] == "AssertionError: Torch not compiled with CUDA enabled"
