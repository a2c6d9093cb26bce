"""Unit tests of kvplug.keys: CacheKey string form, parsing, and stable chunk hashing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplug.errors import ConfigError
from kvplug.keys import CacheKey, InvalidKey, chain_hash, chunk_hashes, chunk_keys

MODEL = "meta-llama/Llama-3.1-8B"


# --------------------------------------------------------------------------- string form


def test_string_form_is_lmcache_compatible() -> None:
    key = CacheKey("vllm", MODEL, 1, 0, -123)
    assert str(key) == "vllm@meta-llama/Llama-3.1-8B@1@0@-123"
    assert key.to_string() == str(key)
    assert key.namespace == "vllm@meta-llama/Llama-3.1-8B@1@0"


def test_string_form_with_tags_in_insertion_order() -> None:
    key = CacheKey("vllm", MODEL, 4, 3, 99, (("user", "alice"), ("lora", "a1")))
    assert str(key) == "vllm@meta-llama/Llama-3.1-8B@4@3@99@user%alice@lora%a1"
    assert CacheKey.parse(str(key)) == key


def test_tags_given_as_mapping_become_a_tuple() -> None:
    key = CacheKey("vllm", MODEL, 1, 0, 5, {"user": "alice"})  # type: ignore[arg-type]
    assert key.tags == (("user", "alice"),)
    assert str(key).endswith("@5@user%alice")
    assert hash(key) == hash(CacheKey("vllm", MODEL, 1, 0, 5, (("user", "alice"),)))


def test_parse_lmcache_examples() -> None:
    key = CacheKey.parse("vllm@meta-llama/Llama-3.1-8B@1@0@-123")
    assert key == CacheKey("vllm", MODEL, 1, 0, -123)
    tagged = CacheKey.parse("vllm@meta-llama/Llama-3.1-8B@1@0@123@user%alice")
    assert tagged.tags == (("user", "alice"),)
    assert tagged.chunk_hash == 123


def test_tag_value_may_contain_percent_and_model_may_contain_percent() -> None:
    key = CacheKey.parse("vllm@m%odel@2@1@7@k%v%w")
    assert key.model_name == "m%odel"
    assert key.tags == (("k", "v%w"),)
    assert str(key) == "vllm@m%odel@2@1@7@k%v%w"


def test_keys_are_hashable_ordered_and_immutable() -> None:
    a = CacheKey("vllm", MODEL, 1, 0, 1)
    b = CacheKey("vllm", MODEL, 1, 0, 2)
    assert a < b
    assert len({a, b, CacheKey.parse(str(a))}) == 2
    with pytest.raises(AttributeError):
        a.chunk_hash = 3  # type: ignore[misc]


def test_with_hash_keeps_namespace_and_tags() -> None:
    key = CacheKey("sglang", MODEL, 8, 7, 1, (("user", "bob"),))
    other = key.with_hash(-42)
    assert other.chunk_hash == -42
    assert other.namespace == key.namespace
    assert other.tags == key.tags


# --------------------------------------------------------------------------- round trip

_FIELD_ALPHABET = st.characters(
    codec="utf-8", exclude_categories=("Cs", "Cc"), exclude_characters="@%"
)
_fmt = st.text(_FIELD_ALPHABET, min_size=1, max_size=12)
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
        draw(_fmt),
        draw(_model),
        world,
        draw(st.integers(0, world - 1)),
        draw(st.integers(-(1 << 63), (1 << 63) - 1)),
        tuple(draw(st.lists(st.tuples(_tag_key, _tag_value), max_size=3))),
    )


@settings(max_examples=300, deadline=None)
@given(cache_keys())
def test_random_keys_round_trip(key: CacheKey) -> None:
    text = str(key)
    parsed = CacheKey.parse(text)
    assert parsed == key
    assert str(parsed) == text


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=60))
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
        ("vllm@model@1@0", "at least five"),
        ("vllm", "at least five"),
        ("vllm@model@one@0@5", "world_size 'one' is not an integer"),
        ("vllm@model@1@zero@5", "worker_id 'zero' is not an integer"),
        ("vllm@model@1@0@0x10", "chunk_hash '0x10' is not an integer"),
        ("vllm@model@1@0@1.5", "chunk_hash"),
        ("vllm@model@1@0@", "chunk_hash '' is not an integer"),
        ("vllm@model@@0@5", "world_size '' is not an integer"),
        ("vllm@model@1_0@0@5", "world_size"),
        ("vllm@model@+1@0@5", "world_size"),
        ("vllm@model@ 1@0@5", "world_size"),
        ("vllm@model@01@0@5", "world_size"),
        ("vllm@model@1@0@-0", "chunk_hash"),
        ("vllm@model@1@0@\u0661", "chunk_hash"),
        ("vllm@model@1@0@5@user", "tag 'user' has no '%'"),
        ("vllm@model@1@0@5@user%alice@", "tag '' has no '%'"),
        ("vllm@model@1@0@5@%alice", "tags key"),
        ("vllm@model@1@0@5@user%", "tags value"),
        ("@model@1@0@5", "fmt"),
        ("vllm@@1@0@5", "model_name"),
        ("vllm@model@0@0@5", "world_size must be >= 1"),
        ("vllm@model@2@2@5", "worker_id must be in"),
        ("vllm@model@2@-1@5", "worker_id must be in"),
        ("vllm@mo\ndel@1@0@5", "control characters"),
    ],
)
def test_parse_rejects_malformed_keys(text: str, message: str) -> None:
    with pytest.raises(InvalidKey) as info:
        CacheKey.parse(text)
    assert message in str(info.value)
    assert isinstance(info.value, ConfigError)


def test_parse_of_non_string_is_invalid_key() -> None:
    with pytest.raises(InvalidKey, match="bytes"):
        CacheKey.parse(b"vllm@m@1@0@5")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"model_name": "org@model"}, "model_name"),
        ({"model_name": ""}, "non-empty"),
        ({"fmt": "vl@lm"}, "fmt"),
        ({"fmt": "v%llm"}, "fmt"),
        ({"fmt": ""}, "non-empty"),
        ({"model_name": "a\x00b"}, "control characters"),
        ({"world_size": 2, "worker_id": 2}, "worker_id must be in [0, world_size=2)"),
        ({"world_size": 0}, "world_size must be >= 1"),
        ({"worker_id": -1}, "worker_id"),
        ({"world_size": "1"}, "world_size must be an int"),
        ({"chunk_hash": 1.0}, "chunk_hash must be an int"),
        ({"chunk_hash": True}, "chunk_hash must be an int"),
        ({"tags": (("us%er", "alice"),)}, "tags key"),
        ({"tags": (("user", "al@ice"),)}, "tags value"),
        ({"tags": (("user", ""),)}, "tags value"),
    ],
)
def test_construction_rejects_invalid_fields(kwargs: dict, message: str) -> None:
    fields = {
        "fmt": "vllm",
        "model_name": MODEL,
        "world_size": 1,
        "worker_id": 0,
        "chunk_hash": 0,
    } | kwargs
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
    template = CacheKey("vllm", MODEL, 2, 1, 0, (("user", "alice"),))
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
