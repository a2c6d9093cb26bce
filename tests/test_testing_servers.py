"""kvplug_testing's servers never outlive the test process that started them."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

START_AND_WAIT = """
import time
from kvplug_testing import RedisServer
server = RedisServer()
server.start()
print(server.process.pid, server.workdir, flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for a parent that never reaps does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_a_server_dies_with_a_test_process_killed_without_running_atexit(
    how: signal.Signals,
) -> None:
    runner = subprocess.Popen(
        [sys.executable, "-c", START_AND_WAIT], stdout=subprocess.PIPE, text=True
    )
    assert runner.stdout is not None
    pid_text, workdir = runner.stdout.readline().split()
    pid = int(pid_text)
    try:
        assert _alive(pid), "the server did not start"
        os.kill(runner.pid, how)
        runner.wait(10)
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid), "the redis-server outlived the process that started it"
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(workdir, ignore_errors=True)
