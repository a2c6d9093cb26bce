"""The benchmark scripts run end to end (tiny sizes; their numbers are not checked here)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def run(script: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_cpu_benchmark_compares_against_plain_copies() -> None:
    output = run("bench_cpu.py", "--chunks", "2", "--repeat", "1")
    assert output.count("x of plain copy") == 2
    assert "small objects (4 KiB" in output


def test_disk_benchmark_compares_against_the_raw_tools(tmp_path: Path) -> None:
    output = run("bench_disk.py", "--dir", str(tmp_path), "--chunks", "4", "--repeat", "1")
    assert "queue depth 1" in output and "queue depth 4" in output
    assert "dd      write" in output
    assert "ratio   write" in output


def test_redis_benchmark_compares_both_servers_against_raw_pipelines() -> None:
    output = run(
        "bench_redis.py", "--chunks", "4", "--batch", "2", "--repeat", "1", "--tokens", "4"
    )
    assert "redis-server" in output and "valkey-server" in output
    for case in ("batched put", "batched get", "single put", "single get"):
        assert output.count(case) >= 4, case  # 2 servers x 2 shapes, plus the summary
    assert output.count("read back bit-exact through kvplug") == 4


def test_store_benchmark_compares_the_store_with_its_tiers_and_measures_memory(
    tmp_path: Path,
) -> None:
    output = run(
        "bench_store.py",
        *("--batches", "2", "--repeat", "1", "--tokens", "4", "--dir", str(tmp_path)),
        *("--write-gb", "0.2", "--cpu-size", "64MiB", "--disk-size", "128MiB"),
    )
    for config in ("cpu+file", "cpu+redis"):
        for operation in ("put", "get (lower tier)", "get (cpu hits)"):
            row = rf"{re.escape(config)}\s+2\s+{re.escape(operation)}\s"
            assert re.search(row, output), (config, operation)
    for mode in ("puts never wait", "puts wait up to 60 s for room"):
        assert f"memory ({mode}): wrote 0.2 GB" in output, mode
    assert output.count("of the 0.06 GiB budget") == 2
