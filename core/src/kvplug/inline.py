"""Running a backend operation to its end on the calling thread, without an event loop, and
knowing for certain when it needed one.

A backend that declares :attr:`~kvplug.backend.Backend.runs_inline` (``cpu://``) promises that
its operations never wait. :class:`~kvplug.runtime.sync.SyncClient` then runs each operation on
the engine's thread with :func:`run_inline` instead of handing it to its IO thread and back
(about 100 µs a call). An operation that waits after all must fail clearly, and kvplug's own
code tells that it waited; no exception's text is read:

* While the coroutine is stepped, the thread's running event loop is :data:`NO_LOOP`, kvplug's
  stand-in, set with ``asyncio._set_running_loop`` (the hook asyncio gives event loops to
  declare themselves running) and restored afterwards, so a caller's own loop is untouched.
  Whatever needs a loop asks the running loop for it (``asyncio.sleep`` for a future, a lock or
  an event under contention, ``gather``, ``to_thread``, ``asyncio.timeout``), and
  :data:`NO_LOOP` answers every such request by raising :class:`NeededALoop`.
* Whatever suspends yields to the stepper: the coroutine did not finish in one step, so it
  waited. It is closed where it stands (its ``finally`` clauses run, still under
  :data:`NO_LOOP`) and :class:`NeededALoop` is raised.

The template keeps to this too: a hook that waits while stepped inline gets no deadline timer
(:mod:`kvplug.deadline`); its wait reaches the stepper.

Not detected as such: an asyncio helper that asks only for the current task
(``asyncio.timeout_at`` on entry, ``asyncio.TaskGroup``) finds none and raises its own
``RuntimeError``, which the template reports as an unexpected error of the backend.

Example::

    >>> import asyncio
    >>> async def adds(a: int, b: int) -> int:
    ...     return a + b
    >>> run_inline(adds(1, 2))
    3
    >>> async def sleeps() -> None:
    ...     await asyncio.sleep(0.01)
    >>> try:
    ...     run_inline(sleeps())
    ... except NeededALoop as waited:
    ...     print(waited)
    it asked the event loop for create_future
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any, TypeVar, cast

T = TypeVar("T")


class NeededALoop(BaseException):
    """An operation run by :func:`run_inline` waited, or asked for an event loop. A
    ``BaseException``, as ``asyncio.CancelledError`` is, so that a hook's ``except Exception``
    cannot swallow it and carry on as if its wait had worked."""


_LOOP_NAMES = frozenset(
    name for name in dir(asyncio.SelectorEventLoop) if not name.startswith("__")
)
"""What code may ask of an event loop: the methods and workings of asyncio's own loops."""


class _NoLoop:
    """The running loop while an operation is stepped inline: every request for what an event
    loop has raises :class:`NeededALoop`, naming it; any other name is missing, as on a loop
    (so that tools probing objects for attributes of their own see a plain object)."""

    __slots__ = ()

    def __getattribute__(self, name: str) -> Any:
        if name in _LOOP_NAMES:
            raise NeededALoop(f"it asked the event loop for {name}")
        return object.__getattribute__(self, name)

    def __repr__(self) -> str:
        return "<kvplug.inline.NO_LOOP>"


NO_LOOP = cast(asyncio.AbstractEventLoop, _NoLoop())
"""The running event loop while :func:`run_inline` steps an operation."""


def running_loop() -> asyncio.AbstractEventLoop:
    """The running event loop, for code that keeps it (a loop-bound backend's home); raises
    :class:`NeededALoop` while stepped inline, where there is none to keep."""
    loop = asyncio.get_running_loop()
    if loop is NO_LOOP:
        raise NeededALoop("it needs the event loop it runs on")
    return loop


def run_inline(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run ``coroutine`` to its end on this thread in one step and return its result; raise
    :class:`NeededALoop` when it waited or asked for an event loop (closed, then, where it
    stood), and its own exception when it raised one."""
    previous = asyncio._get_running_loop()
    asyncio._set_running_loop(NO_LOOP)
    try:
        try:
            awaited = coroutine.send(None)
        except StopIteration as done:
            return cast(T, done.value)
        with contextlib.suppress(NeededALoop):  # its clean-up asked for the loop too
            coroutine.close()
        if awaited is None:
            raise NeededALoop("it yielded to the event loop (as asyncio.sleep(0) does)")
        raise NeededALoop(f"it awaited a {type(awaited).__name__}, which suspends")
    finally:
        asyncio._set_running_loop(previous)


__all__ = ["NO_LOOP", "NeededALoop", "run_inline", "running_loop"]
