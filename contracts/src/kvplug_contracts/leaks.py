"""The check that ends every contract test: nothing the test started is left running.

The check is the first function-scoped fixture of a contract test, so it looks after the test
and the close of every backend the test opened, and before the fixtures of a class, module or
session scope (a server the vendor started for many tests) are torn down. It compares with a
snapshot taken when the test started, after those wider fixtures were set up, and reports what
is new and still there:

* asyncio tasks pending on the suite's event loop;
* threads (``threading.enumerate()``) still running;
* child processes of this process (and their children) still there, zombies included;
* TCP ports this process listens on.

What is finishing gets :data:`LEAK_GRACE` seconds, polled, so a busy machine does not turn a
thread that is joining into a finding. Not counted as left behind:

* the suite's own loop threads (also those of loops it left behind because a hook blocked them,
  a failure reported already) and the threads of their default executor
  (:data:`~kvplug_contracts.support.EXECUTOR_THREADS`), which the loop keeps between tests;
* a thread or child process that stands in for one that existed before the test and has since
  ended: a thread of the same name, a process of the same command line (a ``server_control``
  that stopped and restarted the server);
* threads whose name starts with an allowed prefix: ``--kvplug-allow-thread PREFIX``, the
  ``kvplug_allowed_threads`` ini option, or ``@pytest.mark.kvplug_allow_threads(PREFIX, ...)``
  on the test or its class, for a client library that keeps a thread by design;
* threads Python did not start (``threading._DummyThread``: a native library's thread that
  called into Python), whose end Python cannot see;
* tasks on a loop that a hook blocked during the test, and every task once the suite stopped
  running the backend (:attr:`~kvplug_contracts.support.LoopRunner.gave_up`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import psutil
import pytest

from kvplug_contracts.support import EXECUTOR_THREADS, UNFINISHED, LoopRunner, violated

LEAK_GRACE = 5.0
"""Seconds what a test left behind gets to finish before the check reports it."""
POLL = 0.1
"""Seconds between two looks while something is left."""
SHOWN = 5
"""Leaks of one kind named in a message; the rest are counted."""
ALLOW_OPTION = "--kvplug-allow-thread"
ALLOW_INI = "kvplug_allowed_threads"
ALLOW_MARKER = "kvplug_allow_threads"

T = TypeVar("T")


def allowed_thread_prefixes(item: pytest.Item) -> tuple[str, ...]:
    """The thread-name prefixes allowed to outlive ``item``: the command line's, the ini
    file's and those of its ``kvplug_allow_threads`` markers."""
    config = item.config
    prefixes = [*config.getoption(ALLOW_OPTION), *config.getini(ALLOW_INI)]
    for marker in item.iter_markers(ALLOW_MARKER):
        prefixes += [str(prefix) for prefix in marker.args]
    return tuple(prefix for prefix in prefixes if prefix)


def _command(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline()) or process.name()
    except psutil.Error:
        return ""


def _children() -> dict[psutil.Process, str]:
    """Every descendant of this process, with its command line."""
    return {child: _command(child) for child in psutil.Process().children(recursive=True)}


def _listening() -> set[tuple[str, int]]:
    """The TCP addresses this process listens on."""
    process = psutil.Process()
    # psutil before 6.0 (kvplug needs 5.9) names it connections().
    connections = getattr(process, "net_connections", process.connections)(kind="tcp")
    return {(c.laddr.ip, c.laddr.port) for c in connections if c.status == psutil.CONN_LISTEN}


def _running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@dataclass(frozen=True)
class Snapshot:
    """What was running when the test started."""

    loop: asyncio.AbstractEventLoop
    tasks: set[asyncio.Task[object]]
    threads: set[threading.Thread]
    children: dict[psutil.Process, str]
    listening: set[tuple[str, int]]


@dataclass
class Found:
    """What a test left behind, by kind."""

    tasks: list[asyncio.Task[object]]
    threads: list[threading.Thread]
    children: list[psutil.Process]
    listening: list[tuple[str, int]]
    blocked: bool = False
    """The suite's loop did not answer: a callback or task blocks its thread."""

    def __bool__(self) -> bool:
        return bool(self.tasks or self.threads or self.children or self.listening or self.blocked)

    def describe(self) -> str:
        parts = []
        if self.blocked:
            parts.append(
                "the suite's event loop, which does not answer (a callback or task left running "
                "blocks its thread)"
            )
        parts += [
            _listed("asyncio task(s) still pending on the suite's event loop", self.tasks, repr),
            _listed("thread(s) still running", self.threads, _thread),
            _listed("child process(es) still there", self.children, _process),
            _listed("port(s) still listening", self.listening, _address),
        ]
        return "; ".join(part for part in parts if part)


def _listed(what: str, things: Sequence[T], show: Callable[[T], str]) -> str:
    if not things:
        return ""
    names = [show(thing)[:300] for thing in things[:SHOWN]]
    more = f" and {len(things) - SHOWN} more" if len(things) > SHOWN else ""
    return f"{len(things)} {what}: {', '.join(names)}{more}"


def _thread(thread: threading.Thread) -> str:
    kind = "daemon" if thread.daemon else "not a daemon"
    return f"{thread.name!r} ({kind}, native id {thread.native_id})"


def _address(address: tuple[str, int]) -> str:
    return f"{address[0]}:{address[1]}"


def _process(process: psutil.Process) -> str:
    try:
        zombie = process.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        zombie = False
    state = ", a zombie: it exited and nothing waited for it" if zombie else ""
    return f"pid {process.pid} ({_command(process) or 'command line unknown'}{state})"


class LeakCheck:
    """Takes the snapshot when a test starts; :meth:`check` fails the test (clause 11) naming
    what it left behind."""

    def __init__(self, runner: LoopRunner, allowed: tuple[str, ...]) -> None:
        self.runner = runner
        self.allowed = allowed
        self.abandoned = runner.abandoned_loops
        self.before = Snapshot(
            loop=runner.loop,
            tasks=runner.pending_tasks() or set(),
            threads=set(threading.enumerate()),
            children=_children(),
            listening=_listening(),
        )

    def left_behind(self, grace: float) -> Found:
        """What the test left, once it had ``grace`` seconds to finish."""
        deadline = time.monotonic() + grace
        while True:
            found = self._look()
            if not found or time.monotonic() >= deadline:
                return found
            time.sleep(POLL)

    def check(self) -> None:
        """Fail the running test (a clause-11 violation) when it left something behind
        :data:`LEAK_GRACE` seconds after it ended."""
        grace = LEAK_GRACE
        found = self.left_behind(grace)
        if not found:
            return
        UNFINISHED.extend(found.tasks)  # never collected during a later test (see UNFINISHED)
        violated(
            11,
            f"{grace:g} s after the test ended and every backend it opened was closed, it left "
            f"behind {found.describe()}. A backend's close must stop what the backend started: "
            "cancel and await its tasks, join its threads, wait for its child processes, close "
            "its listening sockets. For a thread that a client library keeps by design, allow "
            f"its name prefix: {ALLOW_OPTION} PREFIX, the {ALLOW_INI} ini option, or "
            f"@pytest.mark.{ALLOW_MARKER}(PREFIX) on the contract class",
        )

    def _look(self) -> Found:
        tasks, blocked = self._tasks()
        return Found(
            tasks=tasks,
            threads=self._threads(),
            children=self._children(),
            listening=sorted(_listening() - self.before.listening),
            blocked=blocked,
        )

    def _tasks(self) -> tuple[list[asyncio.Task[object]], bool]:
        runner = self.runner
        if runner.gave_up or runner.abandoned_loops != self.abandoned:
            return [], False  # a hook blocked a loop: that failure is reported already
        pending = runner.pending_tasks()
        if pending is None:
            return [], True
        if runner.loop is self.before.loop:
            pending -= self.before.tasks
        return sorted(pending, key=lambda task: task.get_name()), False

    def _threads(self) -> list[threading.Thread]:
        ended = {thread.name for thread in self.before.threads if not thread.is_alive()}
        owned = set(self.runner.threads)
        allowed = (EXECUTOR_THREADS, *self.allowed)
        return [
            thread
            for thread in threading.enumerate()
            if thread not in self.before.threads
            and thread not in owned
            and thread.is_alive()
            and not isinstance(thread, threading._DummyThread)
            and not thread.name.startswith(allowed)
            and thread.name not in ended
        ]

    def _children(self) -> list[psutil.Process]:
        before = self.before.children
        restarted = {command for process, command in before.items() if not _running(process)}
        return [
            process
            for process, command in _children().items()
            if process not in before and not (command and command in restarted)
        ]


@dataclass
class LeakTally:
    """How many contract tests the check looked at, which left something behind, and the
    thread-name prefixes it allowed: a line of the clause summary."""

    checked: int = 0
    leaking: list[str] = field(default_factory=list)
    allowed: set[str] = field(default_factory=set)

    def line(self) -> str | None:
        if not self.checked:
            return None
        what = "asyncio tasks, threads, child processes and listening ports"
        if self.leaking:
            text = (
                f"leak check: {len(self.leaking)} of {self.checked} contract test(s) left "
                f"something behind (their errors name it; {what} checked)"
            )
        else:
            text = f"leak check: {self.checked} contract test(s) left nothing behind ({what})"
        if self.allowed:
            text += f"; threads allowed by name prefix: {', '.join(sorted(self.allowed))}"
        return text
