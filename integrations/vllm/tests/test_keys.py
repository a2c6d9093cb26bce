"""vLLM OffloadKeys as kvplug keys: lossless both ways, one key space per layout, weights and
epoch, each tenant's keys apart, a request's tenant read from its ``kv_transfer_params``, and
the weights' identity derived from what vLLM loaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from vllm.v1.kv_offload.base import get_offload_block_hash, get_offload_group_idx, make_offload_key

from kvplug.errors import ConfigError
from kvplug.keys import MAX_TENANT_LENGTH, CacheKey, InvalidKey
from kvplug_vllm.keys import (
    TENANT_PARAM,
    ChunkNamespace,
    key_dtype,
    model_identity,
    offload_key_of,
    request_tenant,
)

NAMESPACE = ChunkNamespace("org/model", 1, "bfloat16", {"row_bytes": 4096}, identity="w1")

block_hashes = st.binary(min_size=1, max_size=64)
groups = st.integers(min_value=0, max_value=2**32 - 1)


@given(block_hashes, groups)
def test_an_offload_key_survives_the_kvplug_key_and_its_string_form(
    block_hash: bytes, group: int
) -> None:
    offload_key = make_offload_key(block_hash, group)
    key = NAMESPACE.key_of(offload_key)
    assert offload_key_of(key) == offload_key
    parsed = CacheKey.parse(str(key))
    assert parsed == key and offload_key_of(parsed) == offload_key
    assert get_offload_block_hash(offload_key_of(parsed)) == block_hash
    assert get_offload_group_idx(offload_key_of(parsed)) == group
    assert NAMESPACE.owns(parsed)


@given(block_hashes, groups, block_hashes, groups)
def test_different_offload_keys_never_share_a_kvplug_key(
    hash_a: bytes, group_a: int, hash_b: bytes, group_b: int
) -> None:
    a, b = make_offload_key(hash_a, group_a), make_offload_key(hash_b, group_b)
    assert (NAMESPACE.key_of(a) == NAMESPACE.key_of(b)) == (a == b)


@pytest.mark.parametrize(
    "other",
    [
        ChunkNamespace("org/model", 1, "bfloat16", {"row_bytes": 8192}, identity="w1"),
        ChunkNamespace("org/model", 1, "bfloat16", {"row_bytes": 4096}, identity="w2"),
        ChunkNamespace("org/model", 1, "bfloat16", {"row_bytes": 4096}, identity=None),
        ChunkNamespace("org/model", 1, "bfloat16", {"row_bytes": 4096}, identity="w1", epoch="e"),
        ChunkNamespace("org/model", 2, "bfloat16", {"row_bytes": 4096}, identity="w1"),
        ChunkNamespace("org/other", 1, "bfloat16", {"row_bytes": 4096}, identity="w1"),
        ChunkNamespace("org/model", 1, "half", {"row_bytes": 4096}, identity="w1"),
    ],
)
def test_each_layout_weights_and_epoch_is_its_own_key_space(other: ChunkNamespace) -> None:
    offload_key = make_offload_key(b"\x01" * 32, 0)
    assert other.key_of(offload_key) != NAMESPACE.key_of(offload_key)
    assert not other.owns(NAMESPACE.key_of(offload_key))


def test_what_is_not_an_offload_key_is_refused() -> None:
    for bad in [b"", b"\x00\x00\x00\x00", "abcd"]:
        with pytest.raises(InvalidKey):
            NAMESPACE.key_of(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidKey):
        offload_key_of(CacheKey("org/model", 1, 0, 0x1F))


tenants = st.text(min_size=1, max_size=MAX_TENANT_LENGTH).filter(lambda text: "\x00" not in text)


@given(block_hashes, groups, tenants)
def test_a_tenants_key_names_the_tenant_and_survives_its_string_form(
    block_hash: bytes, group: int, tenant: str
) -> None:
    offload_key = make_offload_key(block_hash, group)
    key = NAMESPACE.key_of(offload_key, tenant)
    parsed = CacheKey.parse(str(key))
    assert parsed == key and parsed.tenant == tenant
    assert offload_key_of(parsed) == offload_key
    assert NAMESPACE.owns(parsed)
    assert key == NAMESPACE.key_of(offload_key).with_tenant(tenant)


@given(block_hashes, tenants, tenants)
def test_the_same_chunk_of_two_tenants_is_two_keys(block_hash: bytes, a: str, b: str) -> None:
    offload_key = make_offload_key(block_hash, 0)
    assert (NAMESPACE.key_of(offload_key, a) == NAMESPACE.key_of(offload_key, b)) == (a == b)
    assert NAMESPACE.key_of(offload_key, a) != NAMESPACE.key_of(offload_key)


@pytest.mark.parametrize(
    ("params", "deployment", "tenant"),
    [
        ({TENANT_PARAM: "team-a"}, "", "team-a"),
        ({TENANT_PARAM: "team-a"}, "team-a", "team-a"),
        ({TENANT_PARAM: None, "do_remote_prefill": True}, "team-a", "team-a"),
        ({"cache_salt": "team-a"}, "", ""),  # only kvplug_tenant names the tenant
        ({}, "", ""),
        (None, "team-b", "team-b"),
        (["not", "a", "mapping"], "", ""),  # another connector's business
    ],
)
def test_a_requests_tenant_is_what_it_names_else_the_deployments(
    params: Any, deployment: str, tenant: str
) -> None:
    assert request_tenant(params, deployment) == tenant


@pytest.mark.parametrize(
    ("named", "words"),
    [
        (7, "got 7"),
        (["team-a"], "got ['team-a']"),
        (["team-a"] * 10_000, "got ['team-a', 'team-a', "),  # cut short for the logs
        ("", "non-empty string"),
        ("x" * (MAX_TENANT_LENGTH + 1), f"has {MAX_TENANT_LENGTH + 1} characters"),
        ("a\x00b", "NUL"),
    ],
)
def test_a_request_naming_no_tenant_name_is_refused_saying_why_and_the_fix(
    named: object, words: str
) -> None:
    with pytest.raises(InvalidKey) as raised:
        request_tenant({TENANT_PARAM: named})
    message = str(raised.value)
    assert message.startswith("kv_transfer_params['kvplug_tenant'] is refused: ")
    assert words in message and "Set it to the tenant's name" in message
    assert len(message) < 400, message
    assert isinstance(raised.value, ConfigError)


def test_a_request_naming_another_tenant_than_the_deployments_is_refused() -> None:
    with pytest.raises(InvalidKey, match="serves tenant 'team-a' only"):
        request_tenant({TENANT_PARAM: "team-b"}, deployment="team-a")


@pytest.mark.parametrize(
    ("vllm_dtype", "name"),
    [
        ("bfloat16", "bfloat16"),
        ("float16", "half"),
        ("float32", "float"),
        ("fp8", "uint8"),
        ("fp8_e4m3", "uint8"),
        ("fp8_ds_mla", "uint8"),
    ],
)
def test_vllms_kv_dtypes_get_lmcache_key_names(vllm_dtype: str, name: str) -> None:
    assert key_dtype(vllm_dtype) == name


def test_a_local_model_directory_is_identified_by_its_weight_files(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    weights = tmp_path / "model-00001-of-00001.safetensors"
    weights.write_bytes(b"v1")
    (tmp_path / "README.md").write_text("notes")
    first = model_identity(str(tmp_path))
    assert first is not None and first.startswith("files:")
    (tmp_path / "README.md").write_text("other notes")
    assert model_identity(str(tmp_path)) == first
    weights.write_bytes(b"v2 of the weights")
    assert model_identity(str(tmp_path)) != first


def test_a_hub_model_is_identified_by_the_snapshot_in_the_hub_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.chdir(tmp_path)  # so "org/model" is no local directory
    assert model_identity("org/model") is None
    refs = tmp_path / "models--org--model" / "refs"
    refs.mkdir(parents=True)
    (refs / "main").write_text("0123abcd" * 5 + "\n")
    assert model_identity("org/model") == "hub:" + "0123abcd" * 5
    assert not Path("org/model").is_dir()
