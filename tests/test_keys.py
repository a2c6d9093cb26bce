"""Unit tests of kvplug.keys: CacheKey string form, parsing, and stable chunk hashing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplug.errors import ConfigError
from kvplug.keys import (
    LMCACHE_DTYPE_NAMES,
    CacheKey,
    InvalidKey,
    chain_hash,
    chunk_hashes,
    chunk_keys,
    lmcache_dtype_name,
)

MODEL = "meta-llama/Llama-3.1-8B"


# --------------------------------------------------------------------------- string form


def test_string_form_is_lmcache_0_5s() -> None:
    key = CacheKey(MODEL, 1, 0, -0x123)
    assert str(key) == "meta-llama/Llama-3.1-8B@1@0@-123@half"
    assert key.to_string() == str(key)
    assert key.namespace == "meta-llama/Llama-3.1-8B@1@0"
    assert key.chunk_hash_hex == "-123"


def test_string_form_with_dtype_and_tags_in_insertion_order() -> None:
    key = CacheKey(MODEL, 4, 3, 0x99, "bfloat16", (("user", "alice"), ("lora", "a1")))
    assert str(key) == "meta-llama/Llama-3.1-8B@4@3@99@bfloat16@user%alice@lora%a1"
    assert CacheKey.parse(str(key)) == key


def test_a_bytes_hash_is_written_as_hex_with_its_leading_zeros() -> None:
    key = CacheKey(MODEL, 1, 0, bytes.fromhex("000a1f"))
    assert str(key) == "meta-llama/Llama-3.1-8B@1@0@000a1f@half"
    parsed = CacheKey.parse(str(key))
    assert parsed.chunk_hash == bytes.fromhex("000a1f")
    assert parsed == key


def test_keys_with_one_string_form_are_one_key_and_others_are_not() -> None:
    # LMCache names a chunk by its hex text, so the int and the bytes spelling of one hash are
    # one stored object; leading zero bytes make another hash.
    assert CacheKey(MODEL, 1, 0, b"\x1f") == CacheKey(MODEL, 1, 0, 0x1F)
    assert hash(CacheKey(MODEL, 1, 0, b"\x1f")) == hash(CacheKey(MODEL, 1, 0, 0x1F))
    assert CacheKey(MODEL, 1, 0, b"\x00\x1f") != CacheKey(MODEL, 1, 0, 0x1F)
    assert CacheKey(MODEL, 1, 0, 7, "half") != CacheKey(MODEL, 1, 0, 7, "bfloat16")


def test_tags_given_as_mapping_become_a_tuple() -> None:
    key = CacheKey(MODEL, 1, 0, 5, tags={"user": "alice"})  # type: ignore[arg-type]
    assert key.tags == (("user", "alice"),)
    assert str(key).endswith("@5@half@user%alice")
    assert hash(key) == hash(CacheKey(MODEL, 1, 0, 5, tags=(("user", "alice"),)))


def test_parse_lmcache_examples() -> None:
    key = CacheKey.parse("meta-llama/Llama-3.1-8B@1@0@-123@half")
    assert key == CacheKey(MODEL, 1, 0, -0x123)
    tagged = CacheKey.parse("meta-llama/Llama-3.1-8B@1@0@7b@float@user%alice")
    assert tagged.tags == (("user", "alice"),)
    assert (tagged.chunk_hash, tagged.dtype) == (0x7B, "float")


def test_tag_value_may_contain_percent_and_model_may_contain_percent() -> None:
    key = CacheKey.parse("m%odel@2@1@7@half@k%v%w")
    assert key.model_name == "m%odel"
    assert key.tags == (("k", "v%w"),)
    assert str(key) == "m%odel@2@1@7@half@k%v%w"


def test_keys_are_hashable_ordered_and_immutable() -> None:
    a = CacheKey(MODEL, 1, 0, 1)
    b = CacheKey(MODEL, 1, 0, 2)
    assert a < b
    assert sorted([b, a]) == [a, b]
    assert len({a, b, CacheKey.parse(str(a))}) == 2
    with pytest.raises(AttributeError):
        a.chunk_hash = 3  # type: ignore[misc]


def test_with_hash_keeps_namespace_dtype_and_tags() -> None:
    key = CacheKey(MODEL, 8, 7, 1, "bfloat16", (("user", "bob"),))
    other = key.with_hash(-42)
    assert other.chunk_hash == -42
    assert (other.namespace, other.dtype, other.tags) == (key.namespace, key.dtype, key.tags)


def test_lmcache_dtype_names() -> None:
    assert lmcache_dtype_name(torch.float16) == "half"
    assert lmcache_dtype_name(torch.float8_e4m3fn) == "fp8_e4m3fn"
    with pytest.raises(InvalidKey, match="no LMCache key name"):
        lmcache_dtype_name(torch.complex64)


# --------------------------------------------------------------------------- round trip

_FIELD_ALPHABET = st.characters(
    codec="utf-8", exclude_categories=("Cs", "Cc"), exclude_characters="@%"
)
_model = st.text(
    st.characters(codec="utf-8", exclude_categories=("Cs", "Cc"), exclude_characters="@"),
    min_size=1,
    max_size=40,
)
_tag_key = st.text(_FIELD_ALPHABET, min_size=1, max_size=8)
_tag_value = _model


@st.composite
def cache_keys(draw: st.DrawFn) -> CacheKey:
    world = draw(st.integers(1, 1024))
    return CacheKey(
        draw(_model),
        world,
        draw(st.integers(0, world - 1)),
        draw(st.integers(-(1 << 63), (1 << 63) - 1) | st.binary(min_size=1, max_size=40)),
        draw(st.sampled_from(sorted(LMCACHE_DTYPE_NAMES.values()))),
        tuple(draw(st.lists(st.tuples(_tag_key, _tag_value), max_size=3))),
    )


@settings(max_examples=300, deadline=None)
@given(cache_keys())
def test_random_keys_round_trip(key: CacheKey) -> None:
    text = str(key)
    parsed = CacheKey.parse(text)
    assert parsed == key
    assert str(parsed) == text


@settings(max_examples=300, deadline=None)
@given(cache_keys(), cache_keys())
def test_distinct_keys_have_distinct_string_forms(a: CacheKey, b: CacheKey) -> None:
    same_fields = (a.model_name, a.world_size, a.worker_id, a.chunk_hash_hex, a.dtype, a.tags) == (
        b.model_name,
        b.world_size,
        b.worker_id,
        b.chunk_hash_hex,
        b.dtype,
        b.tags,
    )
    assert (str(a) == str(b)) == same_fields == (a == b)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=60) | st.from_regex(r"m@1@0@-?[0-9a-fA-F]{0,6}@half", fullmatch=True))
def test_parse_of_arbitrary_text_is_invalid_key_or_canonical(text: str) -> None:
    try:
        key = CacheKey.parse(text)
    except InvalidKey:
        return
    assert str(key) == text


# --------------------------------------------------------------------------- strict parser


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "fields"),
        ("model@1@0@5", "at least five"),
        ("model", "at least five"),
        ("model@one@0@5@half", "world_size 'one' is not an integer"),
        ("model@1@zero@5@half", "worker_id 'zero' is not an integer"),
        ("model@1@0@0x10@half", "chunk hash '0x10'"),
        ("model@1@0@1.5@half", "chunk hash"),
        ("model@1@0@@half", "chunk hash ''"),
        ("model@1@0@AB@half", "lowercase"),
        ("model@1@0@0ab@half", "two digits a byte"),
        ("model@1@0@-0@half", "chunk hash"),
        ("model@1@0@-01@half", "chunk hash"),
        ("model@1@0@\u0661@half", "chunk hash"),
        ("model@@0@5@half", "world_size '' is not an integer"),
        ("model@1_0@0@5@half", "world_size"),
        ("model@+1@0@5@half", "world_size"),
        ("model@ 1@0@5@half", "world_size"),
        ("model@01@0@5@half", "world_size"),
        ("model@1@0@5@float16", "not one of LMCache's dtype names"),
        ("model@1@0@5@half@3", "per-layer keys"),
        ("model@1@0@5@half@user", "field 'user' after the dtype has no '%'"),
        ("model@1@0@5@half@user%alice@", "field '' after the dtype"),
        ("model@1@0@5@half@%alice", "tags key"),
        ("model@1@0@5@half@user%", "tags value"),
        ("@1@0@5@half", "model_name"),
        ("model@0@0@5@half", "world_size must be >= 1"),
        ("model@2@2@5@half", "worker_id must be in"),
        ("model@2@-1@5@half", "worker_id must be in"),
        ("mo\ndel@1@0@5@half", "control characters"),
    ],
)
def test_parse_rejects_malformed_keys(text: str, message: str) -> None:
    with pytest.raises(InvalidKey) as info:
        CacheKey.parse(text)
    assert message in str(info.value)
    assert isinstance(info.value, ConfigError)


def test_parse_of_non_string_is_invalid_key() -> None:
    with pytest.raises(InvalidKey, match="bytes"):
        CacheKey.parse(b"m@1@0@5@half")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"model_name": "org@model"}, "model_name"),
        ({"model_name": ""}, "non-empty"),
        ({"model_name": "a\x00b"}, "control characters"),
        ({"world_size": 2, "worker_id": 2}, "worker_id must be in [0, world_size=2)"),
        ({"world_size": 0}, "world_size must be >= 1"),
        ({"worker_id": -1}, "worker_id"),
        ({"world_size": "1"}, "world_size must be an int"),
        ({"chunk_hash": 1.0}, "chunk_hash must be an int or non-empty bytes"),
        ({"chunk_hash": True}, "chunk_hash must be an int"),
        ({"chunk_hash": b""}, "non-empty bytes"),
        ({"chunk_hash": "ab"}, "chunk_hash must be an int"),
        ({"dtype": "float16"}, "lmcache_dtype_name"),
        ({"tags": (("us%er", "alice"),)}, "tags key"),
        ({"tags": (("user", "al@ice"),)}, "tags value"),
        ({"tags": (("user", ""),)}, "tags value"),
    ],
)
def test_construction_rejects_invalid_fields(kwargs: dict, message: str) -> None:
    fields = {"model_name": MODEL, "world_size": 1, "worker_id": 0, "chunk_hash": 0} | kwargs
    with pytest.raises(InvalidKey) as info:
        CacheKey(**fields)
    assert message in str(info.value)


# --------------------------------------------------------------------------- hashing

_HASH_SCRIPT = """
import json, sys
from kvplug.keys import chunk_hashes, chain_hash
tokens = list(range(1000)) + [2**40, -5]
print(json.dumps([chunk_hashes(tokens, chunk_size=256), chain_hash(0, [1, 2, 3]),
                  hash("salted")]))
"""


def test_chunk_hashes_are_stable_across_processes() -> None:
    results = []
    for seed in ("1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run(
            [sys.executable, "-c", _HASH_SCRIPT],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        results.append(json.loads(out.stdout))
    (hashes_a, single_a, salted_a), (hashes_b, single_b, salted_b) = results
    assert salted_a != salted_b  # the seeds really differ
    assert hashes_a == hashes_b
    assert single_a == single_b
    tokens = [*range(1000), 2**40, -5]
    assert chunk_hashes(tokens, chunk_size=256) == hashes_a
    assert chain_hash(0, [1, 2, 3]) == single_a


def test_chain_hash_is_signed_64_bit_and_depends_on_prefix() -> None:
    values = {chain_hash(prefix, [1, 2, 3]) for prefix in (0, 1, -1, 2**63 - 1, -(2**63))}
    assert len(values) == 5
    for value in values:
        assert -(2**63) <= value < 2**63
    assert chain_hash(7, [1, 2, 3]) == chain_hash(7, np.array([1, 2, 3], dtype=np.int32))
    assert chain_hash(-1, [9]) == chain_hash(2**64 - 1, [9])


def test_chunk_hashes_count_and_chaining() -> None:
    tokens = list(range(600))
    hashes = chunk_hashes(tokens, chunk_size=256)
    assert len(hashes) == 3
    assert hashes[0] == chain_hash(0, tokens[:256])
    assert hashes[1] == chain_hash(hashes[0], tokens[256:512])
    assert hashes[2] == chain_hash(hashes[1], tokens[512:])
    assert chunk_hashes([], chunk_size=256) == []
    assert chunk_hashes(tokens, chunk_size=256, prefix_hash=5)[0] == chain_hash(5, tokens[:256])


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 200_000), min_size=0, max_size=120),
    st.integers(1, 16),
    st.data(),
)
def test_prefix_hashes_equal_first_hashes_of_longer_sequence(
    tokens: list[int], chunk_size: int, data: st.DataObject
) -> None:
    cut = data.draw(st.integers(0, len(tokens)))
    full = chunk_hashes(tokens, chunk_size=chunk_size)
    prefix = chunk_hashes(tokens[:cut], chunk_size=chunk_size)
    whole_chunks = cut // chunk_size
    assert prefix[:whole_chunks] == full[:whole_chunks]
    if cut % chunk_size == 0:
        assert prefix == full[: len(prefix)]
    assert chunk_hashes(np.array(tokens, dtype=np.int64), chunk_size=chunk_size) == full


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 1 << 31), min_size=1, max_size=64),
    st.integers(0, 63),
    st.integers(1, 1 << 31),
)
def test_different_tokens_give_different_hashes(
    tokens: list[int], position: int, delta: int
) -> None:
    position %= len(tokens)
    changed = list(tokens)
    changed[position] += delta
    a = chunk_hashes(tokens, chunk_size=8)
    b = chunk_hashes(changed, chunk_size=8)
    first_changed = position // 8
    assert a[:first_changed] == b[:first_changed]
    # the chunk holding the change and every later one differ (prefix chaining)
    for i in range(first_changed, len(a)):
        assert a[i] != b[i]


def test_different_lengths_within_a_chunk_give_different_hashes() -> None:
    assert chunk_hashes([1, 2, 3]) != chunk_hashes([1, 2, 3, 0])
    assert chunk_hashes([0]) != chunk_hashes([0, 0])


def test_save_unfull_chunk() -> None:
    tokens = list(range(600))
    with_partial = chunk_hashes(tokens, chunk_size=256, save_unfull_chunk=True)
    without = chunk_hashes(tokens, chunk_size=256, save_unfull_chunk=False)
    assert len(with_partial) == 3
    assert without == with_partial[:2]
    assert chunk_hashes(tokens[:512], chunk_size=256, save_unfull_chunk=False) == without
    assert chunk_hashes(tokens[:100], chunk_size=256, save_unfull_chunk=False) == []
    assert len(chunk_hashes(tokens[:100], chunk_size=256)) == 1


def test_chunk_hashes_rejects_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="chunk_size"):
        chunk_hashes([1, 2], chunk_size=0)
    with pytest.raises(ConfigError, match="one-dimensional"):
        chunk_hashes([[1, 2], [3, 4]])


def test_chunk_keys_ranges_and_keys() -> None:
    template = CacheKey(MODEL, 2, 1, 0, tags=(("user", "alice"),))
    tokens = list(range(600))
    result = list(chunk_keys(tokens, template, chunk_size=256))
    assert [(s, e) for s, e, _ in result] == [(0, 256), (256, 512), (512, 600)]
    hashes = chunk_hashes(tokens, chunk_size=256)
    assert [k.chunk_hash for _, _, k in result] == hashes
    for _, _, key in result:
        assert key.namespace == template.namespace
        assert key.tags == template.tags
    full_only = list(chunk_keys(tokens, template, chunk_size=256, save_unfull_chunk=False))
    assert [(s, e) for s, e, _ in full_only] == [(0, 256), (256, 512)]
    exact = list(chunk_keys(tokens[:512], template, chunk_size=256))
    assert [(s, e) for s, e, _ in exact] == [(0, 256), (256, 512)]
    assert list(chunk_keys([], template)) == []


def test_a_tenant_is_part_of_the_key_so_two_tenants_never_share_a_chunk() -> None:
    plain = CacheKey("m", 2, 1, b"\x0a\x0b", "bfloat16", (("rank", "3"),))
    team_a, team_b = plain.with_tenant("team a"), plain.with_tenant("team b")
    assert len({plain, team_a, team_b}) == 3
    assert len({str(plain), str(team_a), str(team_b)}) == 3
    assert (plain.tenant, team_a.tenant, team_b.tenant) == ("", "team a", "team b")
    assert str(team_a) == "m@2@1@0a0b@bfloat16@rank%3@salt%team%20a"
    assert CacheKey.parse(str(team_a)) == team_a and CacheKey.parse(str(team_a)).tenant == "team a"
    assert team_a.with_tenant("") == plain
    assert team_a.with_hash(9).tenant == "team a"


def test_a_new_tenant_replaces_the_old_one_in_its_place() -> None:
    key = CacheKey("m", 1, 0, 1, tags=(("salt", "x"), ("group", "0")))
    moved = key.with_tenant("y")
    assert moved.tags == (("salt", "y"), ("group", "0"))


@given(st.text(min_size=1, max_size=128).filter(lambda t: "\x00" not in t))
def test_any_tenant_name_survives_the_string_form(tenant: str) -> None:
    key = CacheKey("m", 1, 0, 5).with_tenant(tenant)
    assert CacheKey.parse(str(key)).tenant == tenant


@pytest.mark.parametrize(
    ("tenant", "says"),
    [("x" * 129, "at most 128"), ("a\x00b", "NUL"), (7, "non-empty string")],
)
def test_a_name_that_is_no_tenants_is_refused_saying_why(tenant: object, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        CacheKey("m", 1, 0, 5).with_tenant(tenant)  # type: ignore[arg-type]
