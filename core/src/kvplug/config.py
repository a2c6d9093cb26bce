"""kvplug configuration: which tiers to use, in which order, with which options.

A configuration comes from up to four layers, each overriding the one before it:

1. defaults (one ``cpu://`` tier of 5 GiB with LRU eviction, chunks of 256 tokens);
2. a YAML file (``load_config(path)``, or the file named by ``KVPLUG_CONFIG_FILE``);
3. ``KVPLUG_<KEY>`` environment variables;
4. keyword arguments given to :func:`load_config`.

Two forms describe the tiers, and a configuration uses exactly one of them:

* kvplug's explicit form, ``tiers:``, an ordered list of backend URLs (the lookup order) with
  per-tier options;
* LMCache's keys as they appear in an LMCache config file (``local_cpu``,
  ``max_local_cpu_size``, ``local_disk``, ``remote_url``, ...), converted to the same tiers in
  LMCache's order: cpu, disk, weka, gds, remote.

The operator's reference is ``docs/config.md``. This module never imports a plugin: tier options
are checked by their backend when the tier is opened; URLs are checked here, at load time.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any
from urllib.parse import quote

import yaml

from kvplug.env import env_owner, installed_plugin_names, plugin_env_prefix
from kvplug.errors import ConfigError, InvalidBackendURL
from kvplug.eviction import POLICIES
from kvplug.secrets import mask_data, mask_repr, mask_url, remember_in
from kvplug.units import GiB, InvalidSize, parse_size
from kvplug.url import BackendURL, split_chain

MiB = 1 << 20
DEFAULT_CHUNK_SIZE = 256
DEFAULT_CPU_SIZE = 5 * GiB
DEFAULT_CACHE_POLICY = "LRU"
CACHE_POLICIES = tuple(name.upper() for name in POLICIES)

ENV_PREFIX = "KVPLUG_"
CONFIG_FILE_ENV = "KVPLUG_CONFIG_FILE"
TIERS_ENV = "KVPLUG_TIERS"
EXTRA_CONFIG_ENV = "KVPLUG_EXTRA_CONFIG"

#: ``KVPLUG_*`` variables that other parts of kvplug read; the config loader leaves them alone.
#: Every other ``KVPLUG_*`` variable must name a config key or belong to an installed plugin
#: (``KVPLUG_<PLUGIN>_*``, see :mod:`kvplug.env`), so that a typo is an error. A new name here
#: is taken from the plugins' namespaces: keep it clear of installed plugins' prefixes.
OTHER_ENV_VARS: frozenset[str] = frozenset(
    {
        CONFIG_FILE_ENV,
        "KVPLUG_DISABLE_PLUGINS",
        "KVPLUG_DISABLE_PLUGIN_AUTOLOAD",
        "KVPLUG_HOST_BUFFER_SIZE",
        "KVPLUG_CONTRACT_URL",
        "KVPLUG_VENV",
        "KVPLUG_HOG_PROCESSES",
    }
)

#: LMCache keys about storage that kvplug reads, and kvplug's own ``tiers``.
CONFIG_KEYS: tuple[str, ...] = (
    "chunk_size",
    "tiers",
    "buffer_size",
    "write_behind_size",
    "local_cpu",
    "max_local_cpu_size",
    "local_disk",
    "max_local_disk_size",
    "remote_url",
    "remote_serde",
    "gds_path",
    "weka_path",
    "cufile_buffer_size",
    "cache_policy",
    "blocking_timeout_secs",
    "save_unfull_chunk",
    "extra_config",
    "audit_actual_remote_url",
)

#: Keys that only shape the tiers made from LMCache's keys; none may appear beside ``tiers``.
LMCACHE_TIER_KEYS: frozenset[str] = frozenset(
    {
        "local_cpu",
        "max_local_cpu_size",
        "local_disk",
        "max_local_disk_size",
        "remote_url",
        "remote_serde",
        "gds_path",
        "weka_path",
        "cufile_buffer_size",
        "cache_policy",
        "blocking_timeout_secs",
        "audit_actual_remote_url",
    }
)

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

_TRUE_WORDS = frozenset({"true", "1", "yes", "on"})
_FALSE_WORDS = frozenset({"false", "0", "no", "off"})
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")


class ConfigWarning(UserWarning):
    """A configuration is usable but contains something kvplug ignores or that is deprecated."""


def _show(value: object) -> str:
    return mask_repr(value, limit=80)


def _is_ignored(key: str) -> bool:
    return key in IGNORED_LMCACHE_KEYS or key.startswith(_IGNORED_PREFIXES)


def _suggest(word: str, choices: Iterable[str]) -> str | None:
    by_lower = {choice.lower(): choice for choice in choices}
    close = difflib.get_close_matches(word.lower(), list(by_lower), n=1, cutoff=0.6)
    return by_lower[close[0]] if close else None


def _parse_url_chain(text: str) -> tuple[list[BackendURL], BackendURL]:
    """Wrappers (outermost first) and the innermost URL of ``wrapper::...::url``."""
    parts = split_chain(text)
    wrappers = [BackendURL.parse(p if "://" in p else f"{p}://") for p in parts[:-1]]
    return wrappers, BackendURL.parse(parts[-1])


def _dir_url(scheme: str, directory: str) -> str:
    """``scheme:///abs/dir``; ':' is escaped too, so that a path never contains '::'."""
    return f"{scheme}://" + quote(directory, safe="/,@+=")


@dataclass(frozen=True)
class TierConfig:
    """One tier: its URL (a ``wrapper::...::url`` chain is allowed) and its options.

    ``options`` go to the innermost backend, and override that URL's query parameters; a
    wrapper takes its options from its own query (``audit://?verify=true::redis://h:6379``).
    They are kept as given and validated by the backend when the tier is opened.
    """

    url: str
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))
        remember_in(self.options)

    @property
    def parsed(self) -> BackendURL:
        """The innermost URL, parsed: the backend that stores the data."""
        return _parse_url_chain(self.url)[1]

    @property
    def wrappers(self) -> tuple[BackendURL, ...]:
        """The wrappers around the innermost backend, outermost first."""
        return tuple(_parse_url_chain(self.url)[0])

    def to_dict(self) -> dict[str, Any]:
        """``{"url": ..., **options}``, the mapping form of a ``tiers:`` item."""
        return {"url": self.url, **self.options}

    def __hash__(self) -> int:
        return hash((self.url, tuple(sorted(self.options))))

    def __str__(self) -> str:
        return mask_url(self.url)

    def __repr__(self) -> str:
        return f"TierConfig(url={mask_url(self.url)!r}, options={mask_data(self.options)!r})"


def default_tiers() -> tuple[TierConfig, ...]:
    """The tiers of a configuration that sets none: host memory, 5 GiB, LRU."""
    return (TierConfig("cpu://", {"max_size": DEFAULT_CPU_SIZE, "eviction": "lru"}),)


def _empty_mapping() -> Mapping[str, Any]:
    return MappingProxyType({})


@dataclass(frozen=True, repr=False)
class Config:
    """A validated kvplug configuration. Read :attr:`tiers`; build it with :func:`load_config`,
    :meth:`from_dict` or :meth:`from_yaml`.

    Fields hold normalised values: sizes are **bytes** (LMCache's GiB and MiB numbers are
    converted), ``cache_policy`` is upper-case, ``local_disk``, ``gds_path`` and ``weka_path``
    are absolute paths. When the configuration uses the explicit ``tiers:`` form,
    :attr:`explicit_tiers` holds it and the LMCache tier fields keep their defaults, unused.
    The dataclass constructor checks types and ranges of already-normalised values only; use
    the builders for anything a person wrote.

    Example, an LMCache config file and its kvplug equivalent::

        >>> from kvplug.config import Config
        >>> lmcache = Config.from_yaml('''
        ... chunk_size: 256
        ... local_cpu: true
        ... max_local_cpu_size: 2          # GiB
        ... remote_url: "redis://cache-1:6379"
        ... remote_serde: naive
        ... ''')
        >>> [(t.url, dict(t.options)) for t in lmcache.tiers]
        [('cpu://', {'max_size': 2147483648, 'eviction': 'lru'}), ('redis://cache-1:6379', {})]
        >>> explicit = Config.from_yaml('''
        ... tiers:
        ...   - {url: "cpu://", max_size: 2147483648, eviction: lru}
        ...   - redis://cache-1:6379
        ... ''')
        >>> explicit.tiers == lmcache.tiers
        True
    """

    chunk_size: int = DEFAULT_CHUNK_SIZE
    save_unfull_chunk: bool = True
    explicit_tiers: tuple[TierConfig, ...] | None = None
    buffer_size: int | None = None
    """Bytes of host memory a Store may use in all (its memory budget); ``None``: the cpu
    tier's ``max_size`` when there is a cpu tier, else 2 GiB."""
    write_behind_size: int | None = None
    """Bytes of objects a Store may hold waiting for its lower tiers; ``None``: a quarter of
    the memory budget."""
    local_cpu: bool = True
    max_local_cpu_size: int = DEFAULT_CPU_SIZE
    local_disk: str | None = None
    max_local_disk_size: int = 0
    remote_url: str | None = None
    remote_serde: str = "naive"
    gds_path: str | None = None
    weka_path: str | None = None
    cufile_buffer_size: int | None = None
    cache_policy: str = DEFAULT_CACHE_POLICY
    blocking_timeout_secs: float | None = None
    extra_config: Mapping[str, Any] = field(default_factory=_empty_mapping)
    audit_actual_remote_url: str | None = None

    def __post_init__(self) -> None:
        _check_normalised(self)
        object.__setattr__(self, "extra_config", MappingProxyType(dict(self.extra_config)))
        remember_in(self.extra_config)
        if self.explicit_tiers is not None:
            object.__setattr__(self, "explicit_tiers", tuple(self.explicit_tiers))
            tiers = self.explicit_tiers
        else:
            tiers = _lmcache_tiers(self)
        object.__setattr__(self, "_tiers", tiers)

    @property
    def tiers(self) -> tuple[TierConfig, ...]:
        """The tiers in lookup order: a get searches them first to last."""
        tiers: tuple[TierConfig, ...] = self.__dict__["_tiers"]
        return tiers

    @staticmethod
    def default_tiers() -> tuple[TierConfig, ...]:
        """The tiers of a configuration that sets none: ``cpu://``, 5 GiB, LRU eviction."""
        return default_tiers()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "in the config dict") -> Config:
        """Build from a mapping with the keys of a config file (no environment is read).

        ``source`` says where the mapping came from, for error messages.
        """
        layers = _Layers()
        layers.add_mapping(data, source)
        return layers.build()

    @classmethod
    def from_yaml(cls, source: str | os.PathLike[str]) -> Config:
        """Build from YAML text or a YAML file (no environment is read).

        A :class:`~pathlib.Path`, or a one-line string that ends in ``.yaml``/``.yml``/``.json``
        or names an existing file, is read as a file; any other string is YAML text.
        """
        if isinstance(source, str) and not _looks_like_path(source):
            data = _parse_yaml(source, "the YAML text")
            return cls.from_dict(data, source="in the YAML text")
        path = _expand(source)
        return cls.from_dict(_read_yaml_file(path, None), source=f"in {path}")

    def to_dict(self) -> dict[str, Any]:
        """The explicit form (``tiers:``) of this configuration; ``from_dict`` reads it back.

        It holds the passwords and secret options as given: do not print it, print
        ``kvplug.secrets.mask_data(config.to_dict())`` (what ``kvplug config`` shows).
        """
        data: dict[str, Any] = {
            "chunk_size": self.chunk_size,
            "save_unfull_chunk": self.save_unfull_chunk,
            "tiers": [tier.to_dict() if tier.options else tier.url for tier in self.tiers],
        }
        for name in ("buffer_size", "write_behind_size"):
            if getattr(self, name) is not None:
                data[name] = getattr(self, name)
        if self.extra_config:
            data["extra_config"] = dict(self.extra_config)
        return data

    def __hash__(self) -> int:
        return hash(
            (
                self.chunk_size,
                self.save_unfull_chunk,
                self.tiers,
                self.buffer_size,
                self.write_behind_size,
            )
        )

    def __repr__(self) -> str:
        return (
            f"Config(chunk_size={self.chunk_size}, save_unfull_chunk={self.save_unfull_chunk}, "
            f"tiers={self.tiers!r})"
        )


def _check_normalised(config: Config) -> None:
    def bad(name: str, expected: str) -> ConfigError:
        value = getattr(config, name)
        return ConfigError(
            f"Config({name}={_show(value)}) is not {expected}. Pass normalised values (sizes in "
            "bytes), or build the config with load_config() or Config.from_dict()."
        )

    if isinstance(config.chunk_size, bool) or not isinstance(config.chunk_size, int):
        raise bad("chunk_size", "a positive integer")
    if config.chunk_size <= 0:
        raise bad("chunk_size", "a positive integer")
    optional_sizes = ("cufile_buffer_size", "buffer_size", "write_behind_size")
    for name in ("max_local_cpu_size", "max_local_disk_size", *optional_sizes):
        value = getattr(config, name)
        if value is None and name in optional_sizes:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise bad(name, "a number of bytes (an int >= 0)")
    for name in ("local_cpu", "save_unfull_chunk"):
        if not isinstance(getattr(config, name), bool):
            raise bad(name, "a bool")
    if config.cache_policy not in CACHE_POLICIES:
        raise bad("cache_policy", "one of " + ", ".join(CACHE_POLICIES))
    if not isinstance(config.extra_config, Mapping):
        raise bad("extra_config", "a mapping")
    if config.explicit_tiers is not None and not all(
        isinstance(tier, TierConfig) for tier in config.explicit_tiers
    ):
        raise bad("explicit_tiers", "a sequence of TierConfig")


def _lmcache_tiers(config: Config) -> tuple[TierConfig, ...]:
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
            "the audit wrapper would wrap itself. Set it to the store to audit, e.g. redis://cache-1:6379."
        )
    if "audit_verify_checksum" in extra:
        verify = bool(extra["audit_verify_checksum"])
    else:
        verify = audit.options.get("verify", "").lower() in {"true", "1", "yes"}
    return f"audit://?verify={'true' if verify else 'false'}::{actual}"


# --- reading raw values ---------------------------------------------------------------------


def _expand(path: str | os.PathLike[str]) -> Path:
    """``path`` with ``~`` expanded; unchanged when the home directory is unknown."""
    try:
        return Path(path).expanduser()
    except RuntimeError:
        return Path(path)


def _looks_like_path(text: str) -> bool:
    if "\n" in text:
        return False
    stripped = text.strip()
    if stripped.lower().endswith((".yaml", ".yml", ".json")):
        return True
    try:
        return _expand(stripped).is_file()
    except (OSError, ValueError):  # ValueError: a NUL character
        return False


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that rejects a key given twice in one mapping."""


def _construct_unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _value_node in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node)
        try:
            duplicate = key in seen
        except TypeError:
            continue
        if duplicate:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping",
                node.start_mark,
                f"found the key {key!r} twice; give each key once",
                key_node.start_mark,
            )
        seen.add(key)
    return loader.construct_mapping(node)


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping
)


MAX_NESTING = 32
"""How deep config values may nest; far beyond any real configuration."""


def _nesting_depth(data: object) -> int:
    """How deep ``data``'s mappings and lists nest, found without recursion (each container
    is walked once, so YAML aliases that share one list many times cost nothing extra)."""
    deepest = 0
    seen: set[int] = set()
    stack: list[tuple[object, int]] = [(data, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, Mapping):
            children: Iterable[object] = value.values()
        elif isinstance(value, list | tuple):
            children = value
        else:
            continue
        if id(value) in seen:
            continue
        seen.add(id(value))
        deepest = max(deepest, depth + 1)
        if deepest > MAX_NESTING:
            break
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _parse_yaml(text: str, where: str) -> Mapping[str, Any]:
    too_deep = ConfigError(
        f"cannot read {where}: its values nest more than {MAX_NESTING} levels deep, which no "
        "kvplug or LMCache setting needs. Flatten the nested lists and mappings."
    )
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        problem = getattr(error, "problem", None) or str(error)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(
            f"cannot read {where}: invalid YAML{at}: {problem}. Fix the YAML there."
        ) from None
    except RecursionError:
        raise too_deep from None
    if _nesting_depth(data) > MAX_NESTING:
        raise too_deep
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{where} must hold a mapping of config keys at the top level (key: value lines), "
            f"but holds a {type(data).__name__}. Write it as e.g. 'chunk_size: 256'."
        )
    return data


def _read_yaml_file(path: Path, named_by: str | None) -> Mapping[str, Any]:
    origin = f" (named by {named_by})" if named_by else ""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            f"config file {path}{origin} does not exist. Check the path, or leave it unset to "
            "use the defaults."
        ) from None
    except IsADirectoryError:
        raise ConfigError(
            f"config file {path}{origin} is a directory. Name the YAML file inside it."
        ) from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(
            f"cannot read config file {path}{origin}: {error}. Make it a readable UTF-8 file."
        ) from None
    return _parse_yaml(text, f"config file {path}{origin}")


# --- converting values -----------------------------------------------------------------------

_Coercer = Callable[[Any, str, str], Any]


def _bad(key: str, source: str, expected: str, value: object, fix: str) -> ConfigError:
    return ConfigError(f"config key {key!r} {source} must be {expected}, got {_show(value)}. {fix}")


def _to_bool(value: Any, key: str, source: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _TRUE_WORDS:
            return True
        if word in _FALSE_WORDS:
            return False
    raise _bad(key, source, "a boolean", value, "Use true or false (also 1/0, yes/no, on/off).")


def _to_chunk_size(value: Any, key: str, source: str) -> int:
    number: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
        number = int(value)
    if number is None or number <= 0:
        raise _bad(
            key, source, "a positive whole number of tokens", value, "Use e.g. 256 (the default)."
        )
    return number


def _as_number(value: Any) -> float | None:
    """``value`` as a float when it is a number or a string holding one, else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        if abs(value) >= 1 << 1000:
            return math.inf if value > 0 else -math.inf
        return float(value)
    if isinstance(value, float):
        return value
    if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        return float(value)
    return None


def _size(value: Any, key: str, source: str, unit: int, unit_name: str) -> int:
    example = f"a number of {unit_name} such as 5, or a size such as '512MiB' or '5GiB'"
    number = _as_number(value)
    try:
        if number is None:
            return parse_size(value.strip() if isinstance(value, str) else value, what=key)
        if number < 0 or math.isnan(number):
            raise _bad(key, source, f"a size >= 0 ({example})", value, "Use a size >= 0.")
        if isinstance(value, int) and not isinstance(value, bool):
            return parse_size(value * unit, what=key)
        scaled = number * unit
        return parse_size(int(scaled) if math.isfinite(scaled) else scaled, what=key)
    except InvalidSize as error:
        raise _bad(key, source, example, value, f"Fix the value: {error.reason}.") from None


def _to_gib(value: Any, key: str, source: str) -> int:
    return _size(value, key, source, GiB, "GiB")


def _to_mib_or_none(value: Any, key: str, source: str) -> int | None:
    if value is None or value == "":
        return None
    return _size(value, key, source, MiB, "MiB")


def _to_bytes_or_none(value: Any, key: str, source: str) -> int | None:
    if value is None or value == "":
        return None
    size = _size(value, key, source, 1, "bytes")
    if size == 0:
        raise _bad(key, source, "a size > 0", value, "Give a size such as '1GiB', or remove it.")
    return size


def _to_dir_or_none(value: Any, key: str, source: str) -> str | None:
    if value is None or value == "":
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise _bad(key, source, "a directory path", value, "Write it as /path/to/dir.")
    text = value[len("file://") :] if value.startswith("file://") else value
    if not text:
        raise _bad(key, source, "a directory path", value, "Write it as /path/to/dir.")
    return os.path.normpath(_expand(text).absolute())


def _check_url(text: str, key: str, source: str) -> None:
    try:
        _parse_url_chain(text)
    except InvalidBackendURL as error:
        raise InvalidBackendURL(f"config key {key!r} {source}: {error}") from None


def _to_url_or_none(value: Any, key: str, source: str) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise _bad(key, source, "a URL string", value, "Write it as scheme://host:port, in quotes.")
    _check_url(value, key, source)
    return value


def _to_serde(value: Any, key: str, source: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _bad(key, source, "a serde name", value, "Use naive (the default) or a serde name.")
    return value.strip()


def _to_policy(value: Any, key: str, source: str) -> str:
    if isinstance(value, str) and value.strip().upper() in CACHE_POLICIES:
        return value.strip().upper()
    hint = _suggest(value, CACHE_POLICIES) if isinstance(value, str) else None
    fix = f"Did you mean {hint!r}? " if hint else ""
    raise _bad(
        key,
        source,
        "one of " + ", ".join(CACHE_POLICIES) + " (any case)",
        value,
        fix + "LRU is the default.",
    )


def _to_seconds_or_none(value: Any, key: str, source: str) -> float | None:
    if value is None or value == "":
        return None
    number = _as_number(value)
    if number is None or not math.isfinite(number) or number <= 0:
        raise _bad(key, source, "a number of seconds > 0", value, "Use e.g. 10.")
    return number


def _to_extra_config(value: Any, key: str, source: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise _bad(key, source, "a mapping", value, "Write it as key: value lines under it.")
    extra: dict[str, Any] = {}
    for name, item in value.items():
        if not isinstance(name, str):
            raise _bad(key, source, "a mapping with string keys", name, "Quote the key.")
        extra[name] = item
    for name in ("use_odirect", "audit_verify_checksum"):
        if name in extra:
            extra[name] = _to_bool(extra[name], f"{key}.{name}", source)
    if "audit_actual_remote_url" in extra:
        extra["audit_actual_remote_url"] = _to_url_or_none(
            extra["audit_actual_remote_url"], f"{key}.audit_actual_remote_url", source
        )
        if extra["audit_actual_remote_url"] is None:
            del extra["audit_actual_remote_url"]
    return extra


def _to_tiers(value: Any, key: str, source: str) -> tuple[TierConfig, ...]:
    if isinstance(value, str | bytes) or not isinstance(value, list | tuple):
        raise _bad(
            key, source, "a list of tiers", value, "Write one '- url' (or '- {url: ...}') per tier."
        )
    if not value:
        raise ConfigError(
            f"config key {key!r} {source} is an empty list, so nothing would be cached. "
            "List at least one tier, e.g. '- cpu://', or remove the key for the default."
        )
    tiers: list[TierConfig] = []
    for index, item in enumerate(value):
        where = f"{key}[{index}]"
        if isinstance(item, TierConfig):
            tier = item
        elif isinstance(item, str):
            tier = TierConfig(item)
        elif isinstance(item, Mapping):
            if not isinstance(item.get("url"), str):
                raise _bad(
                    where,
                    source,
                    "a URL string or a mapping with a 'url' string",
                    item,
                    "Write it as {url: 'redis://host:6379', option: value}.",
                )
            options: dict[str, Any] = {}
            for name, option in item.items():
                if not isinstance(name, str):
                    raise _bad(where, source, "a mapping with string keys", name, "Quote the key.")
                if name != "url":
                    options[name] = option
            tier = TierConfig(item["url"], options)
        else:
            raise _bad(
                where,
                source,
                "a URL string or a mapping with a 'url' string",
                item,
                "Write it as 'cpu://' or {url: 'cpu://', max_size: 5GiB}.",
            )
        _check_url(tier.url, where, source)
        tiers.append(tier)
    return tuple(tiers)


_COERCERS: dict[str, _Coercer] = {
    "chunk_size": _to_chunk_size,
    "tiers": _to_tiers,
    "buffer_size": _to_bytes_or_none,
    "write_behind_size": _to_bytes_or_none,
    "local_cpu": _to_bool,
    "max_local_cpu_size": _to_gib,
    "local_disk": _to_dir_or_none,
    "max_local_disk_size": _to_gib,
    "remote_url": _to_url_or_none,
    "remote_serde": _to_serde,
    "gds_path": _to_dir_or_none,
    "weka_path": _to_dir_or_none,
    "cufile_buffer_size": _to_mib_or_none,
    "cache_policy": _to_policy,
    "blocking_timeout_secs": _to_seconds_or_none,
    "save_unfull_chunk": _to_bool,
    "extra_config": _to_extra_config,
    "audit_actual_remote_url": _to_url_or_none,
}


# --- layering --------------------------------------------------------------------------------


def _env_name(key: str) -> str:
    return ENV_PREFIX + key.upper()


def core_env_names() -> frozenset[str]:
    """Every ``KVPLUG_*`` variable that kvplug itself reads: ``KVPLUG_<KEY>`` for each config
    key and each LMCache key it accepts and ignores, and :data:`OTHER_ENV_VARS`. These stay
    kvplug's whatever plugins are installed; the rest of ``KVPLUG_<PLUGIN>_*`` is the plugin's
    (:mod:`kvplug.env`)."""
    return _CORE_ENV_NAMES


_CORE_ENV_NAMES = frozenset(
    {_env_name(key) for key in (*CONFIG_KEYS, *IGNORED_LMCACHE_KEYS)} | OTHER_ENV_VARS
)


class _Layers:
    """Raw settings with the place each came from; later layers override earlier ones."""

    def __init__(self) -> None:
        self.values: dict[str, tuple[Any, str]] = {}
        self.ignored: dict[str, str] = {}

    def _set(self, key: str, value: Any, source: str) -> None:
        previous = self.values.get(key)
        if (
            key == "extra_config"
            and previous is not None
            and isinstance(previous[0], Mapping)
            and isinstance(value, Mapping)
        ):
            # extra_config merges key by key, so one layer can add to another's.
            value = {**previous[0], **value}
            source = f"{previous[1]} and {source}"
        self.values[key] = (value, source)

    def add_mapping(self, data: Mapping[Any, Any], source: str) -> None:
        if not isinstance(data, Mapping):
            raise ConfigError(
                f"the config {source} must be a mapping of keys to values, got "
                f"{type(data).__name__}. Pass a dict such as {{'chunk_size': 256}}."
            )
        unknown: list[str] = []
        for key, value in data.items():
            if not isinstance(key, str):
                raise ConfigError(
                    f"config key {key!r} {source} is not a string. Config keys are names such "
                    f"as chunk_size; quote it or remove it."
                )
            if key in _COERCERS:
                self._set(key, value, source)
            elif _is_ignored(key):
                self.ignored[key] = source
            else:
                unknown.append(key)
        if unknown:
            raise ConfigError(_unknown_keys_message(unknown, source))

    def add_env(self, env: Mapping[str, str]) -> None:
        plugin_names: list[str] | None = None
        for name in sorted(env):
            if not name.startswith(ENV_PREFIX) or name in OTHER_ENV_VARS:
                continue
            raw = env[name]
            key = name[len(ENV_PREFIX) :].lower()
            source = f"from environment variable {name}"
            if key == "tiers":
                urls = [part.strip() for part in re.split(r"[;\n]", raw) if part.strip()]
                self._set(key, urls or None, source)
            elif key == "extra_config":
                self._set(key, _json_object(name, raw), source)
            elif key in _COERCERS:
                self._set(key, raw, source)
            elif key in IGNORED_LMCACHE_KEYS:
                self.ignored[name] = source
            else:
                if plugin_names is None:
                    plugin_names = installed_plugin_names()
                if env_owner(name, plugin_names) is not None:
                    continue  # KVPLUG_<PLUGIN>_*: the plugin reads it (kvplug.env.plugin_env)
                if _is_ignored(key):
                    self.ignored[name] = source
                else:
                    raise ConfigError(_unknown_env_message(name, plugin_names))

    def build(self) -> Config:
        if self.ignored:
            warnings.warn(
                "these LMCache settings are not used by kvplug and are ignored: "
                + ", ".join(sorted(self.ignored))
                + ". They are not about storage; remove them to silence this warning.",
                ConfigWarning,
                stacklevel=3,
            )
        self._check_one_form()
        fields: dict[str, Any] = {}
        for key, (value, source) in self.values.items():
            converted = _COERCERS[key](value, key, source)
            if key == "tiers":
                if converted is not None:
                    fields["explicit_tiers"] = converted
            else:
                fields[key] = converted
        if "audit_actual_remote_url" in self.values:
            warnings.warn(
                "the top-level key audit_actual_remote_url "
                f"({self.values['audit_actual_remote_url'][1]}) is deprecated in LMCache; move "
                "it under extra_config, or write remote_url: audit::<url>.",
                ConfigWarning,
                stacklevel=3,
            )
        config = Config(**fields)
        _warn_unused_disk(config)
        return config

    def _check_one_form(self) -> None:
        tiers = self.values.get("tiers")
        if tiers is None or tiers[0] is None:
            return
        mixed = sorted(
            key for key in LMCACHE_TIER_KEYS if self.values.get(key, (None, ""))[0] is not None
        )
        if mixed:
            named = "; ".join(f"{key} {self.values[key][1]}" for key in mixed)
            raise ConfigError(
                f"the config sets tiers {tiers[1]} and also LMCache's tier keys ({named}). The "
                "two forms describe the same thing, so kvplug cannot tell which one you mean. "
                "Use one form: list every tier under tiers: (docs/config.md shows the tiers "
                "equivalent of each LMCache key), or remove tiers and keep the LMCache keys."
            )


def _warn_unused_disk(config: Config) -> None:
    if config.explicit_tiers is not None:
        return
    if config.local_disk is not None and config.max_local_disk_size == 0:
        warnings.warn(
            "local_disk is set but max_local_disk_size is 0, so there is no disk tier. Set "
            "max_local_disk_size (GiB) to use the disk.",
            ConfigWarning,
            stacklevel=4,
        )
    elif config.local_disk is None and config.max_local_disk_size > 0:
        warnings.warn(
            "max_local_disk_size is set but local_disk is not, so there is no disk tier. Set "
            "local_disk to a directory to use the disk.",
            ConfigWarning,
            stacklevel=4,
        )


def _json_object(name: str, raw: str) -> dict[str, Any] | None:
    if not raw.strip():
        return None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as error:
        raise ConfigError(
            f"environment variable {name} is not valid JSON ({error.msg} at character "
            f"{error.pos}). Set it to a JSON object, e.g. {name}='{{\"use_odirect\": true}}'."
        ) from None
    if not isinstance(value, dict):
        raise ConfigError(
            f"environment variable {name} must be a JSON object, got {type(value).__name__}. "
            f"Set it to e.g. {name}='{{\"use_odirect\": true}}'."
        )
    return value


def _valid_keys_text() -> str:
    return (
        "Valid keys: " + ", ".join(CONFIG_KEYS) + ". LMCache's keys that are not about storage "
        "(enable_blending, enable_p2p, enable_nixl, nixl_*, use_layerwise, ...) are accepted "
        "and ignored."
    )


def _unknown_keys_message(keys: list[str], source: str) -> str:
    parts = []
    for key in keys:
        hint = _suggest(key, [*CONFIG_KEYS, *IGNORED_LMCACHE_KEYS])
        parts.append(f"{key!r}" + (f" (did you mean {hint!r}?)" if hint else ""))
    return (
        f"unknown config key{'s' if len(keys) > 1 else ''} {', '.join(parts)} {source}. "
        f"Fix or remove {'them' if len(keys) > 1 else 'it'}. {_valid_keys_text()}"
    )


def _unknown_env_message(name: str, plugin_names: list[str]) -> str:
    config_names = [_env_name(key) for key in CONFIG_KEYS]
    # A misspelled plugin prefix (KVPLUG_REDSI_TIMEOUT) is compared with the same setting under
    # each installed plugin's prefix.
    _, _, setting = name[len(ENV_PREFIX) :].partition("_")
    plugin_variables = [plugin_env_prefix(p) + setting for p in plugin_names] if setting else []
    hint = _suggest(name, [*config_names, *OTHER_ENV_VARS, *plugin_variables])
    did_you_mean = f" Did you mean {hint}?" if hint else ""
    prefixes = ", ".join(f"{plugin_env_prefix(p)}*" for p in plugin_names) or "none installed"
    return (
        f"environment variable {name} is not a kvplug setting.{did_you_mean} Rename or unset "
        f"it. kvplug reads KVPLUG_<KEY> for each config key ({', '.join(config_names)}) and "
        f"also uses {', '.join(sorted(OTHER_ENV_VARS))}; each installed plugin reads its own "
        f"KVPLUG_<PLUGIN>_* ({prefixes})."
    )


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    **overrides: Any,
) -> Config:
    """Load the configuration: defaults < YAML file < ``KVPLUG_*`` variables < ``overrides``.

    ``path`` defaults to ``KVPLUG_CONFIG_FILE`` when that is set; without either, no file is
    read. ``env`` replaces ``os.environ`` (tests pass a dict). ``overrides`` take config keys,
    e.g. ``load_config(chunk_size=512, tiers=["cpu://"])``. Raises
    :class:`~kvplug.errors.ConfigError` (or its subclass
    :class:`~kvplug.errors.InvalidBackendURL`) saying what is wrong, where, and how to fix it.

    Example::

        >>> config = load_config(env={"KVPLUG_TIERS": "cpu://?max_size=1GiB;blackhole://"})
        >>> [tier.url for tier in config.tiers]
        ['cpu://?max_size=1GiB', 'blackhole://']
    """
    environ: Mapping[str, str] = os.environ if env is None else env
    layers = _Layers()
    named_by: str | None = None
    if path is None and environ.get(CONFIG_FILE_ENV):
        path, named_by = environ[CONFIG_FILE_ENV], CONFIG_FILE_ENV
    if path is not None:
        file = _expand(path)
        layers.add_mapping(_read_yaml_file(file, named_by), f"in {file}")
    layers.add_env(environ)
    layers.add_mapping(overrides, "passed to load_config()")
    return layers.build()


__all__ = [
    "CACHE_POLICIES",
    "CONFIG_KEYS",
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_CPU_SIZE",
    "IGNORED_LMCACHE_KEYS",
    "LMCACHE_TIER_KEYS",
    "OTHER_ENV_VARS",
    "Config",
    "ConfigWarning",
    "TierConfig",
    "core_env_names",
    "default_tiers",
    "load_config",
]
