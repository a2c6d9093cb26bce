"""Eviction policies (kvplug.eviction): exact victim orders, pinned skipping, names, and a
model-based check of every policy against a naive reference."""

from __future__ import annotations

from collections.abc import Container

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplug.errors import ConfigError
from kvplug.eviction import (
    POLICIES,
    EvictionPolicy,
    FIFOPolicy,
    LFUPolicy,
    LRUPolicy,
    make_policy,
)


def _filled(name: str, puts: list[int], hits: list[int]) -> EvictionPolicy[int]:
    policy: EvictionPolicy[int] = make_policy(name)
    for key in puts:
        policy.on_put(key)
    for key in hits:
        policy.on_hit(key)
    return policy


def _victims(
    policy: EvictionPolicy[int], pinned: Container[int] = frozenset(), n: int = 2
) -> list[int]:
    return [key for key in policy.candidates() if key not in pinned][:n]


def test_lru_evicts_least_recently_used_first_and_a_hit_refreshes() -> None:
    policy = _filled("lru", [1, 2, 3], [1])
    assert list(policy.candidates()) == [2, 3, 1]


def test_lru_skips_pinned_keys() -> None:
    policy = _filled("lru", [1, 2, 3], [1])
    assert _victims(policy, pinned={2}) == [3, 1]


def test_fifo_ignores_hits() -> None:
    policy = _filled("fifo", [1, 2, 3], [1, 1, 3])
    assert list(policy.candidates()) == [1, 2, 3]


def test_fifo_skips_pinned_keys() -> None:
    policy = _filled("fifo", [1, 2, 3], [1])
    assert _victims(policy, pinned={1}) == [2, 3]


def test_lfu_evicts_lowest_frequency_first_oldest_first_within_a_frequency() -> None:
    policy = _filled("lfu", [1, 2, 3], [3, 3, 2, 2, 1])
    # uses: 1 -> 2, 3 -> 3 (reached first), 2 -> 3
    assert list(policy.candidates()) == [1, 3, 2]
    assert isinstance(policy, LFUPolicy)
    assert [policy.uses(k) for k in (1, 2, 3, 4)] == [2, 3, 3, 0]


def test_lfu_skips_pinned_keys() -> None:
    policy = _filled("lfu", [1, 2, 3], [3, 3, 2, 2, 1])
    assert _victims(policy, pinned={1}) == [3, 2]


def test_a_new_key_is_the_next_lfu_victim_among_used_keys() -> None:
    policy = _filled("lfu", [1, 2], [1, 2])
    policy.on_put(3)
    assert next(policy.candidates()) == 3


@pytest.mark.parametrize("name", ["lru", "fifo"])
def test_a_repeated_put_makes_the_key_newest(name: str) -> None:
    policy = _filled(name, [1, 2, 3], [])
    policy.on_put(1)
    assert list(policy.candidates()) == [2, 3, 1]
    assert len(policy) == 3


def test_a_repeated_put_counts_as_a_use_in_lfu() -> None:
    policy = _filled("lfu", [1, 2, 3], [])
    policy.on_put(1)
    assert list(policy.candidates()) == [2, 3, 1]
    assert len(policy) == 3


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_discard_hit_and_membership_of_untracked_keys_are_harmless(name: str) -> None:
    policy = _filled(name, [1, 2], [])
    policy.discard(99)
    policy.on_hit(99)
    assert 99 not in policy
    assert 1 in policy
    policy.discard(1)
    policy.discard(1)
    assert 1 not in policy
    assert list(policy.candidates()) == [2]
    assert len(policy) == 1
    assert "1 keys" in repr(policy)


@pytest.mark.parametrize(
    ("name", "cls"),
    [("lru", LRUPolicy), ("LRU", LRUPolicy), (" Lfu ", LFUPolicy), ("FIFO", FIFOPolicy)],
)
def test_make_policy_is_case_insensitive(name: str, cls: type) -> None:
    assert type(make_policy(name)) is cls


def test_make_policy_defaults_to_lru() -> None:
    assert type(make_policy()) is LRUPolicy


def test_unknown_policy_names_the_valid_ones_and_suggests_one() -> None:
    with pytest.raises(ConfigError) as error:
        make_policy("lur")
    message = str(error.value)
    assert "'lur'" in message
    assert "Did you mean 'lru'?" in message
    assert "fifo, lfu, lru" in message


# -- model-based check ------------------------------------------------------------------------


class _Reference:
    """O(n) reference of each policy: victims sorted by (uses, stamp) or by stamp."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.clock = 0
        self.entries: dict[int, tuple[int, int]] = {}  # key -> (uses, stamp)

    def put(self, key: int) -> None:
        self.clock += 1
        uses = self.entries.get(key, (0, 0))[0] + 1
        self.entries[key] = (uses, self.clock)

    def hit(self, key: int) -> None:
        if key in self.entries and self.name != "fifo":
            self.clock += 1
            self.entries[key] = (self.entries[key][0] + 1, self.clock)

    def discard(self, key: int) -> None:
        self.entries.pop(key, None)

    def order(self) -> list[int]:
        if self.name == "lfu":
            return sorted(self.entries, key=lambda k: self.entries[k])
        return sorted(self.entries, key=lambda k: self.entries[k][1])


_operations = st.lists(
    st.tuples(st.sampled_from(["put", "hit", "discard"]), st.integers(0, 7)), max_size=60
)


@settings(max_examples=150, deadline=None)
@given(name=st.sampled_from(sorted(POLICIES)), operations=_operations)
def test_every_policy_matches_its_reference_model(
    name: str, operations: list[tuple[str, int]]
) -> None:
    policy: EvictionPolicy[int] = make_policy(name)
    reference = _Reference(name)
    for operation, key in operations:
        if operation == "put":
            policy.on_put(key)
            reference.put(key)
        elif operation == "hit":
            policy.on_hit(key)
            reference.hit(key)
        else:
            policy.discard(key)
            reference.discard(key)
        assert list(policy.candidates()) == reference.order()
        assert len(policy) == len(reference.entries)
