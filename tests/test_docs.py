"""The documentation runs and stays in step with what is installed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import kvplug
from kvplug.registry import reset_registry

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


def _python_blocks() -> list[tuple[str, int, str]]:
    blocks = []
    for path in DOCS:
        for index, match in enumerate(PYTHON_BLOCK.finditer(path.read_text())):
            blocks.append((path.name, index, match.group(1)))
    return blocks


@pytest.mark.parametrize(
    "source", [b[2] for b in _python_blocks()], ids=[f"{b[0]}#{b[1]}" for b in _python_blocks()]
)
def test_python_examples_in_the_docs_run(source: str) -> None:
    exec(compile(source, "<docs>", "exec"), {"__name__": "docs_example"})


def test_readme_shows_the_two_commands_and_ci_runs_the_test_one() -> None:
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```bash\n(.*?)\n```", readme, re.DOTALL)
    assert commands[:2] == [
        "bash scripts/setup.sh && .venv/bin/kvplug bench",
        "bash scripts/test.sh",
    ]
    assert "scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def test_every_installed_scheme_is_documented() -> None:
    reset_registry()
    urls_doc = (ROOT / "docs" / "urls.md").read_text()
    for scheme in kvplug.available_schemes():
        assert f"`{scheme}://" in urls_doc or f"`{scheme}::" in urls_doc, scheme
