"""kvplug bench: the main job, on the embedded default tiers and on a configured store."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

import kvplug
from kvplug import CacheKey, MemoryObj
from kvplug.cli import main
from kvplug.registry import reset_registry
from kvplug.units import host_memory
from kvplug_cpu.backend import CpuBackend

SMALL = ["--shape", "2,2,16,64", "--count", "3"]


class CorruptingCpu(CpuBackend):
    """A cpu tier whose reads come back with one bit flipped."""

    async def get(self, key: CacheKey) -> MemoryObj | None:
        obj = await super().get(key)
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
