"""The deadline of one hook call, armed only once the hook waits.

A timer per call costs more than a whole in-memory operation, and only a hook that waits can
overrun. So the template steps a hook once by hand (``coroutine.send(None)``): a hook that
finishes in that step needs no deadline; one that waits is handed here, with what it waits on,
and :func:`finish_within` arms the deadline and continues it in the caller's task
(:class:`Resumed`), as ``await hook(...)`` would have.

Example::

    >>> import asyncio
    >>> async def slow() -> str:
    ...     await asyncio.sleep(1)
    ...     return "done"
    >>> async def demo() -> str:
    ...     hook = slow()
    ...     waits_on = hook.send(None)  # the first step: it waits
    ...     try:
    ...         return await finish_within(hook, waits_on, 0.01, lambda: TimeoutError("late"))
    ...     except TimeoutError as error:
    ...         return str(error)
    >>> asyncio.run(demo())
    'late'
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Generator
from typing import Any, Generic, TypeVar, cast

from kvplug.inline import NO_LOOP

T = TypeVar("T")


class Resumed(Generic[T]):
    """The rest of a coroutine that was stepped once by hand and is waiting on ``awaited``:
    awaiting this continues it in the current task, as ``await coroutine`` would have."""

    __slots__ = ("_awaited", "_coroutine")

    def __init__(self, coroutine: Coroutine[Any, Any, T], awaited: Any) -> None:
        self._coroutine = coroutine
        self._awaited = awaited

    def __await__(self) -> Generator[Any, Any, T]:
        coroutine, awaited = self._coroutine, self._awaited
        while True:
            try:
                sent = yield awaited
            except GeneratorExit:
                coroutine.close()
                raise
            except BaseException as error:
                try:
                    awaited = coroutine.throw(error)
                except StopIteration as done:
                    return cast(T, done.value)
            else:
                try:
                    awaited = coroutine.send(sent)
                except StopIteration as done:
                    return cast(T, done.value)


async def finish_within(
    coroutine: Coroutine[Any, Any, T],
    awaited: Any,
    limit: float,
    expired: Callable[[], BaseException],
) -> T:
    """The result of ``coroutine``, stepped once and now waiting on ``awaited``, within
    ``limit`` seconds from now; past them it is cancelled and ``expired()`` is raised. A
    ``TimeoutError`` of the coroutine's own passes as it is.

    Stepped inline (:mod:`kvplug.inline`) there is no loop to keep time: the wait goes on to
    the stepper, which reports it."""
    rest = Resumed(coroutine, awaited)
    loop = asyncio.get_running_loop()
    if loop is NO_LOOP:
        return await rest
    deadline = asyncio.timeout_at(loop.time() + limit)
    try:
        async with deadline:
            return await rest
    except TimeoutError:
        if not deadline.expired():
            raise
        raise expired() from None


__all__ = ["Resumed", "finish_within"]
