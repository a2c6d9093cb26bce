"""What the distributions declare matches what is tested: the Python versions, the tools'
targets, and the extras; the vendor surface installs and runs without the tools."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DISTRIBUTIONS = sorted(
    path
    for path in ROOT.glob("**/pyproject.toml")
    if path.parent != ROOT
    and not {"dists", "build"} & set(path.parts)
    and not any(part.startswith(".venv") for part in path.parts)
)


def _minimum_python(specifier: str) -> tuple[int, int]:
    match = re.fullmatch(r">=\s*3\.(\d+)", specifier)
    assert match, f"requires-python {specifier!r} is not a plain lower bound such as '>=3.11'"
    return 3, int(match.group(1))


def test_every_distribution_is_found() -> None:
    names = {path.parent.name for path in DISTRIBUTIONS}
    expected = {
        "core",
        "contracts",
        "cpu",
        "disk",
        "redis",
        "kvplug-acme",
        "lmcache",
        "sglang",
        "vllm",
    }
    assert expected <= names


@pytest.mark.parametrize("pyproject", DISTRIBUTIONS, ids=lambda p: str(p.parent.relative_to(ROOT)))
def test_requires_python_is_the_version_ruff_mypy_and_ci_use(pyproject: Path) -> None:
    workspace = tomllib.loads((ROOT / "pyproject.toml").read_text())
    ruff_target = workspace["tool"]["ruff"]["target-version"]
    mypy_target = workspace["tool"]["mypy"]["python_version"]
    declared = _minimum_python(tomllib.loads(pyproject.read_text())["project"]["requires-python"])
    assert f"py{declared[0]}{declared[1]}" == ruff_target
    assert f"{declared[0]}.{declared[1]}" == mypy_target
    assert sys.version_info[:2] >= declared


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every distribution's wheel, built from the checkout by scripts/wheels.sh."""
    pytest.importorskip("hatchling", reason="builds without isolation need hatchling installed")
    out = tmp_path_factory.mktemp("wheels")
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(ROOT / "scripts/wheels.sh"), str(out), "--no-build-isolation"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    return out


def _resolve(wheels: Path, requirement: str, tmp_path: Path) -> dict[str, tuple[str, str]]:
    """What pip would install for ``requirement`` in an empty environment, from ``wheels``
    first: name -> (version, where from)."""
    report = tmp_path / "report.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--quiet",
            "--report",
            str(report),
            "--find-links",
            str(wheels),
            "-c",
            str(ROOT / "scripts/constraints.txt"),
            requirement,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    return {
        item["metadata"]["name"].lower().replace("_", "-"): (
            item["metadata"]["version"],
            item["download_info"]["url"],
        )
        for item in json.loads(report.read_text())["install"]
    }


@pytest.mark.slow
def test_extras_install_the_checkouts_distributions_at_the_one_version(
    wheels: Path, tmp_path: Path
) -> None:
    version = (ROOT / "VERSION").read_text().strip()
    plan = _resolve(wheels, "kvplug[redis,disk]", tmp_path)
    for name in ("kvplug", "kvplug-redis", "kvplug-disk"):
        assert plan[name][0] == version
        assert plan[name][1].startswith(wheels.as_uri()), plan[name]
    assert "redis" in plan
    # The vendor surface: no command-line or metrics libraries without their extras.
    assert not {"click", "rich", "prometheus-client"} & set(plan), sorted(plan)
    tools = _resolve(wheels, "kvplug[cli,metrics]", tmp_path)
    assert {"click", "rich", "prometheus-client"} <= set(tools)


_WITHOUT = """
import sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Refuse())
"""


def _run_without(blocked: set[str], code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _WITHOUT.format(blocked=blocked) + code],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_store_counts_without_prometheus_and_names_the_extra_for_its_export() -> None:
    done = _run_without(
        {"prometheus_client"},
        "import asyncio, torch\n"
        "from kvplug import CacheKey, MemoryObj, KvplugError\n"
        "from kvplug.runtime.config import Config\n"
        "from kvplug.runtime.store import open_store\n"
        "async def main():\n"
        "    store = await open_store(Config.from_dict({'tiers': ['cpu://?max_size=64MiB']}))\n"
        "    key = CacheKey('m', 1, 0, 1)\n"
        "    await store.put(key, MemoryObj.from_tensor(torch.ones(64)))\n"
        "    await store.flush()\n"
        "    hit = await store.get(key); hit.release()\n"
        "    assert await store.get(CacheKey('m', 1, 0, 2)) is None\n"
        "    tier = store.stats()['tiers']\n"
        "    print(sorted((name, t['hits'], t['misses']) for name, t in tier.items()))\n"
        "    name = store.tier_names[0]\n"
        "    print(store.metrics.value('kvplug_tier_hits_total', tier=name, op='batched_get'))\n"
        "    try:\n"
        "        store.prometheus_text()\n"
        "    except KvplugError as error:\n"
        "        print(error)\n"
        "    await store.close()\n"
        "asyncio.run(main())\n",
    )
    assert done.returncode == 0, done.stderr
    counts, series, message = done.stdout.strip().splitlines()[-3:]
    assert counts.endswith("1, 1)]"), counts
    assert series == "1.0"  # the tier's own counter, read without Prometheus too
    assert "pip install 'kvplug[metrics]'" in message


def test_the_kvplug_command_without_its_extra_says_how_to_install_it() -> None:
    done = _run_without({"click"}, "from kvplug.runtime.command import main\nmain()\n")
    assert done.returncode == 1
    assert "pip install 'kvplug[cli]'" in done.stderr
    assert "Traceback" not in done.stderr
