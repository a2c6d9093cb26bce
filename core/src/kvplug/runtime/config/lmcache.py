"""LMCache's configuration keys: the tiers LMCache would build from them, and the keys that are
not about storage, which kvplug accepts and ignores."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from kvplug.errors import ConfigError
from kvplug.runtime.config.tier import TierConfig
from kvplug.secrets import mask_url
from kvplug.url import BackendURL, split_chain

if TYPE_CHECKING:
    from kvplug.runtime.config.model import Config

#: LMCache keys that are not about storage: accepted, ignored, and named in one warning.
IGNORED_LMCACHE_KEYS: frozenset[str] = frozenset(
    {
        "enable_blending",
        "blend_recompute_ratio",
        "blend_min_tokens",
        "blend_special_str",
        "enable_p2p",
        "lookup_url",
        "distributed_url",
        "error_handling",
        "enable_controller",
        "controller_url",
        "lmcache_instance_id",
        "lmcache_worker_port",
        "enable_nixl",
        "nixl_role",
        "nixl_receiver_host",
        "nixl_receiver_port",
        "nixl_buffer_size",
        "nixl_buffer_device",
        "nixl_enable_gc",
        "nixl_peer_host",
        "nixl_peer_port",
        "nixl_peer_init_port",
        "nixl_peer_alloc_port",
        "nixl_proxy_host",
        "nixl_proxy_port",
        "enable_xpyd",
        "use_layerwise",
        "save_decode_cache",
        "pre_caching_hash_algorithm",
        "external_lookup_client",
        "py_enable_gc",
        "cache_engine_internal_api_server_enabled",
        "cache_engine_internal_api_server_port_start",
    }
)
_IGNORED_PREFIXES = ("blend_", "nixl_", "cache_engine_internal_api_server_")


def is_ignored_lmcache_key(key: str) -> bool:
    """Whether ``key`` is an LMCache setting that is not about storage (also a future one of
    the ``blend_*``, ``nixl_*``, ... families)."""
    return key in IGNORED_LMCACHE_KEYS or key.startswith(_IGNORED_PREFIXES)


def _dir_url(scheme: str, directory: str) -> str:
    """``scheme:///abs/dir``; ':' is escaped too, so that a path never contains '::'."""
    return f"{scheme}://" + quote(directory, safe="/,@+=")


def lmcache_tiers(config: Config) -> tuple[TierConfig, ...]:
    """The tiers LMCache would build from its keys, in its order: cpu, disk, weka, gds, remote."""
    eviction = config.cache_policy.lower()
    extra = config.extra_config
    tiers: list[TierConfig] = []
    if config.local_cpu:
        tiers.append(
            TierConfig("cpu://", {"max_size": config.max_local_cpu_size, "eviction": eviction})
        )
    if config.local_disk is not None and config.max_local_disk_size > 0:
        options: dict[str, Any] = {"max_size": config.max_local_disk_size, "eviction": eviction}
        if "use_odirect" in extra:
            options["o_direct"] = extra["use_odirect"]
        tiers.append(TierConfig(_dir_url("file", config.local_disk), options))
    buffer = {} if config.cufile_buffer_size is None else {"buffer_size": config.cufile_buffer_size}
    if config.weka_path is not None:
        tiers.append(TierConfig(_dir_url("weka", config.weka_path), buffer))
    if config.gds_path is not None:
        tiers.append(TierConfig(_dir_url("gds", config.gds_path), buffer))
    if config.remote_url is not None:
        remote: dict[str, Any] = {}
        if config.remote_serde != "naive":
            remote["serde"] = config.remote_serde
        if config.blocking_timeout_secs is not None:
            remote["timeout"] = config.blocking_timeout_secs
        tiers.append(TierConfig(_remote_url(config.remote_url, config), remote))
    if not tiers:
        raise ConfigError(
            "the config has no tier: local_cpu is false and none of local_disk (with "
            "max_local_disk_size > 0), weka_path, gds_path or remote_url is set, so nothing "
            "would be cached. Set local_cpu: true, add another tier, or list them under tiers:."
        )
    return tuple(tiers)


def _remote_url(url: str, config: Config) -> str:
    """``url``, with LMCache's ``audit://host:port`` turned into kvplug's wrapper chain."""
    if len(split_chain(url)) > 1:
        return url  # already a kvplug chain
    audit = BackendURL.parse(url)
    if audit.scheme != "audit":
        return url
    extra = config.extra_config
    actual = extra.get("audit_actual_remote_url") or config.audit_actual_remote_url
    if actual is None:
        raise ConfigError(
            f"remote_url {mask_url(url)!r} is LMCache's audit wrapper, but neither "
            "extra_config.audit_actual_remote_url nor audit_actual_remote_url names the store "
            "it audits. Set extra_config.audit_actual_remote_url (e.g. redis://cache-1:6379), "
            "or write remote_url: audit::redis://cache-1:6379."
        )
    if split_chain(actual)[0].split("://", 1)[0] == "audit":
        raise ConfigError(
            f"audit_actual_remote_url {mask_url(actual)!r} is itself an audit:// URL, so "
            "the audit wrapper would wrap itself. Set it to the store to audit, e.g. "
            "redis://cache-1:6379."
        )
    if "audit_verify_checksum" in extra:
        verify = bool(extra["audit_verify_checksum"])
    else:
        verify = audit.options.get("verify", "").lower() in {"true", "1", "yes"}
    return f"audit://?verify={'true' if verify else 'false'}::{actual}"
