"""SGLang page keys map onto kvplug keys losslessly and without collisions, each tenant's
apart; SGLang's own page hashes already differ per request salt, which it never passes to the
storage."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.utils import get_hash_str, get_storage_hash_str

from kvplug.keys import MAX_TENANT_LENGTH, CacheKey, InvalidKey
from kvplug_sglang.keys import UNNAMED_MODEL, PageNamespace, model_field, page_hash, page_key_of

NS = PageNamespace("test-model", 2, 1, "bfloat16", layout="page_first", segments=2)
hex_keys = st.binary(min_size=1, max_size=40).map(bytes.hex)
any_keys = st.text(min_size=1, max_size=40).filter(lambda s: "\x00" not in s) | hex_keys


def test_sglangs_own_page_hashes_become_the_hash_bytes() -> None:
    pages = get_hash_str(list(range(64)), None, page_size=16)
    assert isinstance(pages, list) and len(pages) == 4
    for page in pages:
        chunk_hash, tags = page_hash(page)
        assert chunk_hash == bytes.fromhex(page) and len(chunk_hash) == hashlib.sha256().digest_size
        assert tags == ()
        assert [page_key_of(key) for key in NS.segment_keys(page)] == [page, page]


@given(any_keys)
def test_every_page_key_round_trips_through_its_cache_keys(page: str) -> None:
    for key in NS.segment_keys(page):
        assert page_key_of(key) == page
        assert CacheKey.parse(str(key)) == key
        assert NS.owns(key)


@given(any_keys, any_keys)
def test_two_page_keys_share_a_cache_key_only_when_equal(a: str, b: str) -> None:
    assert (set(NS.segment_keys(a)) & set(NS.segment_keys(b)) != set()) == (a == b)


def test_a_text_key_never_collides_with_the_hex_key_of_its_bytes() -> None:
    text = "zz"
    assert NS.segment_keys(text) != NS.segment_keys(text.encode().hex())
    upper = "AB"  # not lowercase hex: kept as text, so "ab" stays a different page
    assert NS.segment_keys(upper) != NS.segment_keys("ab")


def test_segments_ranks_layouts_and_dtypes_are_distinct_keys() -> None:
    page = "0f" * 32
    variants = [
        NS,
        PageNamespace("test-model", 2, 0, "bfloat16", layout="page_first", segments=2),
        PageNamespace("test-model", 1, 0, "bfloat16", layout="page_first", segments=2),
        PageNamespace("test-model", 2, 1, "half", layout="page_first", segments=2),
        PageNamespace("test-model", 2, 1, "bfloat16", layout="page_first_direct", segments=2),
        PageNamespace("test-model", 2, 1, "bfloat16", layout="page_first", segments=1),
        PageNamespace("test-model", 2, 1, "bfloat16", "page_first", 2, shard_tags=(("pp", "1/2"),)),
        PageNamespace("test-model", 2, 1, "bfloat16", "page_first", 2, shard_tags=(("cp", "0/2"),)),
        PageNamespace("other-model", 2, 1, "bfloat16", layout="page_first", segments=2),
    ]
    keys = [key for ns in variants for key in ns.segment_keys(page)]
    assert len(set(keys)) == len(keys)
    assert not variants[1].owns(NS.segment_keys(page)[0])


@pytest.mark.parametrize("bad", ["", None, 7])
def test_a_page_key_must_be_a_non_empty_string(bad: object) -> None:
    with pytest.raises(InvalidKey, match="non-empty string"):
        page_hash(bad)  # type: ignore[arg-type]


def test_a_model_name_with_an_at_sign_is_refused_with_the_reason() -> None:
    with pytest.raises(InvalidKey, match="'@' separates key fields"):
        PageNamespace("org@model", 1, 0, "half", layout="page_first")


@given(st.text(max_size=40), st.text(max_size=40))
def test_every_model_name_is_a_key_field_and_two_names_never_share_one(a: str, b: str) -> None:
    for name in (a, b):
        field = model_field(name)
        PageNamespace(field, 1, 0, "half", layout="page_first")  # a valid key field
        assert (field == UNNAMED_MODEL) == (not name)
    assert (model_field(a) == model_field(b)) == (a == b or not (a or b))


def test_a_model_name_keeps_every_character_but_the_escaped_ones() -> None:
    assert model_field("Qwen/Qwen3-8B-mxfp8") == "Qwen/Qwen3-8B-mxfp8"
    assert model_field("/models/llama@v2") == "/models/llama%40v2"
    assert model_field("/models/llama%40v2") == "/models/llama%2540v2"
    assert model_field(None) == model_field("") == UNNAMED_MODEL


tenants = st.text(min_size=1, max_size=MAX_TENANT_LENGTH).filter(lambda text: "\x00" not in text)


@given(any_keys, tenants)
def test_a_tenants_page_keys_name_the_tenant_last_and_round_trip(page: str, tenant: str) -> None:
    theirs = dataclasses.replace(NS, tenant=tenant)
    keys = theirs.segment_keys(page)
    assert keys == [key.with_tenant(tenant) for key in NS.segment_keys(page)]
    for key in keys:
        parsed = CacheKey.parse(str(key))
        assert parsed == key and parsed.tenant == tenant
        assert page_key_of(key) == page
        assert theirs.owns(key) and not NS.owns(key)


@given(any_keys, tenants, tenants)
def test_the_same_page_of_two_tenants_is_two_keys(page: str, a: str, b: str) -> None:
    ours, theirs = dataclasses.replace(NS, tenant=a), dataclasses.replace(NS, tenant=b)
    assert (set(ours.segment_keys(page)) & set(theirs.segment_keys(page)) != set()) == (a == b)
    assert not set(ours.segment_keys(page)) & set(NS.segment_keys(page))


@pytest.mark.parametrize("bad", ["x" * (MAX_TENANT_LENGTH + 1), "a\x00b"])
def test_a_tenant_that_is_no_tenant_name_is_refused(bad: str) -> None:
    with pytest.raises(InvalidKey):
        dataclasses.replace(NS, tenant=bad)


def test_sglang_folds_a_requests_salt_into_its_page_hashes_but_passes_the_hashes_alone() -> None:
    """SGLang's own storage hashes (``get_storage_hash_str``, seeded by
    ``storage_namespace_seed``): the same tokens under two cache salts, an extra key, or none
    are four chains with no page in common. What a storage call gets besides the hashes is
    ``HiCacheStorageExtraInfo``, which has no field for either."""
    tokens = list(range(64))
    chains = [
        get_storage_hash_str(tokens, None, page_size=16),
        get_storage_hash_str(RadixKey(tokens, cache_salt="team-a"), None, page_size=16),
        get_storage_hash_str(RadixKey(tokens, cache_salt="team-b"), None, page_size=16),
        get_storage_hash_str(RadixKey(tokens, extra_key="lora-1"), None, page_size=16),
    ]
    pages = [page for chain in chains for page in chain]
    assert len(pages) == 16 and len(set(pages)) == 16
    fields = {field.name for field in dataclasses.fields(HiCacheStorageExtraInfo)}
    assert fields == {"prefix_keys", "extra_info"}
