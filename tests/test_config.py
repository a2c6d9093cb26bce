"""kvplug.runtime.config: both config forms, layering, env variables and every kind of bad input."""

from __future__ import annotations

import contextlib
import os
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvplug.env import env_owner, installed_plugin_names, plugin_env, plugin_env_prefix
from kvplug.errors import ConfigError, InvalidBackendURL
from kvplug.runtime.config import (
    CONFIG_KEYS,
    DEFAULT_CPU_SIZE,
    LMCACHE_TIER_KEYS,
    OTHER_ENV_VARS,
    Config,
    ConfigWarning,
    TierConfig,
    core_env_names,
    default_tiers,
    load_config,
)
from kvplug.runtime.config.model import _COERCERS
from kvplug.units import parse_size

GiB = 1 << 30
MiB = 1 << 20

LMCACHE_YAML = """\
# An LMCache config file as an LMCache user has it.
chunk_size: 256
local_cpu: True
max_local_cpu_size: 5.0
local_disk: "file:///var/cache/lmcache/"
max_local_disk_size: 20
remote_url: "lm://localhost:65432"
remote_serde: "cachegen"
cache_policy: LFU
blocking_timeout_secs: 10
save_unfull_chunk: false
extra_config:
  use_odirect: true
  ping_interval: 30
# Not about storage: accepted and ignored.
enable_blending: false
blend_recompute_ratio: 0.15
use_layerwise: false
pre_caching_hash_algorithm: builtin
lmcache_instance_id: "lmcache_default_instance"
"""


@pytest.fixture(autouse=True)
def _warnings_are_errors_unless_expected() -> Iterator[None]:
    """A test that does not expect a ConfigWarning fails on one (pytest.warns still works)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        yield


def _tier_pairs(config: Config) -> list[tuple[str, dict[str, Any]]]:
    return [(tier.url, dict(tier.options)) for tier in config.tiers]


def _error(call: Any, *args: Any, **kwargs: Any) -> str:
    with pytest.raises(ConfigError) as info:
        call(*args, **kwargs)
    return str(info.value)


# --- defaults ----------------------------------------------------------------------------------


def test_no_file_no_env_gives_one_cpu_tier_of_5_gib_with_lru() -> None:
    config = load_config(env={})
    assert _tier_pairs(config) == [("cpu://", {"max_size": 5 * GiB, "eviction": "lru"})]
    assert config.chunk_size == 256
    assert config.save_unfull_chunk is True
    assert config.explicit_tiers is None
    assert config.tiers == default_tiers() == Config.default_tiers() == Config().tiers
    assert 5 * GiB == DEFAULT_CPU_SIZE


def test_every_config_key_has_a_converter() -> None:
    assert set(_COERCERS) == set(CONFIG_KEYS)
    store_keys = {"chunk_size", "tiers", "buffer_size", "write_behind_size"}
    assert set(CONFIG_KEYS) - store_keys - {"save_unfull_chunk", "extra_config"} == set(
        LMCACHE_TIER_KEYS
    )


# --- LMCache keys ------------------------------------------------------------------------------


def test_lmcache_yaml_file_becomes_tiers_in_lmcache_order(tmp_path: Path) -> None:
    path = tmp_path / "lmcache.yaml"
    path.write_text(LMCACHE_YAML)
    with pytest.warns(ConfigWarning, match="not used by kvplug") as record:
        config = load_config(path, env={})
    assert len(record) == 1
    message = str(record[0].message)
    for key in ("enable_blending", "blend_recompute_ratio", "use_layerwise", "lmcache_instance_id"):
        assert key in message
    assert _tier_pairs(config) == [
        ("cpu://", {"max_size": 5 * GiB, "eviction": "lfu"}),
        (
            "file:///var/cache/lmcache",
            {"max_size": 20 * GiB, "eviction": "lfu", "o_direct": True},
        ),
        ("lm://localhost:65432", {"serde": "cachegen", "timeout": 10}),
    ]
    assert config.save_unfull_chunk is False
    assert config.cache_policy == "LFU"
    assert config.extra_config["ping_interval"] == 30


def test_lmcache_keys_and_the_equivalent_tiers_list_give_equal_tiers(tmp_path: Path) -> None:
    lmcache = Config.from_dict(
        {
            "chunk_size": 128,
            "local_cpu": True,
            "max_local_cpu_size": 2,
            "local_disk": str(tmp_path / "disk"),
            "max_local_disk_size": 10,
            "weka_path": "/mnt/weka",
            "gds_path": "/mnt/gds",
            "cufile_buffer_size": 8192,
            "remote_url": "redis://cache-1:6379",
            "remote_serde": "kivi",
            "blocking_timeout_secs": 3,
            "cache_policy": "fifo",
        }
    )
    explicit = Config.from_yaml(
        f"""
        chunk_size: 128
        tiers:
          - {{url: "cpu://", max_size: {2 * GiB}, eviction: fifo}}
          - {{url: "file://{tmp_path / "disk"}", max_size: {10 * GiB}, eviction: fifo}}
          - {{url: "weka:///mnt/weka", buffer_size: {8192 * MiB}}}
          - {{url: "gds:///mnt/gds", buffer_size: {8192 * MiB}}}
          - {{url: "redis://cache-1:6379", serde: kivi, timeout: 3}}
        """
    )
    assert lmcache.tiers == explicit.tiers
    assert len(lmcache.tiers) == 5
    assert lmcache.chunk_size == explicit.chunk_size == 128


def test_local_cpu_false_leaves_the_cpu_tier_out() -> None:
    config = Config.from_dict({"local_cpu": False, "remote_url": "blackhole://"})
    assert _tier_pairs(config) == [("blackhole://", {})]


def test_no_tier_at_all_is_an_error_that_says_how_to_add_one() -> None:
    message = _error(Config.from_dict, {"local_cpu": False})
    assert "no tier" in message
    assert "local_cpu: true" in message


def test_naive_serde_and_unset_timeout_add_no_remote_options() -> None:
    config = Config.from_dict({"remote_url": "redis://h:6379", "remote_serde": "naive"})
    assert config.tiers[-1] == TierConfig("redis://h:6379", {})


def test_use_odirect_absent_adds_no_o_direct_option(tmp_path: Path) -> None:
    config = Config.from_dict({"local_disk": str(tmp_path), "max_local_disk_size": 1})
    assert "o_direct" not in config.tiers[1].options


def test_gds_without_cufile_buffer_size_has_no_buffer_option() -> None:
    config = Config.from_dict({"local_cpu": False, "gds_path": "/mnt/gds"})
    assert _tier_pairs(config) == [("gds:///mnt/gds", {})]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("file:///mnt/x/", "/mnt/x"),
        ("/mnt/x", "/mnt/x"),
        ("/mnt/x/../y/", "/mnt/y"),
    ],
)
def test_local_disk_file_prefix_is_stripped_and_path_normalised(value: str, expected: str) -> None:
    config = Config.from_dict({"local_disk": value, "max_local_disk_size": 1})
    assert config.local_disk == expected
    assert config.tiers[1].url == f"file://{expected}"
    assert config.tiers[1].parsed.path == expected


def test_relative_local_disk_is_made_absolute_against_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    config = Config.from_dict({"local_disk": "file://local/disk/", "max_local_disk_size": 1})
    assert config.local_disk == str(tmp_path / "local" / "disk")
    assert config.tiers[1].parsed.path == str(tmp_path / "local" / "disk")


def test_local_disk_path_with_a_space_round_trips_through_the_url(tmp_path: Path) -> None:
    directory = tmp_path / "my cache"
    config = Config.from_dict({"local_disk": str(directory), "max_local_disk_size": 1})
    assert " " not in config.tiers[1].url
    assert config.tiers[1].parsed.path == str(directory)


def test_local_disk_without_disk_size_warns_that_there_is_no_disk_tier() -> None:
    with pytest.warns(ConfigWarning, match="max_local_disk_size is 0"):
        config = Config.from_dict({"local_disk": "/mnt/x"})
    assert [tier.url for tier in config.tiers] == ["cpu://"]


def test_disk_size_without_local_disk_warns_that_there_is_no_disk_tier() -> None:
    with pytest.warns(ConfigWarning, match="local_disk is not"):
        config = Config.from_dict({"max_local_disk_size": 4})
    assert [tier.url for tier in config.tiers] == ["cpu://"]


# --- audit ------------------------------------------------------------------------------------


def test_lmcache_audit_url_becomes_a_kvplug_wrapper_chain() -> None:
    config = Config.from_dict(
        {
            "remote_url": "audit://localhost:8080",
            "remote_serde": "cachegen",
            "extra_config": {
                "audit_actual_remote_url": "redis://cache-1:6379",
                "audit_verify_checksum": True,
            },
        }
    )
    remote = config.tiers[-1]
    assert remote.url == "audit://?verify=true::redis://cache-1:6379"
    assert remote.options == {"serde": "cachegen"}
    assert remote.parsed.scheme == "redis"
    assert [w.scheme for w in remote.wrappers] == ["audit"]
    assert remote.wrappers[0].options == {"verify": "true"}


@pytest.mark.parametrize(
    ("url", "verify"), [("audit://h:1?verify=yes", "true"), ("audit://h:1", "false")]
)
def test_audit_verify_comes_from_the_url_query_when_extra_config_lacks_it(
    url: str, verify: str
) -> None:
    config = Config.from_dict(
        {"remote_url": url, "extra_config": {"audit_actual_remote_url": "lm://h:2"}}
    )
    assert config.tiers[-1].url == f"audit://?verify={verify}::lm://h:2"


def test_deprecated_top_level_audit_actual_remote_url_works_with_a_warning() -> None:
    with pytest.warns(ConfigWarning, match="deprecated"):
        config = Config.from_dict(
            {"remote_url": "audit://h:1", "audit_actual_remote_url": "redis://r:6379"}
        )
    assert config.tiers[-1].url == "audit://?verify=false::redis://r:6379"


def test_audit_without_the_actual_url_is_an_error_naming_the_key() -> None:
    message = _error(Config.from_dict, {"remote_url": "audit://h:1"})
    assert "extra_config.audit_actual_remote_url" in message
    assert "audit::redis://" in message


def test_audit_whose_actual_url_is_audit_again_is_an_error() -> None:
    message = _error(
        Config.from_dict,
        {"remote_url": "audit://h:1", "extra_config": {"audit_actual_remote_url": "audit://h:2"}},
    )
    assert "wrap itself" in message


def test_kvplug_chain_in_remote_url_is_kept_as_written() -> None:
    config = Config.from_dict({"remote_url": "audit::redis://h:6379"})
    assert config.tiers[-1].url == "audit::redis://h:6379"


def test_bad_actual_audit_url_fails_at_load_naming_its_key() -> None:
    message = _error(
        Config.from_dict,
        {"remote_url": "audit://h:1", "extra_config": {"audit_actual_remote_url": "redis//h"}},
    )
    assert "extra_config.audit_actual_remote_url" in message


# --- explicit tiers ---------------------------------------------------------------------------


def test_tiers_accept_strings_and_mappings_and_keep_options_as_given() -> None:
    config = Config.from_yaml(
        """
        chunk_size: 512
        tiers:
          - cpu://?max_size=1GiB
          - url: redis+sentinel://h1:26379,h2:26379/mymaster
            timeout: 2.5
            serde: naive
          - {url: "audit::file:///data/kv", max_size: 100GiB}
        """
    )
    assert _tier_pairs(config) == [
        ("cpu://?max_size=1GiB", {}),
        ("redis+sentinel://h1:26379,h2:26379/mymaster", {"timeout": 2.5, "serde": "naive"}),
        ("audit::file:///data/kv", {"max_size": "100GiB"}),
    ]
    assert config.chunk_size == 512
    assert config.tiers[1].parsed.hosts == (("h1", 26379), ("h2", 26379))
    assert config.tiers[2].parsed.path == "/data/kv"
    assert config.explicit_tiers == config.tiers


def test_tier_options_are_read_only() -> None:
    tier = Config.from_dict({"tiers": [{"url": "cpu://", "max_size": 1}]}).tiers[0]
    with pytest.raises(TypeError):
        tier.options["max_size"] = 2  # type: ignore[index]


def test_tier_repr_masks_passwords_and_secret_options() -> None:
    tier = TierConfig("audit::redis://app:hunt@er2@h:6379", {"password": "hunter3", "db": 1})
    text = repr(tier) + str(tier)
    assert "er2" not in text and "hunter3" not in text
    assert "***" in text and "'db': 1" in text
    assert "er2" not in repr(Config.from_dict({"tiers": [tier]}))


@pytest.mark.parametrize(
    ("tiers", "fragment"),
    [
        ([], "empty list"),
        ("cpu://", "a list of tiers"),
        ([{"max_size": 3}], "tiers[0]"),
        (["cpu://", 42], "tiers[1]"),
        ([{"url": "cpu://", 3: "x"}], "string keys"),
    ],
)
def test_malformed_tiers_are_errors_naming_the_item(tiers: Any, fragment: str) -> None:
    assert fragment in _error(Config.from_dict, {"tiers": tiers})


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("redis//cache-1:6379", "no '://'"),
        ("redis://cache-1:99999", "port"),
        ("audit::", "empty part"),
        ("Redis://h", "scheme"),
        ("redis://h:1 2", "whitespace"),
    ],
)
def test_bad_tier_urls_fail_at_load_naming_the_tier(url: str, fragment: str) -> None:
    with pytest.raises(InvalidBackendURL) as info:
        Config.from_dict({"tiers": ["cpu://", url]})
    assert "tiers[1]" in str(info.value)
    assert fragment in str(info.value)


def test_bad_remote_url_fails_at_load_naming_remote_url_and_masking_the_password() -> None:
    with pytest.raises(InvalidBackendURL) as info:
        Config.from_dict({"remote_url": "redis://app:hunter2@cache-1:notaport"})
    assert "'remote_url'" in str(info.value)
    assert "hunter2" not in str(info.value)


@pytest.mark.parametrize(
    "lmcache_key",
    [
        ("local_cpu", False),
        ("local_cpu", True),
        ("local_disk", "/mnt/x"),
        ("max_local_cpu_size", 2),
        ("max_local_disk_size", 2),
        ("remote_url", "redis://h:6379"),
        ("gds_path", "/mnt/gds"),
        ("weka_path", "/mnt/weka"),
        ("cache_policy", "LFU"),
    ],
)
def test_mixing_tiers_with_lmcache_tier_keys_is_an_error(lmcache_key: tuple[str, Any]) -> None:
    key, value = lmcache_key
    message = _error(Config.from_dict, {"tiers": ["cpu://"], key: value})
    assert key in message
    assert "Use one form" in message


def test_mixing_across_layers_names_each_source(tmp_path: Path) -> None:
    path = tmp_path / "kvplug.yaml"
    path.write_text("tiers: [cpu://]\n")
    message = _error(load_config, path, env={"KVPLUG_REMOTE_URL": "redis://h:6379"})
    assert str(path) in message
    assert "KVPLUG_REMOTE_URL" in message


def test_tiers_beside_lmcache_keys_set_to_null_is_not_mixing() -> None:
    config = Config.from_yaml("tiers: [blackhole://]\nremote_url: null\nlocal_disk:\n")
    assert [tier.url for tier in config.tiers] == ["blackhole://"]


def test_tiers_beside_non_tier_keys_is_fine() -> None:
    config = Config.from_dict(
        {"tiers": ["cpu://"], "chunk_size": 64, "save_unfull_chunk": False, "extra_config": {}}
    )
    assert config.chunk_size == 64 and config.save_unfull_chunk is False


def test_to_dict_round_trips_through_from_dict() -> None:
    with pytest.warns(ConfigWarning):
        config = Config.from_yaml(LMCACHE_YAML)
    again = Config.from_dict(config.to_dict())
    assert again.tiers == config.tiers
    assert again.chunk_size == config.chunk_size
    assert again.save_unfull_chunk == config.save_unfull_chunk
    assert again.extra_config == config.extra_config


# --- values -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (5, 5 * GiB),
        (0.5, GiB // 2),
        ("2", 2 * GiB),
        ("1.5", 3 * GiB // 2),
        ("512MiB", 512 * MiB),
        ("512 MiB", 512 * MiB),
        ("1GB", 10**9),
        (0, 0),
    ],
)
def test_cpu_size_is_gib_when_a_number_and_a_size_when_it_has_a_unit(
    value: Any, expected: int
) -> None:
    config = Config.from_dict({"max_local_cpu_size": value})
    assert config.max_local_cpu_size == expected
    assert config.tiers[0].options["max_size"] == expected


@pytest.mark.parametrize(
    "value", [-1, "-2", "lots", "5 parsecs", True, float("inf"), float("nan"), [5]]
)
def test_bad_sizes_are_errors_naming_key_and_value(value: Any) -> None:
    message = _error(Config.from_dict, {"max_local_disk_size": value})
    assert "max_local_disk_size" in message
    assert "GiB" in message


@pytest.mark.parametrize("value", [10**400, 1e300, "1e300", float("inf"), "99999999TiB"])
def test_sizes_beyond_any_address_space_are_errors_saying_so(value: Any) -> None:
    message = _error(Config.from_dict, {"max_local_cpu_size": value})
    assert "max_local_cpu_size" in message and "larger than any machine" in message


@pytest.mark.parametrize("value", [-(10**400), float("nan"), "-1"])
def test_negative_or_nan_sizes_are_errors(value: Any) -> None:
    assert "max_local_cpu_size" in _error(Config.from_dict, {"max_local_cpu_size": value})


@pytest.mark.parametrize("value", ["5,5GiB", "5.GiB", "1.5.5GiB", "512,5MiB", ".5GiB", "5 GiB 2"])
def test_malformed_size_strings_are_refused_not_read_as_their_first_digits(value: str) -> None:
    message = _error(Config.from_dict, {"max_local_disk_size": value, "local_disk": "/tmp/d"})
    assert "max_local_disk_size" in message and repr(value) in message


def test_huge_timeout_number_is_an_error_not_a_crash() -> None:
    assert "seconds" in _error(Config.from_dict, {"blocking_timeout_secs": -(10**400)})


def test_configs_and_tiers_are_hashable() -> None:
    config = Config.from_dict({"tiers": [{"url": "cpu://", "max_size": 1}]})
    same = Config.from_dict({"tiers": [{"url": "cpu://", "max_size": 1}]})
    assert config == same and hash(config) == hash(same)
    assert len({config.tiers[0], same.tiers[0]}) == 1


def test_cufile_buffer_size_is_mib() -> None:
    config = Config.from_dict({"local_cpu": False, "weka_path": "/w", "cufile_buffer_size": 16})
    assert config.cufile_buffer_size == 16 * MiB
    assert config.tiers[0].options == {"buffer_size": 16 * MiB}
    assert "MiB" in _error(Config.from_dict, {"cufile_buffer_size": "big"})


@pytest.mark.parametrize("value", ["abc", 0, -256, 1.5, True, None, "12.0", [256]])
def test_bad_chunk_size_is_an_error(value: Any) -> None:
    message = _error(Config.from_dict, {"chunk_size": value})
    assert "'chunk_size'" in message
    assert "positive whole number" in message


@pytest.mark.parametrize(("value", "expected"), [("lru", "LRU"), ("Lfu", "LFU"), ("FIFO", "FIFO")])
def test_cache_policy_is_case_insensitive(value: str, expected: str) -> None:
    config = Config.from_dict({"cache_policy": value})
    assert config.cache_policy == expected
    assert config.tiers[0].options["eviction"] == expected.lower()


def test_bad_cache_policy_suggests_the_closest_one() -> None:
    message = _error(Config.from_dict, {"cache_policy": "FIFI"})
    assert "Did you mean 'FIFO'?" in message
    assert "LRU, LFU, FIFO" in message


@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [
        ("local_cpu", "maybe", "boolean"),
        ("save_unfull_chunk", 2, "boolean"),
        ("remote_serde", "", "serde name"),
        ("remote_url", 6379, "URL string"),
        ("local_disk", 3, "directory path"),
        ("blocking_timeout_secs", 0, "seconds > 0"),
        ("blocking_timeout_secs", "soon", "seconds > 0"),
        ("extra_config", ["use_odirect"], "mapping"),
        ("extra_config", {"use_odirect": "sometimes"}, "extra_config.use_odirect"),
        ("extra_config", {1: True}, "string keys"),
    ],
)
def test_wrong_types_are_errors_naming_the_key(key: str, value: Any, fragment: str) -> None:
    message = _error(Config.from_dict, {key: value})
    assert key in message
    assert fragment in message


def test_extra_config_keeps_unknown_keys_and_normalises_known_ones() -> None:
    config = Config.from_dict({"extra_config": {"use_odirect": "yes", "tag_keys": ["a"]}})
    assert dict(config.extra_config) == {"use_odirect": True, "tag_keys": ["a"]}


def test_direct_construction_checks_normalised_values() -> None:
    assert "chunk_size" in _error(Config, chunk_size=0)
    assert "bytes" in _error(Config, max_local_cpu_size=-1)
    assert "cache_policy" in _error(Config, cache_policy="lru")


# --- unknown and ignored keys -----------------------------------------------------------------


def test_misspelled_key_gets_a_did_you_mean_and_the_valid_keys() -> None:
    message = _error(Config.from_dict, {"max_local_cpu_sise": 2})
    assert "'max_local_cpu_sise'" in message
    assert "did you mean 'max_local_cpu_size'?" in message
    assert "Valid keys: chunk_size, tiers" in message


def test_several_unknown_keys_are_reported_together() -> None:
    message = _error(Config.from_dict, {"remote_ur": "x", "zzz_qqq": 1})
    assert "did you mean 'remote_url'?" in message
    assert "'zzz_qqq'" in message


def test_unknown_key_in_a_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("chunck_size: 256\n")
    message = _error(load_config, path, env={})
    assert str(path) in message
    assert "did you mean 'chunk_size'?" in message


def test_misspelled_key_in_overrides_is_an_error() -> None:
    assert "did you mean 'chunk_size'?" in _error(load_config, env={}, chunk_sizes=512)


def test_non_string_key_is_an_error() -> None:
    assert "not a string" in _error(Config.from_yaml, "1: 2\n")


def test_ignored_lmcache_keys_produce_exactly_one_warning_naming_them() -> None:
    with pytest.warns(ConfigWarning) as record:
        config = Config.from_dict(
            {"enable_nixl": False, "nixl_role": "sender", "nixl_new_thing": 1, "py_enable_gc": True}
        )
    assert len(record) == 1
    assert "enable_nixl, nixl_new_thing, nixl_role, py_enable_gc" in str(record[0].message)
    assert config.tiers == default_tiers()


# --- YAML and files ---------------------------------------------------------------------------


def test_bad_yaml_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("chunk_size: 256\nlocal_cpu: [true\nremote_url: x\n")
    message = _error(load_config, path, env={})
    assert str(path) in message
    assert re.search(r"line [34]", message)
    assert "invalid YAML" in message


@pytest.mark.parametrize("text", ["- cpu://\n", "just a string\n", "42\n"])
def test_top_level_yaml_that_is_not_a_mapping_is_an_error(tmp_path: Path, text: str) -> None:
    path = tmp_path / "list.yaml"
    path.write_text(text)
    message = _error(load_config, path, env={})
    assert "mapping" in message
    assert str(path) in message


def test_empty_yaml_file_means_defaults(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing yet\n")
    assert load_config(path, env={}).tiers == default_tiers()


def test_duplicate_yaml_key_is_an_error_with_its_line() -> None:
    message = _error(Config.from_yaml, "chunk_size: 256\nlocal_cpu: true\nchunk_size: 512\n")
    assert "twice" in message and "line 3" in message


def test_missing_file_is_an_error_naming_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    message = _error(load_config, path, env={})
    assert str(path) in message and "does not exist" in message


def test_missing_file_from_kvplug_config_file_names_the_variable(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    message = _error(load_config, env={"KVPLUG_CONFIG_FILE": str(path)})
    assert str(path) in message and "KVPLUG_CONFIG_FILE" in message


def test_directory_as_config_file_is_an_error(tmp_path: Path) -> None:
    assert "directory" in _error(load_config, tmp_path, env={})


def test_non_utf8_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "binary.yaml"
    path.write_bytes(b"chunk_size: \xff\xfe\n")
    assert "UTF-8" in _error(load_config, path, env={})


def test_from_yaml_reads_paths_and_text(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("chunk_size: 64\n")
    assert Config.from_yaml(path).chunk_size == 64
    assert Config.from_yaml(str(path)).chunk_size == 64
    assert Config.from_yaml("chunk_size: 32").chunk_size == 32
    assert "does not exist" in _error(Config.from_yaml, "missing.yaml")


# --- environment ------------------------------------------------------------------------------


def test_precedence_is_overrides_then_env_then_file_then_defaults(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("chunk_size: 64\nmax_local_cpu_size: 1\nsave_unfull_chunk: false\n")
    env = {"KVPLUG_CHUNK_SIZE": "128", "KVPLUG_MAX_LOCAL_CPU_SIZE": "2"}
    config = load_config(path, env=env, chunk_size=512)
    assert config.chunk_size == 512  # override beats env and file
    assert config.max_local_cpu_size == 2 * GiB  # env beats file
    assert config.save_unfull_chunk is False  # file beats default
    assert config.cache_policy == "LRU"  # default


def test_kvplug_config_file_names_the_file_and_an_explicit_path_wins(tmp_path: Path) -> None:
    named = tmp_path / "named.yaml"
    named.write_text("chunk_size: 16\n")
    explicit = tmp_path / "explicit.yaml"
    explicit.write_text("chunk_size: 32\n")
    assert load_config(env={"KVPLUG_CONFIG_FILE": str(named)}).chunk_size == 16
    assert load_config(explicit, env={"KVPLUG_CONFIG_FILE": str(named)}).chunk_size == 32


def test_env_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("KVPLUG_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("KVPLUG_CHUNK_SIZE", "1024")
    assert load_config().chunk_size == 1024


@pytest.mark.parametrize(
    ("word", "expected"),
    [
        ("true", True), ("TRUE", True), ("1", True), ("yes", True), ("On", True),
        ("false", False), ("False", False), ("0", False), ("no", False), ("OFF", False),
    ],
)  # fmt: skip
def test_env_booleans_accept_the_usual_words(word: str, expected: bool) -> None:
    config = load_config(env={"KVPLUG_LOCAL_CPU": word, "KVPLUG_REMOTE_URL": "blackhole://"})
    assert config.local_cpu is expected
    assert (config.tiers[0].url == "cpu://") is expected


def test_env_boolean_that_is_no_boolean_names_the_variable() -> None:
    message = _error(load_config, env={"KVPLUG_SAVE_UNFULL_CHUNK": "nah"})
    assert "KVPLUG_SAVE_UNFULL_CHUNK" in message
    assert "'nah'" in message


def test_env_chunk_size_that_is_not_a_number_names_the_variable() -> None:
    message = _error(load_config, env={"KVPLUG_CHUNK_SIZE": "abc"})
    assert "KVPLUG_CHUNK_SIZE" in message


def test_env_tiers_split_on_semicolons_and_newlines_not_commas() -> None:
    env = {"KVPLUG_TIERS": "cpu://?max_size=1GiB; redis+sentinel://h1:1,h2:2/m\nlm://h:3;"}
    config = load_config(env=env)
    assert [tier.url for tier in config.tiers] == [
        "cpu://?max_size=1GiB",
        "redis+sentinel://h1:1,h2:2/m",
        "lm://h:3",
    ]
    assert config.tiers[1].parsed.hosts == (("h1", 1), ("h2", 2))


def test_env_tiers_with_a_bad_url_names_the_variable() -> None:
    with pytest.raises(InvalidBackendURL, match="KVPLUG_TIERS"):
        load_config(env={"KVPLUG_TIERS": "cpu://;redis:/h"})


def test_env_tiers_override_file_tiers(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("tiers: [cpu://]\n")
    config = load_config(path, env={"KVPLUG_TIERS": "blackhole://"})
    assert [tier.url for tier in config.tiers] == ["blackhole://"]


def test_env_extra_config_is_json_merged_over_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("extra_config: {use_odirect: false, ping_interval: 30}\n")
    config = load_config(path, env={"KVPLUG_EXTRA_CONFIG": '{"use_odirect": true, "x": 1}'})
    assert dict(config.extra_config) == {"use_odirect": True, "ping_interval": 30, "x": 1}


@pytest.mark.parametrize(("raw", "fragment"), [("{bad json", "not valid JSON"), ("[1]", "object")])
def test_env_extra_config_that_is_no_json_object_is_an_error(raw: str, fragment: str) -> None:
    message = _error(load_config, env={"KVPLUG_EXTRA_CONFIG": raw})
    assert "KVPLUG_EXTRA_CONFIG" in message and fragment in message


def test_empty_env_value_clears_an_optional_key_from_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("remote_url: redis://h:6379\n")
    assert load_config(path, env={}).remote_url == "redis://h:6379"
    assert load_config(path, env={"KVPLUG_REMOTE_URL": ""}).remote_url is None


def test_env_sizes_are_gib_numbers_or_sizes() -> None:
    env = {"KVPLUG_MAX_LOCAL_CPU_SIZE": "512MiB", "KVPLUG_CUFILE_BUFFER_SIZE": "64"}
    config = load_config(env=env)
    assert config.max_local_cpu_size == 512 * MiB
    assert config.cufile_buffer_size == 64 * MiB


def test_misspelled_env_variable_gets_a_did_you_mean() -> None:
    message = _error(load_config, env={"KVPLUG_REMOTE_URI": "redis://h:1"})
    assert "KVPLUG_REMOTE_URI" in message
    assert "Did you mean KVPLUG_REMOTE_URL?" in message


def test_other_kvplug_and_foreign_variables_are_left_alone() -> None:
    env = {
        "KVPLUG_DISABLE_PLUGINS": "x",
        "KVPLUG_DISABLE_PLUGIN_AUTOLOAD": "1",
        "KVPLUG_HOST_BUFFER_SIZE": "8GiB",
        "KVPLUG_CONTRACT_URL": "cpu://",
        "LMCACHE_CHUNK_SIZE": "1",
        "PATH": "/usr/bin",
    }
    assert load_config(env=env).chunk_size == 256


# --- KVPLUG_<PLUGIN>_* belongs to the plugin ------------------------------------------------


def test_a_plugins_env_variable_is_neither_an_error_nor_read_by_kvplug() -> None:
    assert "redis" in installed_plugin_names()
    env = {"KVPLUG_REDIS_FOO": "bar", "KVPLUG_REDIS_SOCKET_TIMEOUT": "5", "KVPLUG_CHUNK_SIZE": "64"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = load_config(env=env)
    assert config.chunk_size == 64
    assert config == load_config(env={"KVPLUG_CHUNK_SIZE": "64"})
    assert plugin_env("redis", env) == {"foo": "bar", "socket_timeout": "5"}


def test_kvplug_keeps_its_own_names_under_a_plugins_prefix() -> None:
    # audit_actual_remote_url is a config key although audit is a plugin.
    env = {"KVPLUG_AUDIT_ACTUAL_REMOTE_URL": "redis://h:1", "KVPLUG_AUDIT_BATCH": "4"}
    with pytest.warns(ConfigWarning, match="deprecated in LMCache"):
        assert load_config(env=env).audit_actual_remote_url == "redis://h:1"
    assert plugin_env("audit", env) == {"batch": "4"}
    assert load_config(env={"KVPLUG_GDS_PATH": "/mnt/gds"}).gds_path == "/mnt/gds"
    for name in core_env_names():
        assert env_owner(name, installed_plugin_names()) is None, name


def test_core_env_names_are_kvplugs_config_keys_and_other_variables() -> None:
    names = core_env_names()
    assert OTHER_ENV_VARS.issubset(names)
    assert {"KVPLUG_DISABLE_PLUGINS", "KVPLUG_DISABLE_PLUGIN_AUTOLOAD", "KVPLUG_TIERS"} <= names
    assert {f"KVPLUG_{key.upper()}" for key in CONFIG_KEYS} <= names
    assert all(name.startswith("KVPLUG_") for name in names)


def test_an_unclaimed_prefix_is_still_an_error_naming_the_plugin_rule() -> None:
    message = _error(load_config, env={"KVPLUG_NOPLUGIN_FOO": "1"})
    assert "KVPLUG_NOPLUGIN_FOO is not a kvplug setting" in message
    assert "KVPLUG_<PLUGIN>_*" in message and "KVPLUG_REDIS_*" in message


def test_a_misspelled_plugin_prefix_gets_a_did_you_mean() -> None:
    message = _error(load_config, env={"KVPLUG_REDSI_SOCKET_TIMEOUT": "5"})
    assert "Did you mean KVPLUG_REDIS_SOCKET_TIMEOUT?" in message


def test_plugin_env_prefix_and_overlapping_plugin_names() -> None:
    assert plugin_env_prefix("redis") == "KVPLUG_REDIS_"
    assert plugin_env_prefix("acme.cloud-v2") == "KVPLUG_ACME_CLOUD_V2_"
    with pytest.raises(ValueError, match="entry-point name"):
        plugin_env_prefix("--")
    names = ["acme", "acme-cloud"]
    assert env_owner("KVPLUG_ACME_CLOUD_REGION", names) == "acme-cloud"
    assert env_owner("KVPLUG_ACME_REGION", names) == "acme"
    assert env_owner("KVPLUG_ACME_", names) is None
    assert env_owner("KVPLUG_CHUNK_SIZE", ["chunk"]) is None
    env = {"KVPLUG_ZETA_X": "1", "KVPLUG_ZETA_": "2", "KVPLUG_ZETAX_Y": "3", "ZETA_Z": "4"}
    assert plugin_env("zeta", env) == {"x": "1"}


def test_plugin_env_reads_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPLUG_REDIS_FOO", "from-environ")
    assert plugin_env("redis")["foo"] == "from-environ"
    assert load_config().chunk_size == 256


def test_ignored_lmcache_key_from_env_warns_once() -> None:
    with pytest.warns(ConfigWarning, match="KVPLUG_ENABLE_BLENDING"):
        load_config(env={"KVPLUG_ENABLE_BLENDING": "true"})


# --- nothing but ConfigError escapes ----------------------------------------------------------

_json_like = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=20)
    | st.sampled_from([10**400, -(10**400), "1e999", "~nobody/x", "audit", "a::b", "cpu://"]),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(["url", "use_odirect", "x"]) | st.text(max_size=8), inner, max_size=3
        )
    ),
    max_leaves=6,
)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(CONFIG_KEYS), _json_like, max_size=5))
def test_any_values_give_a_config_or_a_config_error(data: dict[str, Any]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        try:
            config = Config.from_dict(data)
        except ConfigError:
            return
    assert all(isinstance(tier, TierConfig) for tier in config.tiers)
    assert config.tiers


@settings(max_examples=300)
@given(st.text(max_size=60))
def test_any_yaml_text_gives_a_config_or_a_config_error(text: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        with contextlib.suppress(ConfigError):
            Config.from_yaml(text)


@settings(max_examples=200)
@given(
    st.dictionaries(
        st.sampled_from(["KVPLUG_" + k.upper() for k in CONFIG_KEYS]),
        st.text(max_size=20),
        max_size=4,
    )
)
def test_any_env_values_give_a_config_or_a_config_error(env: dict[str, str]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        with contextlib.suppress(ConfigError):
            load_config(env=env)


# --- docs -------------------------------------------------------------------------------------

DOCS = Path(__file__).parent.parent / "docs" / "config.md"


def _yaml_blocks() -> list[str]:
    return re.findall(r"```yaml\n(.*?)```", DOCS.read_text(), flags=re.DOTALL)


def test_every_yaml_example_in_docs_config_md_loads() -> None:
    blocks = _yaml_blocks()
    assert len(blocks) >= 3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        for block in blocks:
            assert Config.from_yaml(block).tiers


def test_docs_lmcache_example_and_its_kvplug_equivalent_agree() -> None:
    lmcache_text, kvplug_text = _yaml_blocks()[-2:]
    with pytest.warns(ConfigWarning, match="enable_blending"):
        lmcache = Config.from_yaml(lmcache_text)
    kvplug = Config.from_yaml(kvplug_text)
    assert [t.url for t in lmcache.tiers] == [t.url for t in kvplug.tiers]
    for ours, theirs in zip(lmcache.tiers, kvplug.tiers, strict=True):
        assert ours.options.keys() == theirs.options.keys()
        for name, value in theirs.options.items():
            expected = parse_size(value) if name == "max_size" else value
            assert ours.options[name] == expected
