"""How each config key's value becomes a field of :class:`~kvplug.runtime.config.Config`.

A layer (a YAML file, the environment, keyword arguments) gives each key as a :class:`Sourced`
value: what a person wrote, and where. The annotated field types below convert it, leniently
(LMCache's GiB and MiB numbers, sizes such as ``'5GiB'``, ``yes``/``no``, ...) and with errors
that name the key and its source. A value given to ``Config(...)`` directly is not a
:class:`Sourced` one: it must already be normalised, and is only checked.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, Any

from pydantic import GetCoreSchemaHandler, ValidationInfo
from pydantic_core import CoreSchema, core_schema

from kvplug.errors import ConfigError
from kvplug.eviction import POLICIES
from kvplug.runtime.config.messages import bad_value, show, suggest
from kvplug.runtime.config.tier import TierConfig, check_url
from kvplug.secrets import remember_in
from kvplug.units import GiB, InvalidSize, parse_size

MiB = 1 << 20
CACHE_POLICIES = tuple(name.upper() for name in POLICIES)

_TRUE_WORDS = frozenset({"true", "1", "yes", "on"})
_FALSE_WORDS = frozenset({"false", "0", "no", "off"})
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")


@dataclass(frozen=True)
class Sourced:
    """A value as a layer gave it: the config key it was set under, and where (``in
    /etc/kvplug.yaml``, ``from environment variable KVPLUG_CHUNK_SIZE``, ...)."""

    value: Any
    key: str
    source: str


Converter = Callable[[Any, str, str], Any]
"""Turns ``(value, key, source)`` into a field value, or raises a ConfigError naming both."""


def _anything(value: object) -> bool:
    return True


def _same(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class ConfigValue:
    """The validation of one config key, as ``Annotated`` metadata of its field.

    ``convert`` reads a :class:`Sourced` value. Any other value was given to ``Config(...)``
    directly; it must pass ``is_normalised`` (``expected`` says what that is), and is kept.
    ``finish`` makes either result the field's stored form.
    """

    convert: Converter
    expected: str = "normalised"
    is_normalised: Callable[[Any], bool] = _anything
    finish: Callable[[Any], Any] = _same

    def __get_pydantic_core_schema__(
        self, source_type: Any, handler: GetCoreSchemaHandler
    ) -> CoreSchema:
        return core_schema.with_info_plain_validator_function(self._validate)

    def _validate(self, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, Sourced):
            return self.finish(self.convert(value.value, value.key, value.source))
        if is_sourced_mapping(value):
            # extra_config from one or more layers, merged key by key: each item keeps its source.
            first: Sourced = next(iter(value.values()))
            return self.finish(self.convert(value, first.key, first.source))
        if not self.is_normalised(value):
            raise ConfigError(
                f"Config({info.field_name}={show(value)}) is not {self.expected}. Pass "
                "normalised values (sizes in bytes), or build the config with load_config() or "
                "Config.from_dict()."
            )
        return self.finish(value)


def is_sourced_mapping(value: object) -> bool:
    """Whether ``value`` is a non-empty dict of :class:`Sourced` items (an ``extra_config``
    that layers give item by item)."""
    return (
        isinstance(value, dict)
        and bool(value)
        and all(isinstance(item, Sourced) for item in value.values())
    )


# --- converters: (value, key, source) -> field value -------------------------------------------


def to_bool(value: Any, key: str, source: str) -> bool:
    """``true``/``false`` and also 1/0, yes/no, on/off in any case."""
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
    raise bad_value(
        key, source, "a boolean", value, "Use true or false (also 1/0, yes/no, on/off)."
    )


def to_chunk_size(value: Any, key: str, source: str) -> int:
    """A positive whole number of tokens, as an int or a string of digits."""
    number: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
        number = int(value)
    if number is None or number <= 0:
        raise bad_value(
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
    """Bytes: a plain number counts ``unit``s (LMCache's GiB or MiB), a size has its own unit."""
    example = f"a number of {unit_name} such as 5, or a size such as '512MiB' or '5GiB'"
    number = _as_number(value)
    try:
        if number is None:
            return parse_size(value.strip() if isinstance(value, str) else value, what=key)
        if number < 0 or math.isnan(number):
            raise bad_value(key, source, f"a size >= 0 ({example})", value, "Use a size >= 0.")
        if isinstance(value, int) and not isinstance(value, bool):
            return parse_size(value * unit, what=key)
        scaled = number * unit
        return parse_size(int(scaled) if math.isfinite(scaled) else scaled, what=key)
    except InvalidSize as error:
        raise bad_value(key, source, example, value, f"Fix the value: {error.reason}.") from None


def _is_unset(value: Any) -> bool:
    return value is None or value == ""


def to_gib(value: Any, key: str, source: str) -> int:
    """Bytes from GiB (LMCache's unit for cpu and disk sizes) or a size with a unit."""
    return _size(value, key, source, GiB, "GiB")


def to_mib_or_none(value: Any, key: str, source: str) -> int | None:
    """Bytes from MiB (LMCache's unit for cufile_buffer_size) or a size; unset is None."""
    return None if _is_unset(value) else _size(value, key, source, MiB, "MiB")


def to_bytes_or_none(value: Any, key: str, source: str) -> int | None:
    """A size > 0 in bytes; unset is None."""
    if _is_unset(value):
        return None
    size = _size(value, key, source, 1, "bytes")
    if size == 0:
        raise bad_value(
            key, source, "a size > 0", value, "Give a size such as '1GiB', or remove it."
        )
    return size


def expand(path: str | os.PathLike[str]) -> Path:
    """``path`` with ``~`` expanded; unchanged when the home directory is unknown."""
    try:
        return Path(path).expanduser()
    except RuntimeError:
        return Path(path)


def to_dir_or_none(value: Any, key: str, source: str) -> str | None:
    """An absolute, normalised directory path; a ``file://`` prefix is dropped; unset is None."""
    if _is_unset(value):
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise bad_value(key, source, "a directory path", value, "Write it as /path/to/dir.")
    text = value.removeprefix("file://")
    if not text:
        raise bad_value(key, source, "a directory path", value, "Write it as /path/to/dir.")
    return os.path.normpath(expand(text).absolute())


def to_url_or_none(value: Any, key: str, source: str) -> str | None:
    """A backend URL (or chain), checked now; unset is None."""
    if _is_unset(value):
        return None
    if not isinstance(value, str):
        raise bad_value(
            key, source, "a URL string", value, "Write it as scheme://host:port, in quotes."
        )
    check_url(value, key, source)
    return value


def to_serde(value: Any, key: str, source: str) -> str:
    """A serde name."""
    if not isinstance(value, str) or not value.strip():
        raise bad_value(
            key, source, "a serde name", value, "Use naive (the default) or a serde name."
        )
    return value.strip()


def to_policy(value: Any, key: str, source: str) -> str:
    """An eviction policy, upper-cased."""
    if isinstance(value, str) and value.strip().upper() in CACHE_POLICIES:
        return value.strip().upper()
    hint = suggest(value, CACHE_POLICIES) if isinstance(value, str) else None
    fix = f"Did you mean {hint!r}? " if hint else ""
    raise bad_value(
        key,
        source,
        "one of " + ", ".join(CACHE_POLICIES) + " (any case)",
        value,
        fix + "LRU is the default.",
    )


def to_seconds_or_none(value: Any, key: str, source: str) -> float | None:
    """A number of seconds > 0; unset is None."""
    if _is_unset(value):
        return None
    number = _as_number(value)
    if number is None or not math.isfinite(number) or number <= 0:
        raise bad_value(key, source, "a number of seconds > 0", value, "Use e.g. 10.")
    return number


def to_extra_config(value: Any, key: str, source: str) -> dict[str, Any]:
    """A mapping kept as given, but for the items kvplug reads (``use_odirect``,
    ``audit_verify_checksum``, ``audit_actual_remote_url``), which are converted."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise bad_value(key, source, "a mapping", value, "Write it as key: value lines under it.")
    extra: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name, item in value.items():
        item_source = item.source if isinstance(item, Sourced) else source
        if not isinstance(name, str):
            raise bad_value(key, item_source, "a mapping with string keys", name, "Quote the key.")
        extra[name] = item.value if isinstance(item, Sourced) else item
        sources[name] = item_source
    for name in ("use_odirect", "audit_verify_checksum"):
        if name in extra:
            extra[name] = to_bool(extra[name], f"{key}.{name}", sources[name])
    if "audit_actual_remote_url" in extra:
        actual = to_url_or_none(
            extra["audit_actual_remote_url"],
            f"{key}.audit_actual_remote_url",
            sources["audit_actual_remote_url"],
        )
        if actual is None:
            del extra["audit_actual_remote_url"]
        else:
            extra["audit_actual_remote_url"] = actual
    return extra


def _tier(item: Any, where: str, source: str) -> TierConfig:
    if isinstance(item, TierConfig):
        return item
    if isinstance(item, str):
        return TierConfig(item)
    if not isinstance(item, Mapping):
        raise bad_value(
            where,
            source,
            "a URL string or a mapping with a 'url' string",
            item,
            "Write it as 'cpu://' or {url: 'cpu://', max_size: 5GiB}.",
        )
    if not isinstance(item.get("url"), str):
        raise bad_value(
            where,
            source,
            "a URL string or a mapping with a 'url' string",
            item,
            "Write it as {url: 'redis://host:6379', option: value}.",
        )
    options: dict[str, Any] = {}
    for name, option in item.items():
        if not isinstance(name, str):
            raise bad_value(where, source, "a mapping with string keys", name, "Quote the key.")
        if name != "url":
            options[name] = option
    return TierConfig(item["url"], options)


def to_tiers(value: Any, key: str, source: str) -> tuple[TierConfig, ...]:
    """A non-empty list of URL strings or ``{url: ..., option: value}`` mappings; URLs are
    checked now, options when the tier is opened."""
    if isinstance(value, str | bytes) or not isinstance(value, list | tuple):
        raise bad_value(
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
        tier = _tier(item, where, source)
        check_url(tier.url, where, source)
        tiers.append(tier)
    return tuple(tiers)


# --- field types --------------------------------------------------------------------------------


def _is_bytes(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_bytes_or_none(value: object) -> bool:
    return value is None or _is_bytes(value)


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_tiers_or_none(value: object) -> bool:
    return value is None or (
        isinstance(value, list | tuple) and all(isinstance(tier, TierConfig) for tier in value)
    )


def _frozen_mapping(value: Mapping[str, Any]) -> Mapping[str, Any]:
    frozen = MappingProxyType(dict(value))
    remember_in(frozen)
    return frozen


def _tuple_or_none(value: Any) -> tuple[TierConfig, ...] | None:
    return None if value is None else tuple(value)


_BYTES = "a number of bytes (an int >= 0)"

ChunkSize = Annotated[int, ConfigValue(to_chunk_size, "a positive integer", _is_positive_int)]
"""Tokens per chunk."""
Flag = Annotated[bool, ConfigValue(to_bool, "a bool", lambda value: isinstance(value, bool))]
"""A boolean; layers may write yes/no, on/off, 1/0."""
SizeInGiB = Annotated[int, ConfigValue(to_gib, _BYTES, _is_bytes)]
"""Bytes; a plain number in a layer counts GiB."""
OptionalSizeInMiB = Annotated[int | None, ConfigValue(to_mib_or_none, _BYTES, _is_bytes_or_none)]
"""Bytes or None; a plain number in a layer counts MiB."""
OptionalSize = Annotated[int | None, ConfigValue(to_bytes_or_none, _BYTES, _is_bytes_or_none)]
"""Bytes > 0 or None."""
OptionalDirectory = Annotated[str | None, ConfigValue(to_dir_or_none)]
"""An absolute directory path or None."""
OptionalURL = Annotated[str | None, ConfigValue(to_url_or_none)]
"""A backend URL or None."""
SerdeName = Annotated[str, ConfigValue(to_serde)]
"""A serde's name."""
CachePolicy = Annotated[
    str,
    ConfigValue(to_policy, "one of " + ", ".join(CACHE_POLICIES), lambda v: v in CACHE_POLICIES),
]
"""An eviction policy, upper case."""
OptionalSeconds = Annotated[float | None, ConfigValue(to_seconds_or_none)]
"""Seconds > 0 or None."""
ExtraConfig = Annotated[
    Mapping[str, Any],
    ConfigValue(
        to_extra_config, "a mapping", lambda value: isinstance(value, Mapping), _frozen_mapping
    ),
]
"""LMCache's ``extra_config``: read-only, its secrets remembered for masking."""
Tiers = Annotated[
    tuple[TierConfig, ...] | None,
    ConfigValue(to_tiers, "a sequence of TierConfig", _is_tiers_or_none, _tuple_or_none),
]
"""kvplug's explicit tiers, or None for the tiers made from LMCache's keys."""
