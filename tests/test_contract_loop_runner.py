"""The contract suite's event-loop runner (``kvplug_contracts.support.LoopRunner``): what a
step that overruns its budget, a loop that a hook blocks, or the end of the session leaves
running (issue 34: nothing)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
import time
from collections.abc import Iterator

import pytest

from kvplug_contracts.support import WEDGE_PROBE, ContractTimeout, LoopRunner


def _asyncio_complaints(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What asyncio logged about tasks garbage collected while pending, or whose exception
    nobody retrieved (after a collection, so that it has happened by now)."""
    gc.collect()
    return [
        record.getMessage()
        for record in caplog.records
        if record.name == "asyncio" and "Task" in record.getMessage()
    ]


JOIN_LIMIT = 15.0
"""Seconds a loop thread of the suite gets to end once it is free (it ends within
``CANCEL_GRACE``, 2 s, even on a busy machine)."""


def _loop_threads() -> set[threading.Thread]:
    return {thread for thread in threading.enumerate() if thread.name == "kvplug-contract-loop"}


def test_a_loop_left_behind_cancels_its_tasks_and_closes_once_its_thread_is_free(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 34: a blocked loop that the suite left behind stopped once its thread came free,
    its tasks still pending; garbage collected during a later test, asyncio logged "Task was
    destroyed but it is pending!" there."""
    before = _loop_threads()
    runner = LoopRunner(timeout=0.2)
    blocked, (thread,) = runner.loop, _loop_threads() - before

    async def blocks_then_waits() -> None:
        time.sleep(WEDGE_PROBE + 0.5)  # a hook that blocks the loop's thread
        await asyncio.sleep(600)

    try:
        with pytest.raises(ContractTimeout, match="The suite left that loop behind"):
            runner.run(blocks_then_waits())
        assert runner.loop is not blocked
        thread.join(JOIN_LIMIT)
        assert not thread.is_alive()
        assert blocked.is_closed()
        assert asyncio.all_tasks(blocked) == set()
        assert _asyncio_complaints(caplog) == []
    finally:
        runner.close()


@pytest.fixture
def runner() -> Iterator[LoopRunner]:
    """A loop runner of the test's own, whose budget for one operation is 0.2 s."""
    runner = LoopRunner(timeout=0.2)
    yield runner
    runner.close()


def test_an_operation_over_its_budget_has_been_cancelled_and_has_unwound_when_run_raises(
    runner: LoopRunner,
) -> None:
    unwound = threading.Event()

    async def slow_to_unwind() -> None:
        try:
            await asyncio.sleep(600)
        except asyncio.CancelledError:
            await asyncio.sleep(0.3)  # closes its connection, say
            unwound.set()
            raise

    with pytest.raises(ContractTimeout, match=r"did not finish within 0\.2 s"):
        runner.run(slow_to_unwind())
    assert unwound.is_set()


def test_an_operation_that_ignores_its_cancel_is_named_so(runner: LoopRunner) -> None:
    release = threading.Event()

    async def ignores_cancel() -> None:
        while not release.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(0.05)

    try:
        with pytest.raises(ContractTimeout) as raised:
            runner.run(ignores_cancel())
    finally:
        release.set()
    message = str(raised.value)
    assert "did not finish within 0.2 s (the suite's budget for one operation" in message
    assert (
        "; cancelled then, it still ran 2 s later: a hook catches CancelledError, or waits where "
        "cancellation does not reach it"
    ) in message


def test_closing_the_runner_cancels_what_still_runs_and_closes_its_loop() -> None:
    runner = LoopRunner()
    loop = runner.loop
    started, cancelled = threading.Event(), threading.Event()

    async def forever() -> None:
        started.set()
        try:
            await asyncio.sleep(600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    runner.submit(forever())
    assert started.wait(5)
    runner.close()
    assert cancelled.is_set()
    assert loop.is_closed()
