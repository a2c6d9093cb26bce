"""What the distributions declare matches what is tested: the Python versions, and the tools'
targets."""

from __future__ import annotations

import re
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
