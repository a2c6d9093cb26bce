"""Test and benchmark support, not for serving: a real vLLM engine in a process of its own,
driven by JSON lines, for kvplug-vllm's real-engine tests, ``benchmarks/bench_vllm_engine.py``
and kvplug-lmcache's engine test.

``python -m kvplug_vllm.testing_engine MODEL_DIR CONFIG_JSON`` starts ``vllm.LLM`` on
``MODEL_DIR`` (see :func:`kvplug_testing.models.build_random_llama`) with ``CONFIG_JSON`` as its
``kv_transfer_config`` (a JSON object, or ``null`` for none), on vLLM's CPU build with kvplug's
CPU worker (:mod:`kvplug_vllm.testing_cpu_worker`) where no GPU is present. It speaks
:mod:`kvplug_testing.engine_process`'s protocol (a ready line, then one JSON answer a command
read from stdin, ``{"error": ..., "type": ...}`` for a failed one), with these ops:

- ``{"op": "generate", "prompts": [[token ids], ...], "max_tokens": 16}``: each prompt alone,
  greedy; per prompt ``tokens`` (the output ids), ``cached`` (``num_cached_tokens``) and
  ``seconds`` (wall time of the call; with ``max_tokens`` 1, the time to first token).
  Optionally ``"cache_salt": "..."`` (vLLM's per-request salt, in each prompt) and
  ``"kv_transfer_params": {...}`` (each request's, e.g. ``{"kvplug_tenant": "..."}``), as an
  OpenAI request to ``vllm serve`` gives them.
- ``{"op": "reset"}``: ``reset_prefix_cache(reset_connector=True)``; with ``"connector":
  false``, vLLM's own prefix cache only (``reset_prefix_cache()``).
- ``{"op": "tiers"}``: ``{"tiers": [{"type": ..., "health": {...}}, ...]}``, each secondary
  tier, with kvplug's :class:`~kvplug_vllm.tier.KvplugTierHealth` for a kvplug tier.
- ``{"op": "settle", "timeout": 60}``: steps the engine until no tier has a job in flight.
- ``{"op": "exit"}``.

Its environment chooses (each variable read at start, this driver's default first):

- ``VLLM_ENABLE_V1_MULTIPROCESSING``: ``0``, vLLM's engine core in this process, so that
  ``tiers`` and ``settle`` can read it; ``1``, in a process of its own (what LMCache's
  connectors need on vLLM 0.32's CPU build), where those two ops answer an error.
- ``KVPLUG_VLLM_CPU_WORKER`` (:data:`~kvplug_vllm.testing_cpu_worker.ENABLE_VARIABLE`): ``1``,
  kvplug's CPU worker for the offloading connector; ``0``, none (another connector).

:class:`EngineProcess` runs one from Python.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

from kvplug_testing import engine_process
from kvplug_testing.engine_process import Answer, Command, Handler, module_argv, serve
from kvplug_vllm.testing_cpu_worker import ENABLE_VARIABLE


def offloading_config(
    secondary_tiers: list[dict[str, Any]], *, cpu_bytes: int = 256 * 1024 * 1024
) -> dict[str, Any]:
    """A ``kv_transfer_config`` of vLLM's offloading connector with its tiering spec: a CPU
    primary tier of ``cpu_bytes`` and ``secondary_tiers``."""
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": cpu_bytes,
            "secondary_tiers": secondary_tiers,
        },
    }


def _engine_core(llm: Any) -> Any:
    """vLLM's engine core, which ``tiers`` and ``settle`` read: only an in-process one."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is None:
        raise RuntimeError(
            "the ops 'tiers' and 'settle' read vLLM's engine core, which runs in a process of "
            "its own here (VLLM_ENABLE_V1_MULTIPROCESSING=1): start the engine without that "
            "variable (the driver then sets 0) to use them"
        )
    return core


def _secondary_tiers(llm: Any) -> list[Any]:
    """The secondary tiers of ``llm``'s offloading connector (engine core in this process)."""
    connector = _engine_core(llm).scheduler.connector
    if connector is None:
        return []
    manager = connector.connector_scheduler.manager
    return list(getattr(manager, "secondary_tiers", []))


def _health(tier: Any) -> dict[str, Any] | None:
    health = getattr(tier, "health", None)
    return dataclasses.asdict(health()) if callable(health) else None


def _generate(llm: Any, command: Command) -> Answer:
    from vllm import SamplingParams, TokensPrompt

    transfer = command.get("kv_transfer_params")
    params = SamplingParams(
        temperature=0.0,
        max_tokens=int(command.get("max_tokens", 16)),
        ignore_eos=True,
        extra_args=None if transfer is None else {"kv_transfer_params": dict(transfer)},
    )
    salt = command.get("cache_salt")
    results = []
    for prompt in command["prompts"]:
        inputs = TokensPrompt(prompt_token_ids=list(prompt))
        if salt is not None:
            inputs["cache_salt"] = str(salt)
        started = time.perf_counter()
        (output,) = llm.generate([inputs], params, use_tqdm=False)
        seconds = time.perf_counter() - started
        results.append(
            {
                "tokens": list(output.outputs[0].token_ids),
                "cached": int(output.num_cached_tokens or 0),
                "seconds": seconds,
            }
        )
    return {"results": results}


def _settle(llm: Any, command: Command) -> Answer:
    deadline = time.monotonic() + float(command.get("timeout", 60))
    tiers = _secondary_tiers(llm)
    while any(tier.has_pending_work() for tier in tiers):
        if time.monotonic() > deadline:
            raise TimeoutError("tier jobs still in flight")
        llm.llm_engine.step()
        time.sleep(0.01)
    return {"ok": True}


@contextlib.contextmanager
def _engine(model: str, kv_transfer_config: dict[str, Any] | None) -> Iterator[dict[str, Handler]]:
    from vllm import LLM

    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        gpu_memory_utilization=0.1,
        max_model_len=4096,
        enforce_eager=True,
        seed=0,
        kv_transfer_config=kv_transfer_config,
    )
    try:
        yield {
            "generate": lambda command: _generate(llm, command),
            "reset": lambda command: {
                "reset": bool(
                    llm.reset_prefix_cache(reset_connector=bool(command.get("connector", True)))
                )
            },
            "tiers": lambda command: {
                "tiers": [
                    {"type": type(tier).__name__, "health": _health(tier)}
                    for tier in _secondary_tiers(llm)
                ]
            },
            "settle": lambda command: _settle(llm, command),
        }
    finally:
        llm.llm_engine.engine_core.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    model, config_json = args
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault(ENABLE_VARIABLE, "1")
    return serve(lambda: _engine(model, json.loads(config_json)))


class EngineProcess(engine_process.EngineProcess):
    """``python -m kvplug_vllm.testing_engine`` as a child process
    (:class:`kvplug_testing.engine_process.EngineProcess`), with ops of its own:
    :meth:`generate` and :meth:`kvplug_health`.

    Example::

        config = offloading_config([{"type": "kvplug", "url": url}])
        with EngineProcess(model_dir, config, log=tmp_path / "engine.log") as engine:
            (first,) = engine.generate([prompt], max_tokens=1)
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        kv_transfer_config: dict[str, Any] | None,
        *,
        log: str | os.PathLike[str],
        env: dict[str, str] | None = None,
    ) -> None:
        argv = module_argv("kvplug_vllm.testing_engine", model_dir, json.dumps(kv_transfer_config))
        super().__init__(argv, log=log, env=env)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens: int = 16,
        *,
        cache_salt: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> list[dict[str, Any]]:
        """Each prompt alone, greedy, with vLLM's ``cache_salt`` and ``kv_transfer_params``
        when given: its output ids, cached tokens and seconds."""
        command: dict[str, Any] = {
            "op": "generate",
            "prompts": [list(p) for p in prompts],
            "max_tokens": max_tokens,
        }
        if cache_salt is not None:
            command["cache_salt"] = cache_salt
        if kv_transfer_params is not None:
            command["kv_transfer_params"] = kv_transfer_params
        return list(self.ask(command)["results"])

    def kvplug_health(self) -> dict[str, Any]:
        """The health and counters of the engine's one kvplug tier."""
        (tier,) = [t for t in self.ask({"op": "tiers"})["tiers"] if t["health"] is not None]
        return dict(tier["health"])


__all__ = [
    "EngineProcess",
    "main",
    "offloading_config",
]

if __name__ == "__main__":
    sys.exit(main())
