"""The evictable index (kvplug.index): byte accounting, reservations, eviction order per
policy, pins and their expiry, hold-offs, the owner's predicate and callback, and a
model-based check against a plain dict."""

from __future__ import annotations

import time
from typing import Generic, TypeVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplug.errors import ConfigError
from kvplug.eviction import POLICIES
from kvplug.index import EvictableIndex, Reservation

Index = EvictableIndex[str, str]
T = TypeVar("T")


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(time, "monotonic", fake)
    return fake


class Evictor(Generic[T]):
    """An owner's eviction callback that records its victims and refuses the keys in
    ``refuse``."""

    def __init__(self, refuse: frozenset[T] = frozenset()) -> None:
        self.victims: list[T] = []
        self.refused: list[T] = []
        self.refuse = refuse

    def __call__(self, key: T, value: str) -> bool:
        if key in self.refuse:
            self.refused.append(key)
            return False
        self.victims.append(key)
        return True


def _filled(sizes: dict[str, int], max_size: int = 100, policy: str = "lru") -> Index:
    index: Index = EvictableIndex(max_size, policy)
    for key, nbytes in sizes.items():
        index.put(key, key.upper(), nbytes)
    return index


# -- accounting -------------------------------------------------------------------------------


def test_put_replace_update_and_remove_keep_the_byte_count() -> None:
    index = _filled({"a": 10, "b": 20})
    assert (index.bytes_held, len(index), index.nbytes("b")) == (30, 2, 20)
    assert index.put("a", "A2", 5) == "A"
    assert (index.bytes_held, index.get("a")) == (25, "A2")
    assert index.update("b", "B2", 40) == "B"
    assert (index.bytes_held, index.nbytes("b")) == (45, 40)
    assert index.remove("b") == "B2"
    assert index.remove("b") is None
    assert (index.bytes_held, sorted(index), "b" in index) == (5, ["a"], False)
    with pytest.raises(KeyError):
        index.update("absent", "X", 1)


def test_used_and_free_bytes_count_held_reserved_and_external_bytes() -> None:
    index = _filled({"a": 10}, max_size=100)
    reservation = index.reserve(20, Evictor[str]())
    index.external_bytes = 30
    assert (index.used, index.free_bytes, index.reserved) == (60, 40, 20)
    assert reservation is not None and reservation.nbytes == 20


def test_get_is_not_a_use_but_hit_is() -> None:
    index = _filled({"a": 10, "b": 10, "c": 10})
    assert index.get("a") == "A"
    assert index.hit("b") == "B"
    assert index.hit("absent") is None
    evict = Evictor[str]()
    assert index.reclaim(30, evict) == 30
    assert evict.victims == ["a", "c", "b"]


def test_clear_returns_the_values_and_keeps_open_reservations() -> None:
    index = _filled({"a": 10, "b": 20})
    index.pin("a")
    index.external_bytes = 5
    reservation = index.reserve(7, Evictor[str]())
    assert sorted(index.clear()) == ["A", "B"]
    assert (len(index), index.bytes_held, index.pinned_keys, index.external_bytes) == (0, 0, 0, 0)
    assert index.reserved == 7
    assert reservation is not None
    index.commit(reservation, "c", "C")
    assert (index.bytes_held, index.reserved) == (7, 0)


def test_an_unknown_policy_is_a_config_error_naming_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match="Did you mean 'lfu'"):
        EvictableIndex[str, str](100, "lfv")
    assert EvictableIndex[str, str](100, "FIFO").policy_name == "fifo"


# -- reservations -----------------------------------------------------------------------------


def test_a_reservation_holds_its_bytes_until_committed() -> None:
    index = _filled({"a": 40}, max_size=100)
    reservation = index.reserve(50, Evictor[str]())
    assert reservation is not None
    assert index.reserve(20, Evictor(refuse=frozenset("a"))) is None  # 40 + 50 + 20 > 100
    assert index.commit(reservation, "b", "B") is None
    assert (index.bytes_held, index.reserved, index.nbytes("b")) == (90, 0, 50)
    assert reservation.settled


def test_reserving_evicts_to_make_room_and_credits_the_key_it_replaces() -> None:
    index = _filled({"a": 40, "b": 40}, max_size=100)
    evict = Evictor[str]()
    reservation = index.reserve(60, evict, replacing="b")  # 80 - 40 + 60 = 100 fits
    assert reservation is not None and evict.victims == []
    assert index.commit(reservation, "b", "B2") == "B"
    assert (index.bytes_held, index.get("b")) == (100, "B2")
    assert index.reserve(70, evict, replacing="b") is not None  # 100 - 60 + 70 > 100
    assert evict.victims == ["a"]


def test_cancel_gives_the_bytes_back_once_and_a_settled_reservation_cannot_commit() -> None:
    index: Index = EvictableIndex(100)
    reservation = index.reserve(30, Evictor[str]())
    assert reservation is not None
    index.cancel(reservation)
    index.cancel(reservation)
    assert index.reserved == 0
    with pytest.raises(ValueError, match="already committed or cancelled"):
        index.commit(reservation, "a", "A")
    assert "a" not in index
    assert repr(Reservation(3)) == "Reservation(3 bytes, open)"


# -- eviction order and what is skipped -------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "expected"),
    [("lru", ["c", "a", "b"]), ("fifo", ["a", "b", "c"]), ("lfu", ["c", "b", "a"])],
)
def test_make_room_evicts_in_the_policys_order(policy: str, expected: list[str]) -> None:
    index = _filled({"a": 10, "b": 10, "c": 10}, max_size=30, policy=policy)
    index.hit("a")
    index.hit("a")
    index.hit("b")
    evict = Evictor[str]()
    for count in (1, 2, 3):
        assert index.make_room(10 * count, evict)
    assert evict.victims == expected
    assert (len(index), index.bytes_held) == (0, 0)


def test_make_room_is_false_when_only_excluded_or_pinned_keys_are_left() -> None:
    index = _filled({"a": 40, "b": 40}, max_size=100)
    assert index.pin("a")
    evict = Evictor[str]()
    assert not index.make_room(90, evict, replacing="b")
    assert evict.victims == []
    assert (sorted(index), index.bytes_held) == (["a", "b"], 80)


def test_make_room_keeps_what_it_evicted_when_it_fails() -> None:
    index = _filled({"a": 40, "b": 40}, max_size=100)
    index.pin("b")
    evict = Evictor[str]()
    assert not index.make_room(70, evict)
    assert evict.victims == ["a"]
    assert (sorted(index), index.bytes_held) == (["b"], 40)


def test_a_victim_the_owner_cannot_free_is_skipped_and_stays_stored() -> None:
    index = _filled({"a": 10, "b": 10, "c": 10}, max_size=30)
    evict = Evictor(refuse=frozenset("a"))
    assert index.make_room(10, evict)
    assert (evict.refused, evict.victims, sorted(index)) == (["a"], ["b"], ["a", "c"])


def test_the_evictable_predicate_skips_values() -> None:
    index = _filled({"a": 10, "b": 10, "c": 10}, max_size=30)
    evict = Evictor[str]()
    assert index.reclaim(15, evict, evictable=lambda value: value != "A") == 20
    assert evict.victims == ["b", "c"]
    assert index.reclaim(15, evict, evictable=lambda value: value != "A") == 0


def test_reclaim_frees_at_least_the_bytes_asked_whatever_the_capacity() -> None:
    index = _filled({"a": 10, "b": 10, "c": 10}, max_size=1000)
    evict = Evictor[str]()
    assert index.reclaim(11, evict) == 20
    assert evict.victims == ["a", "b"]
    assert index.reclaim(0, evict) == 0


def test_evict_one_skips_the_excluded_key() -> None:
    index = _filled({"a": 10, "b": 10})
    evict = Evictor[str]()
    assert index.evict_one(evict, exclude="a")
    assert not index.evict_one(evict, exclude="a")
    assert evict.victims == ["b"]


def test_an_exception_in_the_callback_propagates_with_the_entry_still_stored() -> None:
    index = _filled({"a": 10}, max_size=10)

    def fail(key: str, value: str) -> bool:
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        index.make_room(5, fail)
    assert (sorted(index), index.bytes_held) == (["a"], 10)


def test_external_bytes_count_against_the_capacity() -> None:
    index = _filled({"a": 10, "b": 10}, max_size=30)
    index.external_bytes = 5
    evict = Evictor[str]()
    assert index.make_room(5, evict)  # 20 + 5 + 5 fits
    assert evict.victims == []
    assert index.make_room(10, evict)
    assert evict.victims == ["a"]
    index.external_bytes = 40
    assert not index.make_room(0, evict)
    assert evict.victims == ["a", "b"]


# -- pins and hold-offs -----------------------------------------------------------------------


def test_pins_count_expire_and_go_with_the_key(clock: Clock) -> None:
    index: Index = EvictableIndex(100, pin_ttl=10.0)
    assert not index.pin("a")
    index.put("a", "A", 10)
    index.put("b", "B", 10)
    assert index.pin("a") and index.pin("a", ttl=100.0)
    assert index.unpin("a") and index.is_pinned("a")
    clock.now += 50  # the first pin was released, the second lasts 100 s
    assert index.is_pinned("a")
    clock.now += 60
    assert not index.is_pinned("a")
    assert not index.unpin("a")
    index.pin("b")
    assert index.pinned_keys == 1
    index.remove("b")
    assert (index.pinned_keys, index.is_pinned("b")) == (0, False)


def test_an_expired_pin_no_longer_keeps_a_key_from_eviction(clock: Clock) -> None:
    index = _filled({"a": 10, "b": 10}, max_size=20)
    index.pin_ttl = 5.0
    index.pin("a")
    evict = Evictor[str]()
    assert index.make_room(10, evict)
    assert evict.victims == ["b"]
    clock.now += 5
    assert index.make_room(20, evict)
    assert evict.victims == ["b", "a"]


def test_replacing_a_key_keeps_its_pins() -> None:
    index = _filled({"a": 10})
    index.pin("a")
    index.put("a", "A2", 20)
    assert index.is_pinned("a")
    assert index.commit(Reservation(5), "a", "A3") == "A2"
    assert index.is_pinned("a")


def test_a_held_off_key_is_skipped_until_its_time_or_a_new_put(clock: Clock) -> None:
    index = _filled({"a": 10, "b": 10, "c": 10}, max_size=30)

    def evict(key: str, value: str) -> bool:
        if key == "a":
            index.hold_off(key, 30.0)
            return False
        return True

    assert index.evict_one(evict)  # "a" refused and held off, "b" goes
    assert index.held_off() == ["a"]
    index.hold_off("absent", 30.0)
    assert index.held_off() == ["a"]
    victims = Evictor[str]()
    assert index.evict_one(victims)
    assert victims.victims == ["c"]
    assert not index.evict_one(victims)
    clock.now += 30
    assert index.held_off() == []
    assert index.evict_one(victims)
    assert victims.victims == ["c", "a"]


def test_update_keeps_a_hold_off_and_put_ends_it(clock: Clock) -> None:
    index = _filled({"a": 10})
    index.hold_off("a", 30.0)
    index.update("a", "A2", 12)
    assert index.held_off() == ["a"]
    index.put("a", "A3", 12)
    assert index.held_off() == []


# -- model-based check ------------------------------------------------------------------------


class _Model:
    """A dict and a use clock: the naive reference of the index under each policy."""

    def __init__(self, policy: str, max_size: int) -> None:
        self.policy = policy
        self.max_size = max_size
        self.sizes: dict[int, int] = {}
        self.order: dict[int, tuple[int, int]] = {}  # key -> (uses, stamp)
        self.pinned: dict[int, int] = {}
        self.clock = 0

    def used(self, key: int) -> None:
        self.clock += 1
        uses = self.order.get(key, (0, 0))[0] + 1
        self.order[key] = (uses, self.clock)

    def put(self, key: int, nbytes: int) -> None:
        self.sizes[key] = nbytes
        self.used(key)

    def hit(self, key: int) -> None:
        if key in self.sizes and self.policy != "fifo":
            self.used(key)
        elif key in self.sizes:
            uses, stamp = self.order[key]
            self.order[key] = (uses + 1, stamp)

    def remove(self, key: int) -> None:
        self.sizes.pop(key, None)
        self.order.pop(key, None)
        self.pinned.pop(key, None)

    def victims(self, exclude: int) -> list[int]:
        lfu = self.policy == "lfu"
        keys = sorted(self.order, key=lambda k: self.order[k] if lfu else (self.order[k][1],))
        return [k for k in keys if k != exclude and not self.pinned.get(k)]


_operations = st.lists(
    st.tuples(
        st.sampled_from(["put", "reserve", "hit", "remove", "pin", "unpin"]),
        st.integers(0, 3),
        st.integers(15, 40),
    ),
    max_size=50,
)


@settings(max_examples=200, deadline=None)
@given(policy=st.sampled_from(sorted(POLICIES)), operations=_operations)
def test_the_index_matches_a_dict_model(
    policy: str, operations: list[tuple[str, int, int]]
) -> None:
    max_size = 60
    index: EvictableIndex[int, str] = EvictableIndex(max_size, policy)
    model = _Model(policy, max_size)
    for operation, key, nbytes in operations:
        if operation in ("put", "reserve"):
            expected_victims = []
            room = max_size - sum(model.sizes.values()) + model.sizes.get(key, 0)
            for victim in model.victims(exclude=key):
                if room >= nbytes:
                    break
                expected_victims.append(victim)
                room += model.sizes[victim]
            evict = Evictor[int]()
            if operation == "put":
                fits = index.make_room(nbytes, evict, replacing=key)
            else:
                reservation = index.reserve(nbytes, evict, replacing=key)
                fits = reservation is not None
            assert evict.victims == expected_victims
            assert fits == (room >= nbytes)
            for victim in expected_victims:
                model.remove(victim)
            if fits:
                if operation == "put":
                    index.put(key, f"v{key}", nbytes)
                else:
                    assert reservation is not None
                    assert index.reserved == nbytes
                    index.commit(reservation, key, f"v{key}")
                model.put(key, nbytes)
        elif operation == "hit":
            assert index.hit(key) == (f"v{key}" if key in model.sizes else None)
            model.hit(key)
        elif operation == "remove":
            assert (index.remove(key) is not None) == (key in model.sizes)
            model.remove(key)
        elif operation == "pin":
            assert index.pin(key) == (key in model.sizes)
            if key in model.sizes:
                model.pinned[key] = model.pinned.get(key, 0) + 1
        else:
            assert index.unpin(key) == bool(model.pinned.get(key))
            if model.pinned.get(key):
                model.pinned[key] -= 1
        assert dict(zip(index, (index.nbytes(k) for k in index), strict=True)) == model.sizes
        assert index.bytes_held == sum(model.sizes.values()) <= max_size
        assert index.reserved == 0
        assert index.pinned_keys == sum(1 for count in model.pinned.values() if count)
