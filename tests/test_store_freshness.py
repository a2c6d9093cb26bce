"""The Store's version ledger on its own: what it refuses, and its invariants under any sequence
of operations."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvplug
from kvplug import CacheKey, MemoryObj
from kvplug.runtime.store import Store
from kvplug.runtime.store.freshness import LedgerInvariantError, ReadClock, VersionLedger

KEY = CacheKey("ledger", 1, 0, 1)


def value(fill: float = 1.0) -> MemoryObj:
    return MemoryObj.from_tensor(torch.full((64,), fill))


class Recorder:
    """A ledger whose workers' queues and untracked removals are recorded."""

    def __init__(self, max_removals: int = 100) -> None:
        self.queued: list[tuple[int, CacheKey]] = []
        self.untracked: list[int] = []
        self.ledger = VersionLedger(
            lambda tier, key: self.queued.append((tier, key)),
            self.untracked.append,
            asyncio.Event(),
            max_removals=max_removals,
        )


def audit(ledger: VersionLedger) -> None:
    """Every invariant the ledger promises, checked over all of its state."""
    held = 0
    removals: dict[int, int] = {}
    for key, entry in ledger._entries.items():
        assert entry.writes.isdisjoint(entry.removals), key
        assert entry.value is not None or not entry.writes, key
        held += entry.value.phy_size if entry.value is not None else 0
        for tier in entry.removals:
            removals[tier] = removals.get(tier, 0) + 1
        for tier in entry.removals | entry.busy:
            assert ledger.skipped(key, tier)
    assert ledger.queued_bytes == held
    assert {t: n for t, n in ledger._removals.items() if n} == removals


def test_a_tier_is_never_both_written_and_purged() -> None:
    ledger = Recorder().ledger
    with pytest.raises(LedgerInvariantError, match="both to write and to purge"):
        ledger.accept(KEY, value(), [1, 2], [2])


def test_a_write_back_is_refused_while_a_newer_value_is_outstanding() -> None:
    recorder = Recorder()
    ledger = recorder.ledger
    newer = value(2.0)
    ledger.accept(KEY, newer, [1], [])
    started = ledger.clock.begin()
    older = value(1.0)
    assert not ledger.may_write_back(KEY, started)
    assert not ledger.write_back(KEY, older, 0, started)
    assert ledger.newest(KEY) is newer and older.ref_count == 1
    assert recorder.queued == [(1, KEY)]
    ledger.clock.end(started)
    audit(ledger)


def test_a_write_back_is_refused_for_a_key_changed_since_its_read_began() -> None:
    ledger = Recorder().ledger
    started = ledger.clock.begin()
    with ledger.clock.changing([KEY]):
        assert not ledger.write_back(KEY, value(), 0, started)
    assert not ledger.write_back(KEY, value(), 0, started)  # the change happened after the read
    assert len(ledger) == 0
    later = ledger.clock.begin()
    assert ledger.write_back(KEY, value(), 0, later)
    ledger.clock.end(later)
    ledger.clock.end(started)
    audit(ledger)


def test_a_newer_value_replaces_a_written_back_one_for_every_tier() -> None:
    ledger = Recorder().ledger
    started = ledger.clock.begin()
    older, newer = value(1.0), value(2.0)
    assert ledger.write_back(KEY, older, 0, started)
    ledger.clock.end(started)
    ledger.accept(KEY, newer, [1], [])
    assert older.ref_count == 1  # the ledger let go of the older value
    assert ledger.newest(KEY) is newer
    written = [ledger.take_write(KEY, tier) for tier in (0, 1)]
    assert written == [newer, newer]
    for tier in (0, 1):
        newer.release()
        ledger.finish(KEY, tier)
    assert len(ledger) == 0 and newer.ref_count == 1 and ledger.queued_bytes == 0


def test_a_tier_refused_a_newer_value_is_skipped_until_its_older_one_is_removed() -> None:
    ledger = Recorder().ledger
    ledger.accept(KEY, value(), [], [1])
    assert ledger.skipped(KEY, 1) and not ledger.skipped(KEY, 0)
    assert ledger.newest(KEY) is None  # no tier needs the value: it is not held
    assert ledger.take_write(KEY, 1) is None
    assert ledger.take_removal(KEY, 1)
    assert ledger.skipped(KEY, 1)  # in flight
    ledger.finish(KEY, 1)
    assert not ledger.skipped(KEY, 1) and len(ledger) == 0


def test_removals_past_the_limit_are_refused_and_reported() -> None:
    recorder = Recorder(max_removals=2)
    ledger = recorder.ledger
    keys = [CacheKey("ledger", 1, 0, n) for n in range(3)]
    for key in keys:
        ledger.purge(key, 1)
    assert recorder.untracked == [1]
    assert [ledger.skipped(key, 1) for key in keys] == [True, True, False]
    assert ledger.removals_queued() == 2
    audit(ledger)


def test_a_removal_in_flight_is_kept_when_the_tier_takes_the_newer_value() -> None:
    ledger = Recorder().ledger
    ledger.purge(KEY, 0)
    ledger.superseded(KEY, 0)  # queued: the tier now holds the newer value, no removal
    assert not ledger.skipped(KEY, 0)
    ledger.purge(KEY, 0)
    assert ledger.take_removal(KEY, 0)
    ledger.superseded(KEY, 0)  # in flight: it lands first, the tier stays skipped
    assert ledger.skipped(KEY, 0)
    ledger.finish(KEY, 0)
    ledger.settle(KEY)
    assert len(ledger) == 0


def test_a_remove_cancels_writes_and_follows_one_in_flight_with_a_removal() -> None:
    ledger = Recorder().ledger
    obj = value()
    ledger.accept(KEY, obj, [1, 2], [])
    taken = ledger.take_write(KEY, 1)
    assert taken is obj
    assert ledger.remove(KEY, [1, 2], everywhere=True)
    assert ledger.newest(KEY) is None and ledger.take_write(KEY, 2) is None
    assert ledger.skipped(KEY, 1)  # the write in flight is followed by a removal
    taken.release()
    ledger.finish(KEY, 1)
    assert ledger.take_removal(KEY, 1)
    ledger.finish(KEY, 1)
    assert len(ledger) == 0 and obj.ref_count == 1
    obj.release()


def test_a_read_clock_refuses_to_end_or_extend_a_read_that_is_not_open() -> None:
    clock = ReadClock()
    with pytest.raises(LedgerInvariantError):
        clock.end(0)
    started = clock.begin()
    clock.extend(started)
    clock.end(started)
    clock.end(started)
    with pytest.raises(LedgerInvariantError):
        clock.extend(started)


OPERATIONS = st.lists(
    st.tuples(
        st.sampled_from(
            ["accept", "write_back", "purge", "remove", "take", "finish", "superseded", "cancel"]
        ),
        st.integers(0, 2),  # key
        st.integers(0, 2),  # tier
        st.sets(st.integers(0, 2), max_size=3),  # tiers
    ),
    max_size=40,
)


@settings(max_examples=500, deadline=None)
@given(operations=OPERATIONS)
def test_the_invariants_hold_after_any_sequence_of_operations(
    operations: list[tuple[str, int, int, set[int]]],
) -> None:
    ledger = Recorder(max_removals=3).ledger
    keys = [CacheKey("ledger", 1, 0, n) for n in range(3)]
    in_flight: dict[tuple[CacheKey, int], MemoryObj | None] = {}
    for operation, k, tier, tiers in operations:
        key = keys[k]
        if operation == "accept":
            queue_for = sorted(tiers)
            ledger.accept(key, value(), queue_for, [t for t in range(3) if t not in tiers])
        elif operation == "write_back":
            started = ledger.clock.begin()
            ledger.write_back(key, value(), tier, started)
            ledger.clock.end(started)
        elif operation == "purge":
            ledger.purge(key, tier)
        elif operation == "remove":
            ledger.remove(key, sorted(tiers), everywhere=tiers == {0, 1, 2})
            ledger.settle(key)
        elif operation == "take" and (key, tier) not in in_flight:
            if ledger.take_removal(key, tier):
                in_flight[key, tier] = None
            elif (obj := ledger.take_write(key, tier)) is not None:
                in_flight[key, tier] = obj
        elif operation == "finish" and (key, tier) in in_flight:
            obj = in_flight.pop((key, tier))
            if obj is not None:
                obj.release()
            ledger.finish(key, tier)
        elif operation == "superseded":
            ledger.superseded(key, tier)
        elif operation == "cancel":
            ledger.cancel_write(key, tier)
        audit(ledger)


def test_a_promoted_read_into_the_callers_memory_leaves_no_read_open() -> None:
    """A read that scheduled a promotion ends once itself and once more with the promotion:
    a read left open would keep every later change in the clock."""

    async def main() -> None:
        first, lower = (kvplug.open_backend(f"cpu://?max_size={n}MiB") for n in (8, 9))
        store = Store(tiers=[await first, await lower])
        held = store.tiers[1].allocate((64,), torch.float32)
        assert held is not None
        held.tensor.fill_(3.0)
        await store.tiers[1].put(KEY, held)
        held.release()
        dest = value(0.0)
        assert await store.get_into(KEY, dest)
        await store.flush(5)
        for _ in range(100):
            if store._ledger.clock.open_reads == 0:
                break
            await asyncio.sleep(0.01)
        assert store._ledger.clock.open_reads == 0
        assert await store.tiers[0].contains(KEY)  # the promotion did run
        await store.close()

    asyncio.run(main())
