"""Per-tenant byte quotas in the evictable index (kvplug.quotas.TenantQuotaIndex) and their
options (kvplug.options.EvictionOptions): own entries first, the guarantee of a tenant at or
below its quota, refusals that say why, pins, replacements, removals, reservations, the
counters per tenant, and a property check over random puts of several tenants."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvplug.errors import ConfigError
from kvplug.index import EvictableIndex
from kvplug.keys import MAX_TENANT_LENGTH, CacheKey
from kvplug.options import EvictionOptions, parse_tenant_quotas
from kvplug.quotas import (
    OTHER_TENANTS,
    UNTENANTED,
    TenantQuotaIndex,
    TenantQuotas,
    make_index,
    tenant_of_key,
)
from kvplug_cpu.backend import CpuBackend

Index = TenantQuotaIndex[str, str]


def tenant(key: str) -> str:
    """Keys of these tests are ``tenant/name``; ``/name`` has no tenant."""
    return key.partition("/")[0]


class Evictor:
    """An owner's eviction callback that records its victims and refuses the keys in
    ``busy``."""

    def __init__(self, busy: frozenset[str] = frozenset()) -> None:
        self.victims: list[str] = []
        self.busy = busy

    def __call__(self, key: str, value: str) -> bool:
        if key in self.busy:
            return False
        self.victims.append(key)
        return True


def quota_index(
    max_size: int, named: dict[str, int], default: int | None = None, policy: str = "lru"
) -> Index:
    return TenantQuotaIndex(max_size, policy, quotas=TenantQuotas(named, default), tenant_of=tenant)


def store(index: Index, key: str, nbytes: int, evict: Callable[[str, str], bool]) -> bool:
    """Make room for ``key`` as its owner would, then put it; whether it was stored."""
    if not index.make_room(nbytes, evict, replacing=key):
        return False
    index.put(key, key.upper(), nbytes)
    return True


def counters(index: EvictableIndex[str, str], name: str) -> dict[str, int | None]:
    return index.tenant_stats()[name]


# -- own entries first ------------------------------------------------------------------------


def test_a_tenant_at_its_quota_evicts_its_own_entries_in_policy_order() -> None:
    index = quota_index(1000, {"a": 30, "b": 30})
    evict = Evictor()
    for key in ("a/1", "b/1", "a/2", "a/3", "b/2"):
        assert store(index, key, 10, evict)
    index.hit("a/1")  # "a/2" is now a's least recently used

    assert store(index, "a/4", 10, evict)
    assert store(index, "a/5", 15, evict)

    assert evict.victims == ["a/2", "a/3", "a/1"]
    assert sorted(index) == ["a/4", "a/5", "b/1", "b/2"]
    assert counters(index, "a") | {"hits": 0} == {
        "quota": 30,
        "bytes_held": 25,
        "objects": 2,
        "hits": 0,
        "misses": 0,
        "evictions": 3,
        "refused": 0,
    }
    assert counters(index, "b")["evictions"] == 0


def test_own_first_follows_each_policy() -> None:
    for policy, expected in (("lru", "a/2"), ("fifo", "a/1"), ("lfu", "a/2")):
        index = quota_index(1000, {"a": 20}, policy=policy)
        evict = Evictor()
        store(index, "a/1", 10, evict)
        store(index, "a/2", 10, evict)
        index.hit("a/1")
        assert store(index, "a/3", 10, evict)
        assert evict.victims == [expected], policy


def test_replacing_a_key_counts_its_current_bytes_as_free_within_the_quota() -> None:
    index = quota_index(1000, {"a": 30})
    evict = Evictor()
    store(index, "a/1", 10, evict)
    store(index, "a/2", 20, evict)

    assert store(index, "a/2", 20, evict)  # same size: fits without evicting
    assert store(index, "a/1", 5, evict)  # smaller
    assert evict.victims == []
    assert counters(index, "a")["bytes_held"] == 25
    assert counters(index, "a")["objects"] == 2

    assert store(index, "a/1", 15, evict)  # 20 + 15 > 30: a/2 goes, never a/1 itself
    assert evict.victims == ["a/2"]
    assert (len(index), counters(index, "a")["bytes_held"]) == (1, 15)


def test_removing_and_updating_keep_the_tenant_bytes_exact() -> None:
    index = quota_index(1000, {"a": 30})
    evict = Evictor()
    store(index, "a/1", 10, evict)
    store(index, "a/2", 10, evict)

    assert index.remove("a/1") == "A/1"
    assert index.remove("a/1") is None
    index.update("a/2", "A/2 again", 25)
    assert counters(index, "a") | {"evictions": 0} == {
        "quota": 30,
        "bytes_held": 25,
        "objects": 1,
        "hits": 0,
        "misses": 0,
        "evictions": 0,
        "refused": 0,
    }
    assert store(index, "a/3", 5, evict)
    assert not store(index, "a/4", 1, Evictor(busy=frozenset({"a/2", "a/3"})))

    index.remove("a/2")
    index.remove("a/3")
    assert counters(index, "a")["bytes_held"] == counters(index, "a")["objects"] == 0
    assert index.bytes_held == 0


# -- refusals ---------------------------------------------------------------------------------


def test_an_object_larger_than_the_quota_is_refused_with_the_tenant_its_quota_and_the_fix() -> None:
    index = quota_index(1000, {"a": 30})
    evict = Evictor()
    store(index, "a/1", 10, evict)

    assert not store(index, "a/big", 31, evict)

    assert evict.victims == [] and "a/1" in index
    message = index.quota_refusal("a/big", 31)
    assert message is not None
    assert "31 bytes is larger than tenant 'a''s quota of 30 bytes" in message
    assert "tenant_quotas" in message and "smaller chunks" in message
    assert counters(index, "a")["refused"] == 1


def test_a_tenant_whose_own_entries_cannot_go_is_refused_and_others_are_untouched() -> None:
    index = quota_index(1000, {"a": 20})
    evict = Evictor()
    store(index, "a/1", 10, evict)
    store(index, "a/2", 10, evict)
    store(index, "/free", 10, evict)  # untenanted, and the tier has room to spare
    index.pin("a/1")

    assert not store(index, "a/3", 10, Evictor(busy=frozenset({"a/2"})))

    assert sorted(index) == ["/free", "a/1", "a/2"]
    message = index.quota_refusal("a/3", 10)
    assert message is not None
    assert "tenant 'a' holds 20 bytes of its quota of 20 bytes" in message
    assert "unpin its keys" in message
    assert index.quota_refusal("/free", 10) is None  # no quota, nothing to say

    assert store(index, "a/3", 10, evict)  # a/2 may go now; pinned a/1 never
    assert evict.victims == ["a/2"]


def test_a_full_tier_says_which_bytes_are_guaranteed_to_other_tenants() -> None:
    index = quota_index(40, {"a": 20, "b": 20})
    evict = Evictor()
    store(index, "a/1", 20, evict)
    store(index, "b/1", 20, evict)
    index.pin("b/1")

    assert not store(index, "/x", 10, evict)

    assert evict.victims == []
    assert index.quota_refusal("/x", 10) is None
    note = index.guarantee_note("/x")
    assert "40 bytes belong to 2 other tenants within their quotas" in note
    assert index.guarantee_note("a/2").startswith("20 bytes belong to 1 other tenants")
    assert counters(index, UNTENANTED)["refused"] == 1


# -- the guarantee ------------------------------------------------------------------------------


def test_a_tenant_within_its_quota_is_never_evicted_for_another() -> None:
    index = quota_index(100, {"b": 40})
    evict = Evictor()
    for i in range(4):
        store(index, f"b/{i}", 10, evict)
    for i in range(50):  # "a" has no quota: it floods the tier
        assert store(index, f"a/{i}", 10, evict)

    assert {k for k in index if tenant(k) == "b"} == {"b/0", "b/1", "b/2", "b/3"}
    assert all(tenant(victim) == "a" for victim in evict.victims)
    assert len(evict.victims) == 50 - 6  # room for six of a's beside b's four
    assert counters(index, "b")["evictions"] == 0
    assert counters(index, OTHER_TENANTS)["evictions"] == 44


def test_victims_come_from_the_tenant_most_over_its_quota_first() -> None:
    index = quota_index(100, {"a": 10, "b": 10})
    evict = Evictor()
    # Entries stored before the quotas were lowered, as a reopened disk tier finds them.
    for key, nbytes in (("a/1", 20), ("a/2", 20), ("b/1", 20), ("/u", 25)):
        index.put(key, key, nbytes)

    assert store(index, "c/1", 20, evict)  # over by: a 30, /u 25 (no quota: all), b 10
    assert evict.victims == ["a/1"]
    assert store(index, "c/2", 30, evict)  # /u 25, c 20, a 10, b 10
    assert evict.victims == ["a/1", "/u"]
    assert store(index, "c/3", 20, evict)  # c 50, a 10, b 10
    assert evict.victims == ["a/1", "/u", "c/1"]
    assert sorted(index) == ["a/2", "b/1", "c/2", "c/3"]


def test_a_tenant_within_its_quota_makes_room_from_its_own_entries_as_a_last_resort() -> None:
    index = quota_index(40, {"a": 30, "b": 20})
    evict = Evictor()
    store(index, "a/1", 10, evict)
    store(index, "b/1", 20, evict)
    store(index, "/u", 10, evict)
    index.pin("/u")

    assert store(index, "a/2", 10, evict)  # only a's own a/1 may go: b is within its quota
    assert evict.victims == ["a/1"]


def test_eviction_no_tenant_asked_for_takes_guaranteed_entries_only_when_nothing_else_can_go() -> (
    None
):
    index = quota_index(100, {"a": 40, "b": 40})
    evict = Evictor()
    store(index, "b/1", 10, evict)
    store(index, "a/1", 20, evict)
    store(index, "a/2", 20, evict)
    store(index, "/u", 10, evict)

    assert index.reclaim(30, evict) == 30
    # the untenanted key first, then a (which holds the most), never b while a has some
    assert evict.victims == ["/u", "a/1"]
    assert index.evict_one(evict) and evict.victims[-1] == "a/2"
    assert index.evict_one(evict) and evict.victims[-1] == "b/1"
    assert not index.evict_one(evict)


def test_reservations_count_against_the_quota_until_committed_or_cancelled() -> None:
    index = quota_index(1000, {"a": 30})
    evict = Evictor()
    first = index.reserve(20, evict, replacing="a/1")
    assert first is not None
    assert index.reserve(20, evict, replacing="a/2") is None  # 20 reserved + 20 > 30
    assert index.quota_refusal("a/2", 20) is not None

    index.cancel(first)
    index.cancel(first)  # once is enough
    second = index.reserve(20, evict, replacing="a/2")
    assert second is not None
    index.commit(second, "a/2", "A/2")
    assert counters(index, "a")["bytes_held"] == 20
    assert index.reserved == 0

    third = index.reserve(20, evict, replacing="a/3")  # a/2 makes room
    assert third is not None and evict.victims == ["a/2"]
    index.commit(third, "a/3", "A/3")
    assert sorted(index) == ["a/3"]


def test_clear_forgets_every_entry_but_keeps_open_reservations_and_the_counters() -> None:
    index = quota_index(1000, {"a": 30})
    evict = Evictor()
    store(index, "a/1", 10, evict)
    index.hit("a/1")
    writing = index.reserve(10, evict, replacing="a/2")
    assert writing is not None

    assert index.clear() == ["A/1"]

    assert counters(index, "a")["bytes_held"] == 0 and counters(index, "a")["hits"] == 1
    assert index.reserve(25, evict, replacing="a/3") is None  # the open 10 still count
    index.commit(writing, "a/2", "A/2")
    assert store(index, "a/3", 20, evict)
    assert evict.victims == []
    assert counters(index, "a")["bytes_held"] == 30


# -- counters -----------------------------------------------------------------------------------


def test_counters_name_the_quota_tenants_and_sum_the_others_and_the_untenanted() -> None:
    index = quota_index(1000, {"a": 100}, default=50)
    evict = Evictor()
    for key in ("a/1", "x/1", "y/1", "/1"):
        store(index, key, 10, evict)
    for key in ("a/1", "a/2", "x/1", "y/1", "y/2", "/1", "/2"):
        index.hit(key)
    index.missed("z/1")

    stats = index.tenant_stats()
    assert sorted(stats) == sorted(["a", OTHER_TENANTS, UNTENANTED])
    assert (stats["a"]["quota"], stats[OTHER_TENANTS]["quota"], stats[UNTENANTED]["quota"]) == (
        100,
        50,
        None,
    )
    hits_misses = {name: (s["objects"], s["hits"], s["misses"]) for name, s in stats.items()}
    assert hits_misses == {"a": (1, 1, 1), OTHER_TENANTS: (2, 2, 2), UNTENANTED: (1, 1, 1)}


def test_without_quotas_the_index_is_the_plain_one() -> None:
    plain: EvictableIndex[str, str] = make_index(100, quotas=TenantQuotas())
    assert type(plain) is EvictableIndex and not plain.tracks_tenants
    assert plain.tenant_stats() == {} and plain.quota_refusal("a/1", 10) is None
    assert plain.guarantee_note("a/1") == ""
    plain.missed("a/1")  # nothing to count
    quoted: EvictableIndex[str, str] = make_index(100, quotas=TenantQuotas(default=10))
    assert isinstance(quoted, TenantQuotaIndex) and quoted.tracks_tenants


def test_the_tenant_of_a_cache_key_is_its_salt_and_none_is_untenanted() -> None:
    key = CacheKey("m", 1, 0, 7)
    assert tenant_of_key(key) == "" and tenant_of_key("not a key") == ""
    assert tenant_of_key(key.with_tenant("team a")) == "team a"
    index: EvictableIndex[CacheKey, str] = make_index(100, quotas=TenantQuotas({"team a": 10}))
    index.put(key.with_tenant("team a"), "v", 10)
    index.put(key, "v", 10)
    assert index.tenant_stats()["team a"]["bytes_held"] == 10
    assert index.tenant_stats()[UNTENANTED]["bytes_held"] == 10


# -- the property ---------------------------------------------------------------------------------

MAX_SIZE = 24
QUOTAS = {"a": 16, "b": 12}  # more than MAX_SIZE together: a and b alone can fill the tier
TENANTS = ["a", "b", "c", ""]  # c has no quota; "" is untenanted


operation = st.tuples(
    st.sampled_from(["put"] * 6 + ["hit", "remove", "pin"]),
    st.sampled_from(TENANTS),
    st.integers(0, 5),
    st.integers(1, 10),
)
"""``(action, tenant, key number, bytes of a put)``."""
# b fills its quota, a comes near its own, and then a needs room the tier does not have.
FILLED_BY_GUARANTEED = [
    ("put", "b", 0, 8),
    ("put", "b", 1, 4),
    ("put", "a", 0, 8),
    ("put", "a", 1, 4),
    ("put", "a", 2, 1),
]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["lru", "lfu", "fifo"]), st.lists(operation, max_size=60))
@example("lru", FILLED_BY_GUARANTEED)
def test_no_tenant_within_its_quota_loses_an_entry_to_another_tenants_put(
    policy: str, operations: list[tuple[str, str, int, int]]
) -> None:
    index = quota_index(MAX_SIZE, QUOTAS, policy=policy)

    def usage(name: str) -> int:
        return sum(index.nbytes(k) for k in index if tenant(k) == name)

    for action, owner, number, nbytes in operations:
        key = f"{owner}/{number}"
        if action == "hit":
            index.hit(key)
        elif action == "remove":
            index.remove(key)
        elif action == "pin":
            index.pin(key, ttl=3600.0)
        else:
            guaranteed = {
                name for name, quota in QUOTAS.items() if name != owner and usage(name) <= quota
            }
            evict = Evictor()
            stored = store(index, key, nbytes, evict)
            lost = [victim for victim in evict.victims if tenant(victim) in guaranteed]
            assert lost == [], f"{lost} evicted for {key}, within their quotas"
            assert all(not index.is_pinned(victim) for victim in evict.victims)
            if stored and owner in QUOTAS:
                assert usage(owner) <= QUOTAS[owner]
        assert index.bytes_held <= MAX_SIZE
        stats = index.tenant_stats()
        for name in QUOTAS:
            assert stats[name]["bytes_held"] == usage(name)
            assert stats[name]["objects"] == sum(1 for k in index if tenant(k) == name)
        assert stats[OTHER_TENANTS]["bytes_held"] == usage("c")
        assert stats[UNTENANTED]["bytes_held"] == usage("")
        assert sum(s["bytes_held"] or 0 for s in stats.values()) == index.bytes_held


# -- options --------------------------------------------------------------------------------------


def test_quotas_come_from_a_mapping_or_the_url_form() -> None:
    options = EvictionOptions.model_validate(
        {"tenant_quotas": {"team-a": "2GiB", "team b": 4096}, "default_tenant_quota": "1MiB"}
    )
    assert options.tenant_quotas == {"team-a": 2 << 30, "team b": 4096}
    assert options.quotas == TenantQuotas({"team-a": 2 << 30, "team b": 4096}, 1 << 20)
    url_form = EvictionOptions.model_validate({"tenant_quotas": "team-a:2GiB, a:b:1KiB"})
    assert url_form.tenant_quotas == {"team-a": 2 << 30, "a:b": 1024}
    assert EvictionOptions().quotas is None
    assert EvictionOptions.model_validate({"tenant_quotas": ""}).quotas is None
    assert parse_tenant_quotas(None) == {}


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("team-a", "item 'team-a' is not 'tenant:size'"),
        (":1GiB", "is not 'tenant:size'"),
        ("team-a:1GiB,team-a:2GiB", "names tenant 'team-a' twice"),
        ("team-a:5,5GiB", "is not 'tenant:size'"),
        ("team-a:lots", "the quota of tenant 'team-a' in tenant_quotas must be a whole size"),
        ({"team-a": -1}, "it is negative"),
        ({1: "1GiB"}, "not a tenant name; quote it"),
        ({"x" * (MAX_TENANT_LENGTH + 1): "1GiB"}, "at most 128 are allowed"),
        ({"bad\x00name": "1GiB"}, "cannot contain NUL"),
        ({UNTENANTED: "1GiB"}, "cannot name '(none)'"),
        ({OTHER_TENANTS: "1GiB"}, "use default_tenant_quota"),
        (["team-a", "1GiB"], "must be a mapping of tenant to size"),
    ],
)
def test_a_bad_quota_is_refused_naming_what_is_wrong(value: object, words: str) -> None:
    with pytest.raises(ConfigError, match="(?i)" + re.escape(words)):
        parse_tenant_quotas(value)


def test_a_quota_larger_than_the_tier_is_an_error_and_quotas_may_add_up_to_more() -> None:
    with pytest.raises(ConfigError, match=r"tenant 'a', 2\.0MiB, is larger than the tier's max_"):
        CpuBackend("cpu://?max_size=1MiB&tenant_quotas=a:2MiB")
    with pytest.raises(ConfigError, match=r"quota of default_tenant_quota, 2\.0MiB, is larger"):
        CpuBackend("cpu://?max_size=1MiB", default_tenant_quota="2MiB")
    with pytest.raises(ConfigError, match=r"tenant_quotas=.*names tenant 'a' twice"):
        CpuBackend("cpu://?tenant_quotas=a:1MiB,a:2MiB")
    overcommitted = CpuBackend(
        "cpu://?max_size=1MiB&tenant_quotas=a:1MiB,b:1MiB&default_tenant_quota=512KiB"
    )
    quotas = overcommitted.options.quotas
    assert quotas is not None and quotas.quota_of("c") == 512 << 10
