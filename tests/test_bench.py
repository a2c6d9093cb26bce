"""kvplug bench: the main job, on the embedded default tiers and on a configured store."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import kvplug
from kvplug import CacheKey, MemoryObj
from kvplug.registry import reset_registry
from kvplug.runtime.cli import main
from kvplug.units import host_memory
from kvplug_cpu.backend import CpuBackend
from kvplug_testing import RedisServer

SMALL = ["--shape", "2,2,16,64", "--count", "3"]
MIB_CHUNK = ["--shape", "2,8,256,128"]
"""1 MiB chunks."""
TIER_LINE = re.compile(
    r"^tier (\d+:\S+): (\d+) of (\d+) chunks stored, (\d+) returned, (\d+) puts dropped$", re.M
)


def tier_counts(output: str) -> dict[str, tuple[int, ...]]:
    """Each tier's ``(stored, given, returned, dropped)`` from the bench's lines."""
    return {m[1]: tuple(int(n) for n in m.groups()[1:]) for m in TIER_LINE.finditer(output)}


class CorruptingCpu(CpuBackend):
    """A cpu tier whose reads come back with one bit flipped."""

    async def _get(self, key: CacheKey) -> MemoryObj | None:
        obj = await super()._get(key)
        if obj is not None:
            obj.raw[0] ^= 1
        return obj


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def test_bench_on_the_embedded_default_tiers_verifies_every_read() -> None:
    code, output = invoke("bench", *SMALL)
    assert code == 0, output
    assert "0:cpu://" in output and "1:file://" in output
    assert "verified 6 reads bit-exact" in output
    assert "zero-copy" in output


def test_bench_measures_the_configured_tiers(tmp_path: Path) -> None:
    config = tmp_path / "kvplug.yaml"
    config.write_text(f"tiers:\n  - cpu://\n  - acme://{tmp_path}/bench.sqlite\n")
    code, output = invoke("bench", "--config", str(config), *SMALL)
    assert code == 0, output
    assert "1:acme://" in output and "verified 6 reads bit-exact" in output


def test_bench_says_when_the_first_tier_is_too_small(tmp_path: Path) -> None:
    config = tmp_path / "kvplug.yaml"
    config.write_text("tiers:\n  - url: cpu://\n    max_size: 4KiB\n")
    code, output = invoke("bench", "--config", str(config), *SMALL)
    assert code == 1
    assert "no memory for chunk" in output and "--count" in output


def test_bench_fails_when_a_tier_returns_wrong_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kvplug.registry, "_registry", kvplug.registry.Registry())
    kvplug.register_backend(
        kvplug.BackendSpec("corrupting", ("corrupting",), f"{__name__}:CorruptingCpu")
    )
    config = tmp_path / "kvplug.yaml"
    config.write_text("tiers:\n  - corrupting://\n")
    try:
        code, output = invoke("bench", "--config", str(config), *SMALL)
    finally:
        reset_registry()
    assert code == 1
    assert "3 chunk(s) read back with wrong bytes" in output


@pytest.mark.parametrize(
    "gib",
    [
        pytest.param(1 << 32, id="beyond-the-address-space"),
        pytest.param(
            16 * host_memory().total >> 30,
            id="16-times-the-machine",
            marks=pytest.mark.skipif(
                Path("/proc/sys/vm/overcommit_memory").read_text().strip() == "1",
                reason="this kernel grants any reservation (vm.overcommit_memory=1)",
            ),
        ),
    ],
)
def test_bench_with_more_cpu_memory_than_the_machine_has_says_so_without_a_traceback(
    tmp_path: Path, gib: int
) -> None:
    config = tmp_path / "lmcache.yaml"
    config.write_text(f"chunk_size: 256\nlocal_cpu: true\nmax_local_cpu_size: {gib}\n")
    code, output = invoke("bench", "--config", str(config), *SMALL)
    assert code == 1
    assert "bench failed: cpu:// max_size (max_local_cpu_size in an LMCache config)" in output
    assert "Traceback" not in output


def test_bench_fails_loudly_when_a_tier_accepts_chunks_but_returns_none(tmp_path: Path) -> None:
    config = tmp_path / "kvplug.yaml"
    config.write_text("tiers:\n  - cpu://\n  - blackhole://\n")
    code, output = invoke("bench", "--config", str(config), *SMALL)
    assert code == 1
    assert "FAIL tier 1:blackhole:// accepted 3 of 3 chunks and returned 0" in output
    assert "verified" not in output


def test_bench_of_only_a_blackhole_fails(tmp_path: Path) -> None:
    config = tmp_path / "kvplug.yaml"
    config.write_text("tiers: [blackhole://]\n")
    code, output = invoke("bench", "--config", str(config), *SMALL)
    assert code == 1 and "FAIL tier 0:blackhole://" in output


def test_bench_names_a_tier_that_refuses_every_put_with_counts_and_the_last_error(
    tmp_path: Path,
) -> None:
    config = tmp_path / "kvplug.yaml"
    config.write_text("tiers:\n  - cpu://\n  - {url: 'cpu://', max_size: 4KiB}\n")
    code, output = invoke("bench", "--config", str(config), *SMALL)
    assert code == 1
    flat = " ".join(output.split())
    assert "FAIL tier 1:cpu:// accepted 0 of 3 chunks and returned 0 (3 puts dropped" in flat
    assert "last problem: full: CapacityExceeded: cannot store an object of 8192 bytes" in flat
    # The refusing tier's put row is shown, not left out, and shows no made-up speed.
    assert "nan" not in output


def test_bench_removes_what_it_wrote_and_never_touches_an_engines_chunks(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    engine_key = CacheKey("kvplug-bench", 1, 0, 0)  # what older runs wrote under

    async def keys_on_disk(put: bool = False) -> list[CacheKey]:
        backend = await kvplug.open_backend(f"file://{disk}")
        if put:
            await backend.put(engine_key, MemoryObj.from_tensor(torch.ones(64)))
        keys = [key async for key in backend.list_keys()]
        await backend.close()
        return keys

    assert asyncio.run(keys_on_disk(put=True)) == [engine_key]
    config = tmp_path / "kvplug.yaml"
    config.write_text(f"tiers:\n  - cpu://\n  - file://{disk}\n")
    code, output = invoke("bench", "--config", str(config), *SMALL)
    assert code == 0, output
    assert asyncio.run(keys_on_disk()) == [engine_key]


@pytest.mark.redis
def test_bench_against_redis_leaves_no_chunk_behind(tmp_path: Path) -> None:
    with RedisServer() as server, server.client() as client:
        client.set("an-engine-key", b"kept")
        config = tmp_path / "kvplug.yaml"
        config.write_text(f"tiers:\n  - cpu://\n  - {server.url}\n")
        code, output = invoke("bench", "--config", str(config), *SMALL)
        assert code == 0, output
        assert "verified 6 reads bit-exact" in output
        assert client.keys("*") == [b"an-engine-key"]


@pytest.mark.slow
def test_the_real_default_bench_passes_with_all_32_chunks_in_every_tier() -> None:
    # The README's main job exactly: 32 chunks of 32 MiB (1 GiB) through cpu:// and file:// in
    # a temporary directory; about 10-20 s here on 2 busy cores.
    started = time.monotonic()
    run = subprocess.run(
        [str(Path(sys.executable).with_name("kvplug")), "bench"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    tiers = tier_counts(output)
    assert [name.split("://")[0] for name in tiers] == ["0:cpu", "1:file"], output
    assert set(tiers.values()) == {(32, 32, 32, 0)}, output
    assert "verified 64 reads bit-exact" in output
    assert time.monotonic() - started < 300


def test_a_bench_that_offers_twice_what_its_write_behind_holds_keeps_every_chunk() -> None:
    # The default tiers for 48 chunks of 1 MiB: a 96 MiB budget, so a 24 MiB write-behind.
    code, output = invoke("bench", *MIB_CHUNK, "--count", "48")
    assert code == 0, output
    assert set(tier_counts(output).values()) == {(48, 48, 48, 0)}, output


def test_the_write_behind_the_bench_outruns_holds_its_puts_back_and_fails_no_tier(
    tmp_path: Path,
) -> None:
    config = tmp_path / "kvplug.yaml"
    config.write_text(f"tiers: [cpu://, file://{tmp_path}/disk]\nwrite_behind_size: 1MiB\n")
    code, output = invoke("bench", "--config", str(config), *MIB_CHUNK, "--count", "12")
    assert code == 0, output
    assert "FAIL" not in output and "write_behind_full" not in output
    assert set(tier_counts(output).values()) == {(12, 12, 12, 0)}, output
    waited = re.search(r"(\d+) of 12 puts waited for write-behind room", output)
    assert waited is not None and int(waited[1]) >= 1, output
    assert "method: puts wait up to 60 s for write-behind room" in output


@pytest.mark.parametrize(
    ("lower", "dropped", "fix"),
    [
        pytest.param(
            "{url: 'cpu://', max_size: 4KiB}",
            "(dropped: full 3)",
            "to fix: raise the tier's max_size (or free its space): the objects do not fit in it "
            "(one object is 8.0KiB)",
            id="full",
        ),
        pytest.param(
            "'audit://?fail_rate=1&fail_ops=batched_put::file://{tmp}/disk'",
            "tier_error",
            "; kvplug check URL tests the tier on its own",
            id="failing-its-writes",
        ),
    ],
)
def test_a_lower_tier_that_takes_no_chunk_fails_the_bench_with_the_reason_and_the_fix(
    tmp_path: Path, lower: str, dropped: str, fix: str
) -> None:
    config = tmp_path / "kvplug.yaml"
    lower = lower.replace("{tmp}", str(tmp_path))
    config.write_text(f"tiers:\n  - cpu://\n  - {lower}\n")
    code, output = invoke("bench", "--config", str(config), *SMALL)
    assert code == 1
    flat = " ".join(output.split())
    assert "FAIL tier 1:" in flat and "accepted 0 of 3 chunks and returned 0" in flat
    assert "it took none of the 3 puts offered to it" in flat and dropped in flat
    assert fix in flat
