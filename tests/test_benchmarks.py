"""The benchmark scripts run end to end (tiny sizes; their numbers are not checked here)."""

from __future__ import annotations

import json
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


def test_aesgcm_benchmark_times_plain_and_sealed_beside_the_cipher_alone() -> None:
    output = run(
        "bench_aesgcm.py", "--chunks", "2", "--batch", "2", "--repeat", "1", "--tokens", "8"
    )
    assert "redis:// (serde=aesgcm)" in output and "file:// (aesgcm:: wrapper)" in output
    rows = [line.split() for line in output.splitlines() if line.startswith("  batched")]
    assert [row[0] for row in rows] == ["batched_put", "batched_get"] * 2, output
    assert all(len(row) == 5 and row[3].endswith("x") for row in rows), output


def test_redis_benchmark_compares_both_servers_against_raw_pipelines() -> None:
    output = run(
        "bench_redis.py", "--chunks", "4", "--batch", "2", "--repeat", "1", "--tokens", "4"
    )
    assert "redis-server" in output and "valkey-server" in output
    for case in ("batched put", "batched get", "single put", "single get"):
        assert output.count(case) >= 4, case  # 2 servers x 2 shapes, plus the summary
    assert output.count("read back bit-exact through kvplug") == 4


def test_lm_tls_benchmark_times_plain_and_tls_side_by_side() -> None:
    output = run(
        "bench_lm_tls.py",
        "--chunks",
        "2",
        "--batch",
        "2",
        "--repeat",
        "1",
        "--server-memory",
        "256MiB",
    )
    rows = [line.split() for line in output.splitlines() if line.startswith("  ")]
    ops = [row[0] for row in rows if row[0] != "lm://"]
    assert ops == ["put", "get", "batched_put", "batched_get"] * 2, output
    assert all(float(row[-1].rstrip("x")) > 0 for row in rows if row[0] != "lm://")


def test_lookup_benchmark_counts_what_the_server_saw_for_each_way() -> None:
    output = run("bench_lookup.py", "--chunks", "8", "--lookups", "3", "--repeat", "1")
    rows = {
        line[:26].strip(): line[26:].split()
        for line in output.splitlines()
        if line.startswith(("raw", "kvplug"))
    }
    assert set(rows) == {
        "raw pipeline of EXISTS",
        "kvplug batched_exists",
        "kvplug contains per key",
    }
    assert float(rows["kvplug batched_exists"][2]) == 8.0  # commands per lookup
    assert float(rows["kvplug contains per key"][3]) >= 8.0  # a round trip per key


def test_fresh_memory_probe_times_touches_and_server_gets_with_and_without_a_holder() -> None:
    output = run(
        "probe_fresh_memory.py",
        *("--touch-gib", "1", "--hold-gib", "1", "--value-mib", "1", "--values", "8"),
        *("--passes", "2"),
    )
    assert re.search(r"GiB +1: +\d+ ms \( *\d+ ms in the kernel\)", output), output
    faults = [int(n.replace(",", "")) for n in re.findall(r"([\d,]+) minor faults/GiB", output)]
    assert len(faults) == 4, output  # two passes alone, two beside the holder
    assert "alone: median server CPU" in output and "1 GiB held elsewhere: median" in output


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


def test_scale_benchmark_times_each_operation_per_level_and_backend(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    output = run(
        "bench_scale.py",
        *("--levels", "1,40", "--ops", "20", "--dir", str(tmp_path), "--json", str(out)),
    )
    for backend in ("cpu", "disk", "redis"):
        assert f"### {backend}: " in output, backend
    rows = re.findall(r"^\| (1|40) \|((?: [\d.]+ / [\d.]+ \|){4})", output, re.MULTILINE)
    assert len(rows) == 6, output  # 3 backends x 2 levels, all four operations timed
    results = json.loads(out.read_text())
    assert results["ops"] == 20
    for backend in results["backends"].values():
        assert [level["keys"] for level in backend["levels"]] == [1, 40]
        for level in backend["levels"]:
            assert set(level["latency_us"]) == {"put", "get hit", "get miss", "contains"}
            assert all(cell["median"] > 0 for cell in level["latency_us"].values())
    assert [p.name for p in tmp_path.iterdir()] == ["scale.json"]  # the disk tier's dir is gone


def test_scale_benchmark_skips_a_disk_level_that_would_fill_the_disk(tmp_path: Path) -> None:
    output = run(
        "bench_scale.py",
        *("--backends", "disk", "--levels", "1,10", "--ops", "5"),
        *("--dir", str(tmp_path), "--min-free", "1000PiB"),
    )
    assert "1 keys: skipped, filling 1 keys needs about" in output
    assert "| 1 | skipped:" in output
    assert "| 10 |" not in output
    assert list(tmp_path.iterdir()) == []


def test_gpu_offload_benchmark_compares_both_ways_with_the_raw_copy_and_checks_bytes() -> None:
    output = run(
        "bench_gpu_offload.py",
        *("--chunks", "3", "--repeat", "1", "--tokens", "16", "--layers", "2"),
    )
    for case in ("gather, then put, per chunk", "get, then scatter, per chunk"):
        assert case in output, case
    for depth in ("2", "3"):
        assert f"pipelined offload, depth {depth}" in output
        assert f"pipelined load, depth {depth}" in output
    assert output.count("x of raw copy") == 6
    assert "every chunk read back bit-exact" in output


def test_peer_benchmark_runs_every_path_against_lmcache_and_raw_and_cleans_up(
    tmp_path: Path,
) -> None:
    # Local imports: other tests of this file share its import block.
    import json as json_module

    import pytest

    from kvplug_testing.lm import lmcache_python

    python = lmcache_python()
    if python is None:
        pytest.skip(
            "no LMCache 0.5.6 venv (.venv-lmcache-0.5.6, built by scripts/setup-engines.sh)"
        )
    done = subprocess.run(
        [
            *(python, str(BENCHMARKS / "bench_peer.py"), "--dir", str(tmp_path), "--json"),
            *("--gib", "0.01", "--repeat", "1", "--batch", "2", "--layers", "2"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json_module.loads(done.stdout.strip().splitlines()[-1])
    sides = {
        "cpu": {"kvplug", "LMCache cpu", "raw copy_"},
        "disk": {"kvplug", "LMCache disk", "raw O_DIRECT"},
        "redis": {"kvplug", "LMCache redis://", "LMCache resp://", "raw redis-py"}
        | {"raw socket", "raw socket x2"},
    }
    cases = {(r["path"], r["variant"], r["operation"]) for r in rows}
    assert cases == {
        (path, variant, operation)
        for path in sides
        for variant in ("per-op", "batch")
        for operation in ("store", "retrieve")
    }
    for row in rows:
        assert set(row["mb_s"]) == sides[row["path"]], row
        assert all(rate > 0 for rate in row["mb_s"].values()), row
        best_lmcache = max(v for k, v in row["mb_s"].items() if k.startswith("LMCache"))
        assert row["vs_lmcache"] == pytest.approx(row["mb_s"]["kvplug"] / best_lmcache)
        assert row["best_raw"].startswith("raw")
        assert row["paired_vs_lmcache"] > 0 and row["paired_vs_raw"] > 0, row
        # Redis retrieves carry the server's CPU over each timed pass, and the usual-cost view.
        if row["path"] == "redis" and row["operation"] == "retrieve":
            assert set(row["server_s_per_gib"]) == sides["redis"], row
            assert all(len(cost) == 1 and cost[0] >= 0 for cost in row["server_s_per_gib"].values())
            assert all(0 <= n <= 1 for n in row["usual_server_passes"].values()), row
            assert max(row["usual_server_passes"].values()) == 1, row  # the lowest cost is usual
        else:
            assert "server_s_per_gib" not in row, row
    table = re.findall(
        r"^(cpu|disk|redis) +2 MiB +(per-op|batch) +(store|retrieve) ", done.stdout, re.M
    )
    assert len(table) == len(rows), done.stdout  # every row printed as well
    assert "redis: the engine's copies on 1 torch thread(s)" in done.stdout
    server_lines = re.findall(
        r"^  (per-op|batch) (store|retrieve): server CPU s/GiB", done.stdout, re.M
    )
    assert len(server_lines) == 2 and {op for _, op in server_lines} == {"retrieve"}, done.stdout
    assert list(tmp_path.iterdir()) == []  # the disk path's files are gone
