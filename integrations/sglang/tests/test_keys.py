"""SGLang page keys map onto kvplug keys losslessly and without collisions."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sglang.srt.mem_cache.utils import get_hash_str

from kvplug.keys import CacheKey, InvalidKey
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
