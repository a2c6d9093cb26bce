"""Running work of a loop-bound backend on the event loop it belongs to.

A backend whose state (clients, tasks, asyncio primitives) belongs to the loop it was first
used on declares :attr:`~kvplug.backend.Backend.loop_bound`; the template then runs its hooks
there with :func:`run_on_home_loop`, also for callers on other loops and threads, and hands a
cancelled caller back its objects only once the work has ended on the home loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from kvplug.errors import BackendUnavailable
from kvplug.url import BackendURL

T = TypeVar("T")
HOME_POLL_SECONDS = 0.001
"""How often a cancelled call of a :attr:`~kvplug.backend.Backend.loop_bound` backend from
another loop looks whether the operation has ended on the backend's own loop."""


async def run_on_home_loop(
    url: BackendURL, home: asyncio.AbstractEventLoop, work: Coroutine[Any, Any, T]
) -> T:
    """Await ``work`` on ``home``, the loop the backend at ``url`` belongs to."""
    if home.is_closed() or not home.is_running():
        work.close()
        raise BackendUnavailable(
            f"{url} belongs to an event loop that is no longer running, so it cannot "
            "serve this one. Use a backend from the loop that first used it, or keep that "
            "loop running (kvplug.runtime.sync.SyncClient does)."
        )
    ended = threading.Event()

    async def tracked() -> T:
        try:
            return await work
        finally:
            ended.set()

    running = asyncio.run_coroutine_threadsafe(tracked(), home)
    try:
        return await asyncio.wrap_future(running)
    except asyncio.CancelledError:
        # The cancellation reaches the home loop's task later: the caller's objects are
        # handed back only once that task has ended (a cancelled get_into or put there
        # must not outlive the call), or once the home loop is gone.
        running.cancel()
        interrupted = None
        while not ended.is_set() and not home.is_closed():
            try:
                await asyncio.sleep(HOME_POLL_SECONDS)
            except asyncio.CancelledError as again:
                interrupted = again
        if interrupted is not None:
            raise interrupted from None
        raise


__all__ = ["HOME_POLL_SECONDS", "run_on_home_loop"]
