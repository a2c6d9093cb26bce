"""The kvplug command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from rich.console import Console

from kvplug.registry import available_schemes, plugins
from kvplug.runtime import cli
from kvplug.runtime.cli import main
from kvplug.serde import available_serdes


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
    # The backend's own counters, as the Store and the engines report them: 3 shapes x 3
    # rounds of put/contains/get, and one get of a key never stored.
    assert "the backend's operation counters" in output
    assert _counter_row(output, "get")[:5] == ["10", "0", "10", "9", "1"]
    assert _counter_row(output, "put")[:5] == ["9", "0", "9", "0", "0"]


def _counter_row(output: str, operation: str) -> list[str]:
    """The cells after the operation's name in the counters table."""
    for line in output.splitlines():
        cells = [cell.strip() for cell in line.strip("│┃ ").split("│")]
        if cells[0] == operation and len(cells) == 8:
            return cells[1:]
    raise AssertionError(f"no counters row for {operation} in:\n{output}")


def test_check_without_url_uses_the_configured_first_tier(tmp_path: Path) -> None:
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
    # Through the whole Store too: the disk tier cannot take the chunk, the blackhole keeps none.
    assert "check failed: the Store: tier 1:file://" in flat and "dropped: full 1" in flat
    assert "check failed: the Store: tier 2:blackhole:// returned 0 of 3 objects" in flat
    assert "check failed for 3 of 4 target(s)" in flat


def test_check_without_url_also_round_trips_every_object_through_the_whole_store(
    tmp_path: Path,
) -> None:
    config = tmp_path / "kvplug.yaml"
    config.write_text(f"tiers:\n  - cpu://?max_size=256MiB\n  - file://{tmp_path}/disk\n")
    code, output = invoke("check", "--config", str(config), "--rounds", "1")
    assert code == 0, output
    flat = " ".join(output.split())
    assert (
        "OK the Store of 2 tier(s): each of 3 objects put through it, flushed and read back "
        "bit-exact from every tier" in flat
    )
    assert "the Store's tiers: their operation counters" in output
    rows = [line for line in output.splitlines() if ":cpu://" in line or ":file://" in line]
    assert len(rows) == 2 and all("100%" in row for row in rows), output


def test_check_fails_naming_a_tier_the_store_never_writes_though_it_passes_alone(
    tmp_path: Path,
) -> None:
    # The tier takes single puts but fails every batched one, which is how the Store writes.
    failing = f"audit://?fail_rate=1&fail_ops=batched_put::file://{tmp_path}/disk"
    config = tmp_path / "kvplug.yaml"
    config.write_text(f"tiers:\n  - cpu://?max_size=256MiB\n  - '{failing}'\n")
    code, output = invoke("check", "--config", str(config))
    assert code == 1
    flat = " ".join(output.split())
    assert (
        "OK tier 0 cpu://" in flat
        and "OK tier 1 audit://?fail_rate=1&fail_ops=batched_put::" in flat
    )
    assert (
        "check failed: the Store: tier 1:audit://?fail_rate=1&fail_ops=batched_put returned 0 "
        "of 9 objects; missed 3 of 3 512B objects, 3 of 3 512.0KiB objects, 3 of 3 32.0MiB "
        "objects; it took none of the 9 puts offered to it (dropped: " in flat
    )
    assert "tier_error" in flat
    assert "last problem: BackendUnavailable: injected fault: audit (fail_rate=1.0)" in flat
    assert "to fix: " in flat and "; kvplug check URL tests the tier on its own" in flat
    assert "check failed for 1 of 3 target(s)" in flat


def test_check_through_the_store_names_a_full_lower_tier_and_what_to_change(
    tmp_path: Path,
) -> None:
    config = tmp_path / "kvplug.yaml"
    config.write_text("tiers:\n  - cpu://\n  - {url: 'cpu://', max_size: 4KiB}\n")
    code, output = invoke("check", "--config", str(config), "--shape", "2,4,256,128")
    assert code == 1
    flat = " ".join(output.split())
    assert (
        "check failed: the Store: tier 1:cpu:// returned 0 of 3 objects; missed 3 of 3 512.0KiB "
        "objects; it took none of the 3 puts offered to it (dropped: full 3)" in flat
    )
    assert (
        "to fix: raise the tier's max_size (or free its space): the objects do not fit in it "
        "(one object is 512.0KiB)" in flat
    )


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


def test_config_prints_lmcache_keys_as_tiers_with_passwords_masked(tmp_path: Path) -> None:
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
    for serde in available_serdes():
        assert serde in cells, f"serde {serde} is cut short at {width} columns"
    assert "…" not in output
