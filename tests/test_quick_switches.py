"""QuickSwitches: the interpreter's switch interval is lowered while a job is in flight and set
back when the last one ends, across threads and instances, without undoing anyone else's."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator

import pytest

from kvplug.runtime.engine import QuickSwitches


@pytest.fixture(autouse=True)
def interval() -> Iterator[float]:
    before = sys.getswitchinterval()
    yield before
    sys.setswitchinterval(before)


def test_a_hold_lowers_the_interval_and_its_release_restores_it(interval: float) -> None:
    quick = QuickSwitches(0.0005)
    quick.hold()
    assert sys.getswitchinterval() == pytest.approx(0.0005, rel=0.05)
    quick.release()
    assert sys.getswitchinterval() == interval


def test_holds_nest_and_the_lowest_wins_until_the_last_release(interval: float) -> None:
    slow, fast = QuickSwitches(0.002), QuickSwitches(0.0005)
    slow.hold()
    assert sys.getswitchinterval() == pytest.approx(0.002, rel=0.05)
    fast.hold()
    fast.hold()
    assert sys.getswitchinterval() == pytest.approx(0.0005, rel=0.05)
    fast.release()
    slow.release()
    assert sys.getswitchinterval() == pytest.approx(0.0005, rel=0.05)  # one hold is left
    fast.release()
    assert sys.getswitchinterval() == interval


def test_an_interval_already_lower_is_kept() -> None:
    sys.setswitchinterval(0.0001)
    quick = QuickSwitches(0.0005)
    quick.hold()
    assert sys.getswitchinterval() == pytest.approx(0.0001, rel=0.05)
    quick.release()
    assert sys.getswitchinterval() == pytest.approx(0.0001, rel=0.05)


def test_a_change_made_by_someone_else_meanwhile_is_not_undone() -> None:
    quick = QuickSwitches(0.0005)
    quick.hold()
    sys.setswitchinterval(0.003)  # the engine's own setting, made while the job ran
    quick.release()
    assert sys.getswitchinterval() == pytest.approx(0.003, rel=0.05)


def test_none_leaves_the_interval_alone(interval: float) -> None:
    quick = QuickSwitches(None)
    quick.hold()
    assert sys.getswitchinterval() == interval
    quick.release()
    assert sys.getswitchinterval() == interval


def test_holds_from_many_threads_end_with_the_interval_restored(interval: float) -> None:
    quick = QuickSwitches(0.0005)
    start = threading.Barrier(8)

    def jobs() -> None:
        start.wait()
        for _ in range(200):
            quick.hold()
            quick.release()

    threads = [threading.Thread(target=jobs) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sys.getswitchinterval() == interval
