"""kvplug.DamagedValues: the one policy for damaged values (clause 6) that every backend uses."""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path

import pytest

import kvplug
from kvplug import DamagedValues, UnreadableObject
from kvplug.backend import CountsCorruptObjects


def test_drop_counts_logs_and_removes_every_damaged_value_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stored = {"a": b"1", "b": b"2", "c": b"3"}
    in_flight = 0
    most_at_once = 0

    async def remove(name: str) -> bool:
        nonlocal in_flight, most_at_once
        in_flight += 1
        most_at_once = max(most_at_once, in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1
        return stored.pop(name, None) is not None

    damaged = DamagedValues[str]("memstore://x", remove=remove)
    with caplog.at_level(logging.WARNING, logger="kvplug.damage"):
        asyncio.run(damaged.drop({"a": "torn frame", "b": "checksum mismatch"}))
    assert damaged.count == 2 and stored == {"c": b"3"}
    assert most_at_once == 2, "the removals of one batch run concurrently"
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 2
    assert "memstore://x" in lines[0] and " a " in lines[0] and "torn frame" in lines[0]
    assert "checksum mismatch" in lines[1] and "removed" in lines[1]


def test_a_failed_removal_is_logged_not_raised_and_the_value_is_counted_again_when_read_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def remove(name: str) -> bool:
        raise kvplug.BackendUnavailable("the store is down")

    damaged = DamagedValues[str]("memstore://x", remove=remove)
    with caplog.at_level(logging.WARNING, logger="kvplug.damage"):
        asyncio.run(damaged.drop({"a": "torn frame"}))
        asyncio.run(damaged.drop({"a": "torn frame"}))
    assert damaged.count == 2
    failures = [r.getMessage() for r in caplog.records if "could not remove" in r.getMessage()]
    assert len(failures) == 2 and "BackendUnavailable: the store is down" in failures[0]


def test_a_store_that_cannot_delete_only_counts_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    damaged = DamagedValues[bytes]("lm://h:1")
    with caplog.at_level(logging.WARNING, logger="kvplug.damage"):
        asyncio.run(damaged.drop({b"k\xff": "checksum mismatch"}))
    assert damaged.count == 1
    (line,) = [record.getMessage() for record in caplog.records]
    assert "k\ufffd" in line and "cannot delete it" in line


def test_a_cancelled_drop_raises_once_every_removal_has_ended() -> None:
    ended: list[str] = []

    async def remove(name: str) -> bool:
        try:
            await asyncio.sleep(0.05)
        finally:
            ended.append(name)
        return True

    async def scenario() -> None:
        damaged = DamagedValues[str]("memstore://x", remove=remove)
        task = asyncio.ensure_future(damaged.drop({"a": "x", "b": "y"}))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert sorted(ended) == ["a", "b"]
        assert damaged.count == 2

    asyncio.run(scenario())


def test_found_and_tally_count_from_many_threads_without_losing_one() -> None:
    damaged = DamagedValues[str]("file:///tmp/x", level=logging.DEBUG)

    def report() -> None:
        for n in range(500):
            damaged.found(f"f{n}", "torn")
        damaged.tally(3)

    threads = [threading.Thread(target=report) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert damaged.count == 8 * 503


@pytest.mark.parametrize("scheme", ["audit::cpu://", "file://"])
def test_built_in_backends_answer_corrupt_objects_from_their_ledger(
    scheme: str, tmp_path: Path
) -> None:
    backend = kvplug.create_backend(scheme + (str(tmp_path) if scheme == "file://" else ""))
    assert isinstance(backend, CountsCorruptObjects)
    ledger = backend.damaged_values  # type: ignore[attr-defined]
    assert isinstance(ledger, DamagedValues)
    ledger.tally(2)
    assert backend.corrupt_objects == 2


def test_a_value_not_readable_here_is_counted_and_kept_for_readers_that_can() -> None:
    stored = {"sealed-with-key-2": b"frame", "torn": b"fr"}

    async def remove(name: str) -> bool:
        return stored.pop(name, None) is not None

    damaged = DamagedValues("memstore://", remove=remove)
    why = UnreadableObject("sealed with key id 2, which this reader does not hold")
    asyncio.run(damaged.drop({"sealed-with-key-2": why, "torn": "its checksum does not match"}))
    assert damaged.count == 2
    assert sorted(stored) == ["sealed-with-key-2"]
