"""What every contract test uses: the clause table, the event-loop runner, test objects and
comparisons that explain a violation."""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import threading
import uuid
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Generic, NoReturn, TypeVar

import pytest
import torch

from kvplug import Backend, CacheKey, MemoryFormat, MemoryObj
from kvplug.memory import Allocator
from kvplug.runtime.store import layers

T = TypeVar("T")
Run = Callable[..., Any]
"""The ``run`` fixture: ``run(coroutine, timeout=None)`` awaits on the suite's loop."""

CLAUSES: dict[int, str] = {
    1: "a miss returns None",
    2: "get after put is bit-identical",
    3: "an overwrite replaces atomically; a reader never sees a mix",
    4: "batched_exists and batched_get are aligned; batched_contains counts the prefix",
    5: "put releases its reference; get returns an owned object; no leaks",
    6: "corrupt stored data reads as a miss, is counted and removed",
    7: "remove of an absent key is False; contains agrees with get",
    8: "pinned keys survive eviction; unpin always succeeds; pins expire",
    9: "a full store raises CapacityExceeded or evicts; reads keep working",
    10: "remote operations have deadlines and recover",
    11: "close is idempotent and bounded; later calls raise BackendClosed",
    12: "keys are isolated per namespace",
    13: "capabilities are honest",
    14: "persistent backends keep data across close and reopen",
    15: "safe under concurrency",
    16: "tenants never see each other's chunks",
}

DEFAULT_TIMEOUT = 10.0
"""Seconds one backend operation of the suite may take (``--kvplug-timeout``)."""

WEDGE_PROBE = 2.0
"""After an operation overran its budget: seconds the loop gets to run a no-op callback before
the suite takes it for blocked (a hook called ``time.sleep`` or another blocking function)."""

CANCEL_GRACE = 2.0
"""After the suite cancelled an operation that overran its budget (or a task still running on
a loop it closes): seconds the task gets to unwind before the suite takes it for one that
ignores cancellation."""

MAX_ABANDONED_LOOPS = 5
"""After the backend blocked this many event loops, the suite runs no more of its operations:
the remaining tests are ``not run`` instead of each waiting out its budget."""

EXECUTOR_THREADS = "kvplug-contract-executor"
"""Name prefix of the threads of the default executor of the suite's event loop (what
``asyncio.to_thread``, ``run_in_executor(None, ...)`` and ``getaddrinfo`` run on): the loop
keeps them from one test to the next and shuts them down when it closes."""

UNFINISHED: list[asyncio.Task[Any]] = []
"""Tasks that were still pending when the suite gave up on them (their test failed, naming
them): kept here so that they are never garbage collected, which asyncio would report as "Task
was destroyed but it is pending!" in whichever later test happened to collect them."""

NOT_APPLICABLE = "not applicable: "
NOT_RUN = "not run: "


def clause(*numbers: int, central: bool = False) -> pytest.MarkDecorator:
    """Mark a contract test with the clause numbers it checks.

    ``central=True``: the clauses' verdicts rest on this test. When every central test of a
    clause was skipped as n/a the clause is ``n/a``; when one of them did not run (skipped with
    :func:`not_run`, or deselected) the clause is ``not run``, never ``pass``::

        @clause(9, central=True)
        def test_a_full_store_evicts_or_raises_capacity_exceeded(self, ...): ...
    """
    for number in numbers:
        if number not in CLAUSES:
            raise ValueError(f"there is no contract clause {number}")
    return pytest.mark.kvplug_clause(*numbers, central=central)


def violated(number: int, message: str) -> NoReturn:
    """Fail the running test, naming the clause and what was seen."""
    pytest.fail(f"clause {number} ({CLAUSES[number]}) violated: {message}", pytrace=False)


def not_applicable(reason: str) -> NoReturn:
    """Skip a test whose clause legitimately does not apply to this backend, such as a
    capability it does not declare (reported as ``n/a`` with ``reason``)."""
    pytest.skip(f"{NOT_APPLICABLE}{reason}")


def not_run(reason: str) -> NoReturn:
    """Skip a test that applies but that the suite could not run, such as a capacity test
    without options that make the store small (reported as ``not run``, never as a pass);
    ``reason`` says how to enable it."""
    pytest.skip(f"{NOT_RUN}{reason}")


@dataclass
class RunningTest:
    """What the suite is running now, for messages: the plugin sets ``clause`` to the first
    clause of each contract test as it starts."""

    clause: int | None = None


RUNNING = RunningTest()


class ContractTimeout(AssertionError):
    """An operation did not finish within the suite's own time limit. Its message names the
    clause of the running test (as :func:`violated` does), the operation and its key."""


def describe_step(coroutine: Coroutine[Any, Any, Any]) -> str:
    """What ``coroutine`` (not yet started) does, for a timeout message: a backend operation
    with its key (``get of model@1@0@7@half``), or the test's step by name."""
    name = getattr(coroutine, "__name__", "step")
    frame = getattr(coroutine, "cr_frame", None)
    arguments: dict[str, Any] = dict(frame.f_locals) if frame is not None else {}
    if not isinstance(arguments.get("self"), Backend):
        return f"the step {getattr(coroutine, '__qualname__', name)}()"
    if isinstance(arguments.get("key"), CacheKey):
        return f"{name} of {arguments['key']}"
    keys = arguments.get("keys")
    if isinstance(keys, Sequence) and keys:
        return f"{name} of {len(keys)} key(s) from {keys[0]}"
    return f"{name} of {arguments['self'].url}"


def _closing(coroutine: Coroutine[Any, Any, Any]) -> Backend | None:
    """The backend that ``coroutine`` closes, when it is a ``close()``."""
    frame = getattr(coroutine, "cr_frame", None)
    owner = frame.f_locals.get("self") if frame is not None else None
    is_close = getattr(coroutine, "__name__", "") == "close"
    return owner if is_close and isinstance(owner, Backend) else None


class Step(Generic[T]):
    """A coroutine run as a task on a loop of another thread, as the calling thread sees it:
    ``result`` is done once the task is, so the caller can tell a cancelled task that is still
    unwinding from one that ended."""

    def __init__(self, coroutine: Coroutine[Any, Any, T], loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.result: concurrent.futures.Future[T] = concurrent.futures.Future()
        self.task: asyncio.Task[T] | None = None
        loop.call_soon_threadsafe(self._start, coroutine)

    def _start(self, coroutine: Coroutine[Any, Any, T]) -> None:
        self.task = self.loop.create_task(coroutine)
        self.task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[T]) -> None:
        if task.cancelled():
            self.result.cancel()
        elif (error := task.exception()) is not None:
            self.result.set_exception(error)
        else:
            self.result.set_result(task.result())

    def cancel(self) -> None:
        """Cancel the task (from any thread; it starts before the cancel reaches it)."""
        self.loop.call_soon_threadsafe(self._cancel)

    def _cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()

    def ended(self, wait: float) -> bool:
        """Whether the task ended (or ends within ``wait`` seconds)."""
        done, _ = concurrent.futures.wait([self.result], timeout=wait)
        return bool(done)


def _serve(loop: asyncio.AbstractEventLoop, executor: concurrent.futures.Executor) -> None:
    """A loop thread: run ``loop`` until it is stopped, then cancel the tasks still pending on
    it, let them unwind for :data:`CANCEL_GRACE` seconds, and close it. A loop left stopped with
    tasks pending gets them garbage collected during some later test, which asyncio reports
    there as "Task was destroyed but it is pending!" (also once an abandoned loop's thread comes
    free, minutes later)."""
    try:
        loop.run_forever()
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.wait(pending, timeout=CANCEL_GRACE))
        for task in pending:
            if not task.done():
                UNFINISHED.append(task)
            elif not task.cancelled():
                task.exception()  # its test failed already; asyncio need not log it again
        loop.run_until_complete(loop.shutdown_asyncgens())
    finally:
        executor.shutdown(wait=False, cancel_futures=True)
        loop.close()


class LoopRunner:
    """One event loop on its own thread. Tests stay synchronous: ``run(coro)`` waits for the
    result within a per-operation budget, so a backend that hangs fails the test, naming the
    clause, the operation and its key, instead of hanging the suite; the late operation is
    cancelled and awaited before the test goes on. A backend that blocks the loop's thread
    (``time.sleep`` in a hook) fails its test too; the suite then leaves that loop behind and
    goes on with a new one, so the rest of the session is not wedged; the loop left behind
    cancels its tasks and closes once its thread comes free."""

    def __init__(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.timeout = timeout
        self.abandoned_loops = 0
        self.blocking_closers: set[type[Backend]] = set()
        """Backend classes whose close blocked the loop: the suite stops closing them."""
        self.threads: list[threading.Thread] = []
        """The thread of every loop this runner started, those left behind included."""
        self.loop = self._start_loop()

    def _start_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.new_event_loop()
        executor = concurrent.futures.ThreadPoolExecutor(thread_name_prefix=EXECUTOR_THREADS)
        loop.set_default_executor(executor)
        self._thread = threading.Thread(
            target=_serve, args=(loop, executor), name="kvplug-contract-loop", daemon=True
        )
        self._thread.start()
        self.threads.append(self._thread)
        return loop

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> Step[T]:
        """Start ``coroutine`` as a task on the loop."""
        return Step(coroutine, self.loop)

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Await ``coroutine`` on the loop; :class:`ContractTimeout` after ``timeout`` seconds
        (default: the per-operation budget, ``--kvplug-timeout``), once the late task was
        cancelled and had :data:`CANCEL_GRACE` seconds to unwind."""
        if self.gave_up:
            coroutine.close()
            not_run(
                f"the backend blocked the suite's event loop {self.abandoned_loops} times (see "
                "the first failures), so the suite runs none of its operations any more"
            )
        limit = self.timeout if timeout is None else timeout
        what = describe_step(coroutine)
        closing = _closing(coroutine)
        step = self.submit(coroutine)
        try:
            return step.result.result(limit)
        except concurrent.futures.TimeoutError:
            step.cancel()
        message = f"{what} did not finish within {limit:g} s (the suite's budget for one " + (
            "operation; change it with --kvplug-timeout)"
            if timeout is None
            else "step of this test)"
        )
        if not self.responsive():  # the probe runs after the cancel: the loop is blocked
            self._replace_loop()
            if closing is not None:
                self.blocking_closers.add(type(closing))
            message += (
                f"; the event loop then stayed blocked for {WEDGE_PROBE:g} s more: a hook "
                "blocks the loop's thread (time.sleep, a synchronous join or socket call); "
                "run blocking work in a thread (asyncio.to_thread). The suite left that "
                "loop behind and goes on with a new one"
            )
        elif not step.ended(CANCEL_GRACE):
            message += (
                f"; cancelled then, it still ran {CANCEL_GRACE:g} s later: a hook catches "
                "CancelledError, or waits where cancellation does not reach it"
            )
        number = RUNNING.clause
        if number is not None:
            message = f"clause {number} ({CLAUSES[number]}) violated: {message}"
        raise ContractTimeout(message)

    @property
    def gave_up(self) -> bool:
        """Whether the backend blocked so many loops that the suite stopped running it."""
        return self.abandoned_loops >= MAX_ABANDONED_LOOPS

    def responsive(self, wait: float = WEDGE_PROBE) -> bool:
        """Whether the loop runs a no-op callback within ``wait`` seconds."""
        ran = threading.Event()
        try:
            self.loop.call_soon_threadsafe(ran.set)
        except RuntimeError:  # the loop is closed
            return False
        return ran.wait(wait)

    def pending_tasks(self, wait: float = WEDGE_PROBE) -> set[asyncio.Task[Any]] | None:
        """The tasks not done on the loop, read on the loop's own thread; None when the loop
        does not answer within ``wait`` seconds (something blocks its thread)."""
        found: set[asyncio.Task[Any]] = set()
        answered = threading.Event()

        def read() -> None:
            found.update(asyncio.all_tasks(self.loop))
            answered.set()

        try:
            self.loop.call_soon_threadsafe(read)
        except RuntimeError:  # the loop is closed
            return None
        return found if answered.wait(wait) else None

    def _replace_loop(self) -> None:
        """Leave the blocked loop to stop, cancel its tasks and close by itself once its
        thread is free again."""
        blocked = self.loop
        blocked.call_soon_threadsafe(blocked.stop)
        self.abandoned_loops += 1
        self.loop = self._start_loop()

    def close(self) -> None:
        """Stop the loop; its thread cancels what still runs there and closes it."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(CANCEL_GRACE + WEDGE_PROBE)


class Keyspace:
    """Keys in a namespace of their own, so tests never see each other's data (also on a
    server shared by several runs)."""

    def __init__(self, label: str) -> None:
        digest = hashlib.sha1(label.encode()).hexdigest()[:8]
        self.model = f"kvplug-contract/{digest}-{uuid.uuid4().hex[:12]}"

    def key(self, n: int, *, worker_id: int = 0, world_size: int = 1, **tags: str) -> CacheKey:
        return CacheKey(self.model, world_size, worker_id, n, tags=tuple(tags.items()))

    def keys(self, count: int, start: int = 0) -> list[CacheKey]:
        return [self.key(n) for n in range(start, start + count)]


def make_obj(
    allocator: Allocator,
    shape: Sequence[int],
    dtype: torch.dtype = torch.float16,
    fmt: MemoryFormat = MemoryFormat.KV_2LTD,
    seed: int = 0,
) -> MemoryObj:
    """A new object filled with seeded random bytes (every bit pattern, NaNs included)."""
    obj = allocator.allocate(shape, dtype, fmt)
    if obj is None:
        raise RuntimeError(
            f"the suite's allocator has no room for {tuple(shape)} {dtype}: an earlier step "
            "leaked objects, or the shape is larger than the allocator"
        )
    generator = torch.Generator().manual_seed(seed)
    obj.raw.copy_(torch.randint(0, 256, (obj.nbytes,), dtype=torch.uint8, generator=generator))
    return obj


def difference(expected: MemoryObj, got: MemoryObj) -> str | None:
    """How ``got`` differs from ``expected`` (shape, dtype, format, bytes), or None."""
    if got.shape != expected.shape:
        return f"shape {got.shape}, expected {expected.shape}"
    if got.dtype != expected.dtype:
        return f"dtype {got.dtype}, expected {expected.dtype}"
    if got.fmt != expected.fmt:
        return f"format {got.fmt.name}, expected {expected.fmt.name}"
    got_bytes = got.raw.cpu()
    expected_bytes = expected.raw.cpu()
    if not torch.equal(got_bytes, expected_bytes):
        mismatch = (got_bytes != expected_bytes).nonzero()
        first = int(mismatch[0])
        return (
            f"{len(mismatch)} of {expected.nbytes} bytes differ; first at byte {first}: "
            f"got {int(got_bytes[first])}, expected {int(expected_bytes[first])}"
        )
    return None


def check_same(number: int, expected: MemoryObj, got: MemoryObj | None, what: str) -> None:
    """Fail under clause ``number`` unless ``got`` is bit-identical to ``expected``."""
    if got is None:
        violated(number, f"{what}: get returned None (a miss), expected the stored object")
    problem = difference(expected, got)
    if problem is not None:
        violated(number, f"{what}: {problem}")


def innermost(backend: Backend) -> Backend:
    """The backend at the bottom of a ``wrapper::...::url`` chain."""
    return layers(backend)[-1]


def release_all(objs: Sequence[MemoryObj | None]) -> None:
    for obj in objs:
        if obj is not None:
            obj.release()


__all__ = [
    "CANCEL_GRACE",
    "CLAUSES",
    "EXECUTOR_THREADS",
    "MAX_ABANDONED_LOOPS",
    "WEDGE_PROBE",
    "ContractTimeout",
    "Keyspace",
    "LoopRunner",
    "Run",
    "Step",
    "check_same",
    "clause",
    "difference",
    "innermost",
    "layers",
    "make_obj",
    "not_applicable",
    "not_run",
    "release_all",
    "violated",
]
