"""The memcached walk-through of docs/writing-a-backend.md works for a newcomer.

The files the walk-through shows (its fenced blocks with a ``title=`` path) are written out as
they are, made discoverable the way ``pip install -e .`` makes them (the ``src`` folder on the
path and a ``.dist-info`` carrying the pyproject's name, version and entry points), and the
contract suite runs against real memcached servers with the commands the walk-through gives:
the whole suite through the fault proxy (``--kvplug-proxy``, clause 10), and the
walk-through's own ``tests/test_capacity.py`` against small servers (clause 9).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest

from kvplug_testing import free_port

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "writing-a-backend.md"
FILE_BLOCK = re.compile(r"^```[\w-]+ title=(\S+)\n(.*?)^```$", re.DOTALL | re.MULTILINE)
"""A fenced block that is a file of the walk-through (tests/test_docs.py runs only blocks
fenced ```` ```python ```` alone, so these are not executed there)."""
FILES = {
    "pyproject.toml",
    "src/kvplug_memcached/__init__.py",
    "src/kvplug_memcached/plugin.py",
    "src/kvplug_memcached/backend.py",
    "tests/test_capacity.py",
}
MEMCACHED = shutil.which("memcached")
SUITE_LIMIT = 600.0
"""Seconds one run of the suite may take (about 30 s on an idle 2-core machine)."""

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        MEMCACHED is None,
        reason="memcached is not on PATH; bash scripts/setup.sh installs it (Debian: memcached)",
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("pymemcache") is None,
        reason="pymemcache is not installed; pip install -r requirements-dev.txt",
    ),
]


def walkthrough_files() -> dict[str, str]:
    """The walk-through's files, by path inside the vendor's project, as the doc shows them."""
    return {path: text for path, text in FILE_BLOCK.findall(DOC.read_text())}


class Memcached:
    """A memcached process listening on 127.0.0.1 and a free port, stopped on exit."""

    def __init__(self, *settings: str) -> None:
        self.settings = settings
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"memcached://127.0.0.1:{self.port}"

    def __enter__(self) -> Memcached:
        assert MEMCACHED is not None
        self.port = free_port()
        user = ["-u", "nobody"] if os.geteuid() == 0 else []  # memcached refuses root
        argv = [MEMCACHED, *user, "-l", "127.0.0.1", "-p", str(self.port), "-U", "0"]
        self.process = subprocess.Popen(
            [*argv, *self.settings], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                if self.process.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
            self.process.kill()
            _, stderr = self.process.communicate()
            raise RuntimeError(
                f"{' '.join(argv)} {' '.join(self.settings)} did not start listening: "
                f"{stderr.decode(errors='replace').strip() or 'no message'}"
            )

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.communicate()


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The walk-through's distribution, written out and installed as ``pip install -e .``
    installs it, without touching the environment: returns the project folder."""
    project = tmp_path_factory.mktemp("walkthrough") / "kvplug-memcached"
    for name, text in walkthrough_files().items():
        path = project / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    meta = tomllib.loads((project / "pyproject.toml").read_text())["project"]
    info = project / "src" / f"{meta['name'].replace('-', '_')}-{meta['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {meta['name']}\nVersion: {meta['version']}\n"
    )
    (info / "entry_points.txt").write_text(
        "".join(
            f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in points.items())
            for group, points in meta["entry-points"].items()
        )
    )
    return project


def run_in(project: Path, argv: list[str]) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` in ``project`` with the walk-through's plugin installed."""
    path = [str(project / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    env.pop("KVPLUG_CONTRACT_URL", None)
    return subprocess.run(
        argv,
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=SUITE_LIMIT,
        check=False,
    )


def verdicts(summary: Path) -> dict[int, dict[str, Any]]:
    return {row["clause"]: row for row in json.loads(summary.read_text())}


def test_the_walkthrough_shows_a_whole_distribution_with_its_entry_point() -> None:
    files = walkthrough_files()
    assert set(files) == FILES
    meta = tomllib.loads(files["pyproject.toml"])["project"]
    assert meta["entry-points"]["kvplug"] == {"memcached": "kvplug_memcached.plugin"}
    assert any(need.startswith("pymemcache") for need in meta["dependencies"])


def test_the_walkthrough_backend_keeps_the_contract_through_the_fault_proxy(
    project: Path, tmp_path: Path
) -> None:
    summary = tmp_path / "summary.json"
    ini = tmp_path / "pytest.ini"
    ini.write_text("[pytest]\n")  # this repository's pytest settings stay out of the run
    with Memcached("-m", "1024", "-I", "128m") as server:
        run = run_in(
            project,
            [
                *(sys.executable, "-m", "pytest", "--pyargs", "kvplug_contracts"),
                *("-c", str(ini), "-p", "no:cacheprovider", "-v"),
                *("--kvplug-url", server.url, "--kvplug-proxy"),
                *("--kvplug-summary-json", str(summary)),
            ],
        )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    assert "backend 'memcached' from kvplug-memcached 0.1.0" in output, output
    rows = verdicts(summary)
    not_applicable = {8: "does not declare 'pin'", 14: "does not declare 'persistent'"}
    for number, row in rows.items():
        if number in not_applicable:
            assert row["verdict"] == "n/a", output
            assert any(not_applicable[number] in reason for reason in row["reasons"]), output
        elif number == 9:
            # A 1 GiB server holds everything the suite puts: filling it is the next test's,
            # and until it fills, the full-store test is honestly "not run".
            assert row["verdict"] in ("pass", "not run") and not row["failed"], output
        else:
            assert row["verdict"] == "pass", (number, output)
    assert rows[10]["passed"] >= 2 and not rows[10]["not run"], output


def test_the_walkthrough_capacity_tests_fill_small_servers(project: Path, tmp_path: Path) -> None:
    summary = tmp_path / "summary.json"
    ini = tmp_path / "pytest.ini"
    ini.write_text("[pytest]\n")
    run = run_in(
        project,
        [
            *(sys.executable, "-m", "pytest", "tests/test_capacity.py"),
            *("-c", str(ini), "--rootdir", str(project), "-p", "no:cacheprovider", "-v"),
            *("--kvplug-summary-json", str(summary)),
        ],
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    clause_9 = verdicts(summary)[9]
    assert clause_9["verdict"] == "pass" and clause_9["passed"] == 2, output
