"""The documentation runs and stays in step with what is installed."""

from __future__ import annotations

import os
import re
import subprocess
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
def test_python_examples_in_the_docs_run(source: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "environ", os.environ.copy())  # an example's settings stay in it
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


def _commands(path: Path) -> list[str]:
    """The command lines of a shell script: no comments, no blank lines."""
    lines = (line.strip() for line in path.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def test_ci_runs_the_readmes_main_command_verbatim_and_every_command_at_its_default() -> None:
    main_command, test_command = re.findall(
        r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), re.DOTALL
    )[:2]
    assert f"exec {test_command}" in _commands(ROOT / ".ci" / "run")
    steps = _commands(ROOT / "scripts" / "test.sh")
    # Verbatim, failing the run when it exits non-zero, and before anything beyond the main
    # job's own set-up is built.
    main_job = next(i for i, line in enumerate(steps) if line.startswith(f"{main_command} || "))
    assert steps[main_job].startswith(f"{main_command} || failed ")
    assert re.search(
        r"^failed\(\) \{[^}]*\n  exit 1\n\}", (ROOT / "scripts" / "test.sh").read_text(), re.M
    )
    assert main_job < steps.index("bash scripts/setup-engines.sh")
    for invocation in ("plugins", "check", "config", "contract cpu://"):
        assert steps.index(f"default_invocation {invocation}") < steps.index(
            "bash scripts/setup-engines.sh"
        )


def test_the_main_commands_set_up_builds_no_engine_venv_and_the_test_command_does() -> None:
    setup = "\n".join(_commands(ROOT / "scripts" / "setup.sh"))
    for engine_part in (".venv-", "tested-versions.txt", "lmcache", "sglang", "vllm", "g++"):
        assert engine_part not in setup, engine_part
    engines = "\n".join(_commands(ROOT / "scripts" / "setup-engines.sh"))
    assert "tested-versions.txt" in engines and ".kvplug-stamp" in engines
    assert "bash scripts/setup-engines.sh" in _commands(ROOT / "scripts" / "test.sh")
    for script in ("setup.sh", "setup-engines.sh", "test.sh"):
        subprocess.run(["bash", "-n", str(ROOT / "scripts" / script)], check=True)
