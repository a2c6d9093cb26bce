"""kvplug's key string is the one LMCache writes, and LMCache's keys map onto kvplug's with
nothing lost, checked against LMCache's own key classes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lmcache.utils import TORCH_DTYPE_TO_STR_DTYPE, CacheEngineKey, LayerCacheEngineKey
from lmcache.v1.distributed.api import ObjectKey

from kvplug.keys import LMCACHE_DTYPE_NAMES, CacheKey, InvalidKey
from kvplug_lmcache.keys import (
    cache_key_to_engine_key,
    cache_key_to_object_key,
    engine_key_to_cache_key,
    object_key_to_cache_key,
)

_printable = st.characters(codec="utf-8", exclude_categories=("Cs", "Cc"), exclude_characters="@")
_model = st.text(_printable, min_size=1, max_size=30)
_tag_key = st.text(
    st.characters(codec="utf-8", exclude_categories=("Cs", "Cc"), exclude_characters="@%"),
    min_size=1,
    max_size=8,
)
_dtypes = st.sampled_from(sorted(LMCACHE_DTYPE_NAMES, key=str))


@st.composite
def engine_keys(draw: st.DrawFn) -> CacheEngineKey:
    world_size = draw(st.integers(1, 64))
    tags = draw(st.dictionaries(_tag_key, st.text(_printable, min_size=1, max_size=12)))
    return CacheEngineKey(
        model_name=draw(_model),
        world_size=world_size,
        worker_id=draw(st.integers(0, world_size - 1)),
        chunk_hash=draw(
            st.integers(-(1 << 63), (1 << 63) - 1) | st.binary(min_size=1, max_size=32)
        ),
        dtype=draw(_dtypes),
        request_configs={f"lmcache.tag.{k}": v for k, v in tags.items()} or None,
    )


_salt = st.text(
    st.characters(codec="utf-8", exclude_categories=("Cs",), exclude_characters="@/\\\x00"),
    max_size=20,
)


@st.composite
def object_keys(draw: st.DrawFn) -> ObjectKey:
    packed = st.builds(
        ObjectKey.ComputeKVRank,
        st.integers(1, 255),
        st.integers(0, 255),
        st.integers(1, 8),
        st.integers(0, 7),
    )
    return ObjectKey(
        chunk_hash=draw(st.binary(min_size=1, max_size=32)),
        model_name=draw(_model),
        kv_rank=draw(packed | st.integers(0, (1 << 40))),
        object_group_id=draw(st.integers(0, 1 << 20)),
        cache_salt=draw(_salt),
    )


def test_kvplugs_dtype_names_are_lmcaches() -> None:
    assert {d: n for d, n in TORCH_DTYPE_TO_STR_DTYPE.items() if d in LMCACHE_DTYPE_NAMES} == {
        d: LMCACHE_DTYPE_NAMES[d] for d in TORCH_DTYPE_TO_STR_DTYPE
    }


@settings(max_examples=300, deadline=None)
@given(engine_keys())
def test_an_engine_keys_string_is_lmcaches_and_parses_back_to_the_same_key(
    key: CacheEngineKey,
) -> None:
    ours = engine_key_to_cache_key(key)
    assert ours.to_string() == key.to_string()
    assert CacheKey.parse(key.to_string()) == ours
    assert cache_key_to_engine_key(ours) == key
    # LMCache's own parser reads every hash as an int (so it drops a bytes hash's leading zero
    # bytes); kvplug's keeps the text whole.
    parsed_by_lmcache = CacheEngineKey.from_string(ours.to_string())
    assert parsed_by_lmcache.chunk_hash == int(ours.chunk_hash_hex, 16)
    assert parsed_by_lmcache == cache_key_to_engine_key(
        ours.with_hash(parsed_by_lmcache.chunk_hash)
    )


@settings(max_examples=300, deadline=None)
@given(engine_keys(), engine_keys())
def test_engine_keys_are_one_kvplug_key_exactly_when_lmcache_writes_one_string(
    a: CacheEngineKey, b: CacheEngineKey
) -> None:
    assert (engine_key_to_cache_key(a) == engine_key_to_cache_key(b)) == (
        a.to_string() == b.to_string()
    )


@settings(max_examples=300, deadline=None)
@given(object_keys())
def test_an_object_key_round_trips_through_kvplugs_key_and_its_string(key: ObjectKey) -> None:
    ours = object_key_to_cache_key(key)
    assert cache_key_to_object_key(ours) == key
    assert cache_key_to_object_key(CacheKey.parse(ours.to_string())) == key


@settings(max_examples=300, deadline=None)
@given(object_keys(), object_keys())
def test_distinct_object_keys_never_share_a_stored_name(a: ObjectKey, b: ObjectKey) -> None:
    assert (object_key_to_cache_key(a).to_string() == object_key_to_cache_key(b).to_string()) == (
        a == b
    )


def test_object_keys_differing_in_one_field_are_different_kvplug_keys() -> None:
    base = ObjectKey(bytes.fromhex("00ab"), "llama", ObjectKey.ComputeKVRank(2, 1, 2, 1))
    variants = [
        ObjectKey(bytes.fromhex("ab"), "llama", base.kv_rank),
        ObjectKey(bytes.fromhex("00ab00"), "llama", base.kv_rank),
        ObjectKey(base.chunk_hash, "llama2", base.kv_rank),
        ObjectKey(base.chunk_hash, "llama", ObjectKey.ComputeKVRank(2, 0, 2, 0)),
        ObjectKey(base.chunk_hash, "llama", base.kv_rank, object_group_id=1),
        ObjectKey(base.chunk_hash, "llama", base.kv_rank, cache_salt="alice"),
        ObjectKey(base.chunk_hash, "llama", base.kv_rank, cache_salt="bob"),
        ObjectKey(base.chunk_hash, "llama", base.kv_rank, cache_salt="%61lice"),
    ]
    names = {object_key_to_cache_key(k).to_string() for k in [base, *variants]}
    assert len(names) == len(variants) + 1


def test_a_packed_kv_rank_names_the_world_size_and_worker() -> None:
    key = object_key_to_cache_key(
        ObjectKey(b"\x01", "m", ObjectKey.ComputeKVRank(8, 5, 4, 1), cache_salt="a b%c")
    )
    assert (key.world_size, key.worker_id, key.dtype) == (8, 5, "uint8")
    assert key.to_string() == f"m@8@5@01@uint8@rank%{(8 << 24) | (5 << 16) | (4 << 8) | 1}" + (
        "@group%0@salt%a%20b%25c"
    )


def test_a_key_not_written_for_an_object_key_is_refused_with_the_reason() -> None:
    with pytest.raises(InvalidKey, match="'rank' and 'group' tags"):
        cache_key_to_object_key(CacheKey("m", 1, 0, 5))


def test_a_per_layer_key_is_refused_with_the_fix() -> None:
    key = LayerCacheEngineKey("m", 1, 0, 5, torch.float16, None, layer_id=3)
    with pytest.raises(InvalidKey, match="use_layerwise"):
        engine_key_to_cache_key(key)
