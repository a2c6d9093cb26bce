"""What every server process of :mod:`kvplug_testing` shares: the contract suite's
``ServerControl`` over a subprocess (``pause``, ``resume``, ``stop``; ``start`` is the
server's own), its log, the context manager, and the kill of every process still running when
the interpreter exits."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Self

_live: set[subprocess.Popen[bytes]] = set()
"""Every process started and not yet stopped: killed when the interpreter exits."""


PR_SET_PDEATHSIG = 1


def die_with_this_process() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the kernel kill the child (SIGKILL) when this process dies,
    also by a signal that skips ``atexit`` (a CI timeout's SIGTERM, SIGKILL), so no test
    server outlives its test run; None off Linux, and on threads other than the main one,
    since the kernel sends that signal when the *thread* that started the child ends."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not (
        threading.main_thread()
    ):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before the line above
            os._exit(1)

    return arm


def start_process(argv: Sequence[str], cwd: Path, log: IO[bytes]) -> subprocess.Popen[bytes]:
    """``argv`` started in ``cwd`` with its output to ``log``, killed with this process."""
    return subprocess.Popen(
        list(argv),
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        preexec_fn=die_with_this_process(),
    )


@atexit.register
def _kill_leftovers() -> None:
    for process in list(_live):
        with contextlib.suppress(OSError):
            process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(5)


class ControlledProcess:
    """One subprocess at a time (:attr:`process`) with its working directory
    (:attr:`workdir`, where its log is): the subclass's :meth:`start` launches it through
    :meth:`launched` and returns once it answers; it is paused, resumed or killed here. As a
    context manager it is started on entry (closed if the start fails) and closed on exit."""

    process: subprocess.Popen[bytes] | None = None
    paused: bool = False
    workdir: Path

    def start(self) -> None:
        """Start the process and return once it answers (ServerControl.start)."""
        raise NotImplementedError

    def close(self) -> None:
        """Kill the process and remove its working directory."""
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def launch_until(
        self, argv: Sequence[str], ready: Callable[[], bool], timeout: float, what: str
    ) -> None:
        """Start ``argv`` in :attr:`workdir` (its output to :attr:`log_path`) and return once
        ``ready()``; when the process exits first or ``timeout`` seconds pass, kill it and
        raise RuntimeError saying it did not ``what`` (``"listen on 127.0.0.1:5"``), with
        the end of its log."""
        with self.log_path.open("ab") as log:
            process = self.launched(start_process(argv, self.workdir, log))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and process.poll() is None:
            if ready():
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(
            f"{argv[0]} did not {what} within {timeout} s; its log ends with:\n{self.log_tail()}"
        )

    @property
    def log_path(self) -> Path:
        return self.workdir / "server.log"

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.close()  # a failed start leaves no working directory behind
            raise
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def launched(self, process: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
        """Adopt a process just started (killed at exit if nothing stops it first)."""
        self.process = process
        self.paused = False
        _live.add(process)
        return process

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        """Kill the process (SIGKILL, also when paused); :meth:`start` brings it back on the
        same port (ServerControl.stop)."""
        process, self.process = self.process, None
        self.paused = False
        if process is None:
            return
        with contextlib.suppress(OSError):
            process.kill()
        try:
            process.wait(10)
        finally:
            _live.discard(process)

    def terminate(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (a graceful shutdown) and wait for the exit; the exit code."""
        process, self.process = self.process, None
        self.paused = False
        if process is None:
            return None
        process.send_signal(signal.SIGTERM)
        try:
            return process.wait(timeout)
        finally:
            _live.discard(process)

    def pause(self) -> None:
        """SIGSTOP: the process keeps its port and connections but answers nothing."""
        if self.process is not None and self.running:
            self.process.send_signal(signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        """SIGCONT: undo :meth:`pause`."""
        if self.process is not None and self.running:
            self.process.send_signal(signal.SIGCONT)
            self.paused = False


__all__ = ["ControlledProcess"]
