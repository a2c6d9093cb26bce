"""The kvplug command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from rich.console import Console

from kvplug import cli
from kvplug.cli import main
from kvplug.registry import available_schemes, plugins


def invoke(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), env=env)
    return result.exit_code, result.output


def test_plugins_table_lists_the_built_in_plugins() -> None:
    code, output = invoke("plugins")
    assert code == 0
    for name in ("cpu://", "blackhole://", "audit://", "kvplug-cpu", "kvplug-audit"):
        assert name in output


def test_plugins_json_has_distribution_version_and_kind() -> None:
    code, output = invoke("plugins", "--json")
    assert code == 0
    rows = {row["plugin"]: row for row in json.loads(output)}
    assert rows["cpu"]["distribution"] == "kvplug-cpu"
    assert rows["cpu"]["version"]
    assert rows["audit"]["backends"][0]["kind"] == "wrapper"
    assert all(row["error"] is None for row in rows.values())


def test_check_round_trips_through_a_url() -> None:
    code, output = invoke("check", "cpu://?max_size=64MiB", "--rounds", "3")
    assert code == 0, output
    assert "OK" in output and "put" in output and "get" in output
    assert "zero_copy" in output


def test_check_without_url_uses_the_configured_first_tier(tmp_path) -> None:
    config = tmp_path / "kvplug.yaml"
    config.write_text("tiers:\n  - url: blackhole://\n  - cpu://\n")
    code, output = invoke("check", "--config", str(config))
    assert code == 1
    assert "blackhole://: contains() is False right after put()" in output


def test_check_by_default_round_trips_a_full_model_shaped_chunk_as_well() -> None:
    code, output = invoke("check", "cpu://?max_size=8MiB", "--rounds", "1")
    assert code == 1
    flat = " ".join(output.split())
    assert "put of a 32.0MiB object (shape [2, 32, 256, 1024] torch.float16) failed" in flat
    assert "CapacityExceeded" in flat and "OK" not in output


def test_check_with_a_config_checks_every_tier_with_its_own_options(tmp_path: Path) -> None:
    config = tmp_path / "kvplug.yaml"
    config.write_text(
        f"tiers:\n  - cpu://\n  - {{url: 'file://{tmp_path}/disk', max_size: 1MiB}}\n"
        "  - blackhole://\n"
    )
    code, output = invoke("check", "--config", str(config), "--rounds", "1")
    assert code == 1
    flat = " ".join(output.split())
    assert "OK tier 0 cpu://" in flat
    assert f"check failed: tier 1 file://{tmp_path}/disk: put of a 32.0MiB object" in flat
    assert "check failed: tier 2 blackhole://" in flat
    assert "check failed for 2 of 3 target(s)" in flat


def test_check_of_small_objects_only_when_asked() -> None:
    code, output = invoke("check", "cpu://?max_size=8MiB", "--shape", "2,4,256,128")
    assert code == 0, output
    assert "put 512.0KiB" in output and "32.0MiB" not in output


def test_check_default_is_the_embedded_cpu_tier() -> None:
    code, output = invoke("check", "--rounds", "1", env={"KVPLUG_CONFIG_FILE": ""})
    assert code == 0, output
    assert "cpu://" in output


def test_check_options_and_wrappers() -> None:
    code, output = invoke("check", "audit::cpu://", "-o", "max_size=32MiB", "--dtype", "bfloat16")
    assert code == 0, output


def test_check_reports_bad_input_clearly() -> None:
    code, output = invoke("check", "cpuu://")
    assert code == 1 and "Did you mean 'cpu'?" in output
    code, output = invoke("check", "redis://user:hunter2@127.0.0.1:1")
    assert "hunter2" not in output
    code, output = invoke("check", "cpu://", "--shape", "2,x")
    assert code == 2 and "comma-separated" in output
    code, output = invoke("check", "cpu://?max_sise=1GiB")
    assert code == 1 and "max_size" in output


def test_config_prints_lmcache_keys_as_tiers_with_passwords_masked(tmp_path) -> None:
    config = tmp_path / "lmcache.yaml"
    config.write_text(
        "chunk_size: 256\nlocal_cpu: true\nmax_local_cpu_size: 2.0\n"
        "remote_url: redis://app:hunter2@cache-1:6379\n"
    )
    code, output = invoke("config", "--config", str(config))
    assert code == 0, output
    assert "url: cpu://" in output and "max_size: 2147483648" in output
    assert "redis://app:***@cache-1:6379" in output and "hunter2" not in output
    code, output = invoke("config", "--config", str(tmp_path / "missing.yaml"))
    assert code == 1 and "missing.yaml" in output


@pytest.mark.parametrize(
    "text",
    [
        "tiers: " + "[" * 5000 + "]" * 5000,
        "extra_config:\n  x: " + "{a: " * 5000 + "1" + "}" * 5000,
        "extra_config:\n  x: " + "[" * 40 + "]" * 40,
    ],
    ids=["5000-level-list", "5000-level-mapping", "40-level-list"],
)
def test_a_deeply_nested_config_is_a_config_error_line(tmp_path: Path, text: str) -> None:
    config = tmp_path / "deep.yaml"
    config.write_text(text + "\n")
    code, output = invoke("config", "--config", str(config))
    assert code == 1
    assert output.startswith("config error: ") and "nest more than 32 levels" in output


@pytest.mark.parametrize("width", [80, 60])
def test_plugins_table_never_cuts_a_scheme_or_a_distribution_name(
    monkeypatch: pytest.MonkeyPatch, width: int
) -> None:
    monkeypatch.setattr(cli, "console", Console(width=width))
    code, output = invoke("plugins")
    assert code == 0
    cells = {cell.strip() for line in output.splitlines() for cell in line.split("│")}
    for scheme in available_schemes():
        assert f"{scheme}://" in cells, f"{scheme}:// is cut short at {width} columns"
    for info in plugins():
        assert info.distribution in cells
    assert "…" not in output
