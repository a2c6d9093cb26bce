"""Test and benchmark support, not for serving: a real vLLM engine in a process of its own,
driven by JSON lines, for kvplug-vllm's real-engine tests and ``benchmarks/bench_vllm_engine.py``.

``python -m kvplug_vllm.testing_engine MODEL_DIR CONFIG_JSON`` starts ``vllm.LLM`` on
``MODEL_DIR`` (see :func:`kvplug_testing.models.build_random_llama`) with ``CONFIG_JSON`` as its
``kv_transfer_config`` (a JSON object, or ``null`` for none), in-process (vLLM's engine core in
this process, so that the tier's counters can be read), on vLLM's CPU build with kvplug's CPU
worker (:mod:`kvplug_vllm.testing_cpu_worker`) where no GPU is present. It prints one JSON line
when ready (``{"ready": true, "start_seconds": ...}``) or when the start failed (``{"ready":
false, "error": ..., "type": ...}``, exit status 1), then answers one JSON line per command
read from stdin:

- ``{"op": "generate", "prompts": [[token ids], ...], "max_tokens": 16}``: each prompt alone,
  greedy; per prompt ``tokens`` (the output ids), ``cached`` (``num_cached_tokens``) and
  ``seconds`` (wall time of the call; with ``max_tokens`` 1, the time to first token).
- ``{"op": "reset"}``: ``reset_prefix_cache(reset_connector=True)``.
- ``{"op": "tiers"}``: ``{"tiers": [{"type": ..., "health": {...}}, ...]}``, each secondary
  tier, with kvplug's :class:`~kvplug_vllm.tier.TierHealth` for a kvplug tier.
- ``{"op": "settle", "timeout": 60}``: steps the engine until no tier has a job in flight.
- ``{"op": "exit"}``.

A failed command answers ``{"error": ..., "type": ...}``. :class:`EngineProcess` runs one from
Python.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from kvplug_vllm.testing_cpu_worker import ENABLE_VARIABLE

START_TIMEOUT = 300.0
"""Seconds an engine may take to start on a busy 2-core machine."""
COMMAND_TIMEOUT = 300.0


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


def _secondary_tiers(llm: Any) -> list[Any]:
    """The secondary tiers of ``llm``'s offloading connector (engine core in this process)."""
    core = llm.llm_engine.engine_core.engine_core
    connector = core.scheduler.connector
    if connector is None:
        return []
    manager = connector.connector_scheduler.manager
    return list(getattr(manager, "secondary_tiers", []))


def _health(tier: Any) -> dict[str, Any] | None:
    health = getattr(tier, "health", None)
    return dataclasses.asdict(health()) if callable(health) else None


def _serve(llm: Any, commands: IO[str], answers: IO[str]) -> None:
    from vllm import SamplingParams, TokensPrompt

    def answer(message: dict[str, Any]) -> None:
        answers.write(json.dumps(message) + "\n")
        answers.flush()

    for line in commands:
        if not line.strip():
            continue
        command = json.loads(line)
        op = command.get("op")
        try:
            if op == "exit":
                answer({"ok": True})
                return
            if op == "generate":
                params = SamplingParams(
                    temperature=0.0, max_tokens=int(command.get("max_tokens", 16)), ignore_eos=True
                )
                results = []
                for prompt in command["prompts"]:
                    started = time.perf_counter()
                    (output,) = llm.generate(
                        [TokensPrompt(prompt_token_ids=list(prompt))], params, use_tqdm=False
                    )
                    seconds = time.perf_counter() - started
                    results.append(
                        {
                            "tokens": list(output.outputs[0].token_ids),
                            "cached": int(output.num_cached_tokens or 0),
                            "seconds": seconds,
                        }
                    )
                answer({"results": results})
            elif op == "reset":
                answer({"reset": bool(llm.reset_prefix_cache(reset_connector=True))})
            elif op == "tiers":
                answer(
                    {
                        "tiers": [
                            {"type": type(tier).__name__, "health": _health(tier)}
                            for tier in _secondary_tiers(llm)
                        ]
                    }
                )
            elif op == "settle":
                deadline = time.monotonic() + float(command.get("timeout", 60))
                tiers = _secondary_tiers(llm)
                while any(tier.has_pending_work() for tier in tiers):
                    if time.monotonic() > deadline:
                        raise TimeoutError("tier jobs still in flight")
                    llm.llm_engine.step()
                    time.sleep(0.01)
                answer({"ok": True})
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as error:
            answer({"error": str(error), "type": type(error).__name__})


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    model, config_json = args
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault(ENABLE_VARIABLE, "1")
    answers = sys.stdout
    # vLLM and its libraries log to stdout too: the protocol keeps a stream of its own.
    sys.stdout = sys.stderr
    started = time.perf_counter()
    try:
        from vllm import LLM

        kv_transfer_config = json.loads(config_json)
        llm = LLM(
            model=model,
            skip_tokenizer_init=True,
            gpu_memory_utilization=0.1,
            max_model_len=4096,
            enforce_eager=True,
            seed=0,
            kv_transfer_config=kv_transfer_config,
        )
    except Exception as error:
        answers.write(
            json.dumps({"ready": False, "error": str(error), "type": type(error).__name__}) + "\n"
        )
        answers.flush()
        return 1
    answers.write(
        json.dumps({"ready": True, "start_seconds": time.perf_counter() - started}) + "\n"
    )
    answers.flush()
    _serve(llm, sys.stdin, answers)
    del llm
    return 0


class EngineProcess:
    """``python -m kvplug_vllm.testing_engine`` as a child process: :meth:`start` waits until it
    is ready (or raises :class:`EngineStartFailed` with its error), :meth:`ask` sends a command
    and returns the answer, :meth:`close` ends it (killed if it does not exit in time).

    Example::

        with EngineProcess(model_dir, offloading_config([{"type": "kvplug", "url": url}])) as e:
            first = e.ask({"op": "generate", "prompts": [prompt], "max_tokens": 1})
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        kv_transfer_config: dict[str, Any] | None,
        *,
        env: dict[str, str] | None = None,
        log: str | os.PathLike[str] | None = None,
    ) -> None:
        self.model_dir = str(model_dir)
        self.kv_transfer_config = kv_transfer_config
        self.env = {**os.environ, **(env or {})}
        self.log_path = log
        self.process: subprocess.Popen[str] | None = None
        self.start_seconds: float | None = None

    def start(self, timeout: float = START_TIMEOUT) -> EngineProcess:
        with Path(self.log_path or os.devnull).open("a") as log:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "kvplug_vllm.testing_engine",
                    self.model_dir,
                    json.dumps(self.kv_transfer_config),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=self.env,
            )
        ready = self._read(timeout)
        if not ready.get("ready"):
            self.close()
            raise EngineStartFailed(ready.get("type", "?"), ready.get("error", "no answer"))
        self.start_seconds = float(ready["start_seconds"])
        return self

    def _read(self, timeout: float) -> dict[str, Any]:
        import selectors

        assert self.process is not None and self.process.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            if not selector.select(timeout):
                raise TimeoutError(f"the engine did not answer within {timeout:g} s")
        line = self.process.stdout.readline()
        if not line:
            return {"error": f"the engine exited with status {self.process.wait()}"}
        return dict(json.loads(line))

    def ask(self, command: dict[str, Any], timeout: float = COMMAND_TIMEOUT) -> dict[str, Any]:
        assert self.process is not None and self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        answer = self._read(timeout)
        if "error" in answer:
            raise RuntimeError(f"{command.get('op')}: {answer.get('type')}: {answer['error']}")
        return answer

    def generate(
        self, prompts: Sequence[Sequence[int]], max_tokens: int = 16
    ) -> list[dict[str, Any]]:
        """Each prompt alone, greedy: its output ids, cached tokens and seconds."""
        command = {
            "op": "generate",
            "prompts": [list(p) for p in prompts],
            "max_tokens": max_tokens,
        }
        return list(self.ask(command)["results"])

    def kvplug_health(self) -> dict[str, Any]:
        """The health and counters of the engine's one kvplug tier."""
        (tier,) = [t for t in self.ask({"op": "tiers"})["tiers"] if t["health"] is not None]
        return dict(tier["health"])

    def close(self, timeout: float = 60.0) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        try:
            if process.poll() is None and process.stdin is not None:
                process.stdin.write(json.dumps({"op": "exit"}) + "\n")
                process.stdin.flush()
            process.wait(timeout)
        except (OSError, subprocess.TimeoutExpired):
            process.kill()
            process.wait()
        finally:
            for stream in (process.stdin, process.stdout):
                if stream is not None:
                    stream.close()

    def __enter__(self) -> EngineProcess:
        return self.start() if self.process is None else self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class EngineStartFailed(Exception):
    """The engine exited at start; ``kind`` and ``message`` are its exception's."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message


if __name__ == "__main__":
    sys.exit(main())
