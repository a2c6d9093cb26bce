"""Threads in tests: an event loop on a thread of its own, and a check that a block of a test
leaves no thread behind.

Example::

    with no_thread_left_behind(), loop_thread("engine-loop") as loop:
        asyncio.run_coroutine_threadsafe(backend.contains(key), loop).result(5)
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from kvplug.runtime.sync import close_io_loop, new_io_loop

JOIN_TIMEOUT = 10.0
"""Seconds :func:`loop_thread` waits for its thread to end once its loop was stopped."""


@contextmanager
def loop_thread(name: str = "test-loop") -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop running on a thread of its own (as an engine's storage manager runs
    one); at the end it is stopped, its thread joined and the loop closed."""
    loop, executor = new_io_loop()
    thread = threading.Thread(target=loop.run_forever, name=name, daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(JOIN_TIMEOUT)
        if not thread.is_alive():
            close_io_loop(loop, executor)


@contextmanager
def no_thread_left_behind(grace: float = 5.0) -> Iterator[None]:
    """Fails when a thread started inside the block (an IO thread, a file I/O worker) still
    runs ``grace`` seconds after it: a job reported failed must not leave work going on."""
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + grace
    while (left := set(threading.enumerate()) - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"threads left running: {sorted(t.name for t in left)}"


__all__ = ["JOIN_TIMEOUT", "loop_thread", "no_thread_left_behind"]
