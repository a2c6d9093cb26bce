"""SyncClient leaves nothing pending when its loop goes away: at close(), tasks started while
it closes end (their clean-up runs) before the loop is closed; at interpreter exit, a client
still open is closed, so its in-flight work ends instead of being destroyed with a frozen
daemon thread. What asyncio says otherwise: "Task was destroyed but it is pending!" and, for
a task whose clean-up awaits, "coroutine ignored GeneratorExit"."""

from __future__ import annotations

import asyncio
import gc
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvplug.runtime import sync
from kvplug.runtime.sync import SyncClient

LOOP_WARNINGS = (
    "Task was destroyed",
    "ignored GeneratorExit",
    "was never awaited",
    "Exception ignored",
)
"""What asyncio and the interpreter print for work left behind on a loop that went away."""


def test_a_task_started_while_the_client_closes_ends_before_its_loop_closes(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(sync, "FINISH_SECONDS", 0.5)
    cleaned_up = threading.Event()

    async def started_late() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(0)  # clean-up that awaits, as a network client's does
            cleaned_up.set()

    async def in_flight() -> None:
        await asyncio.sleep(0.2)  # still running when close() stops the loop
        asyncio.get_running_loop().create_task(started_late())

    client = SyncClient("cpu://?max_size=1MiB")
    client.run(in_flight())
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        client.close()
        gc.collect()
    assert cleaned_up.is_set(), "the task started while closing was dropped with the loop"
    assert "Task was destroyed" not in caplog.text


def test_threads_of_the_loops_executor_end_with_the_client(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(sync, "FINISH_SECONDS", 0.5)
    before = set(threading.enumerate())
    client = SyncClient("cpu://?max_size=1MiB")
    assert client.run(asyncio.to_thread(time.sleep, 0.01)).result(10) is None
    client.close()
    assert [t.name for t in set(threading.enumerate()) - before if t.is_alive()] == []

    release = threading.Event()
    client = SyncClient("cpu://?max_size=1MiB")
    client.run(asyncio.to_thread(release.wait, 30))  # a blocking call that outlasts the close
    try:
        with caplog.at_level(logging.WARNING, logger="kvplug.sync"):
            started = time.monotonic()
            client.close()
        assert time.monotonic() - started < 10
        assert "executor was still running" in caplog.text
    finally:
        release.set()


EXITS_WITH_A_CLIENT_OPEN = """
import asyncio
import sys
from pathlib import Path

import kvplug
from kvplug import BackendSpec, CacheKey
from kvplug.runtime.sync import SyncClient
from kvplug_blackhole.backend import BlackholeBackend


class Stalls(BlackholeBackend):
    # A get that lasts until the backend closes (a read that close() cuts short), whose
    # clean-up awaits.
    async def _open(self) -> None:
        self.closing = asyncio.Event()

    async def _get(self, key):
        try:
            await self.closing.wait()
        finally:
            await asyncio.sleep(0)
            Path(sys.argv[1]).write_text("cleaned up")
        return None

    async def _close(self) -> None:
        self.closing.set()


kvplug.register_backend(BackendSpec("stalls", ("stalls",), "__main__:Stalls"))
client = SyncClient("stalls://")
in_flight = client.get(CacheKey("shutdown-test", 1, 0, 1))
print("exiting with the client open and a get in flight", flush=True)
"""


def test_a_client_left_open_is_closed_at_interpreter_exit(tmp_path: Path) -> None:
    script, marker = tmp_path / "exits.py", tmp_path / "cleaned"
    script.write_text(EXITS_WITH_A_CLIENT_OPEN)
    result = subprocess.run(
        [sys.executable, "-X", "dev", str(script), str(marker)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "exiting with the client open" in output, output
    assert marker.exists(), f"the get in flight never ended (no close at exit):\n{output}"
    for warning in LOOP_WARNINGS:
        assert warning not in output, output
