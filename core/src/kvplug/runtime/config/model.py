"""The validated configuration: :class:`Config`, its fields, and the tiers it describes."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from contextvars import ContextVar
from types import MappingProxyType
from typing import Annotated, Any

from pydantic import (
    AliasChoices,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    ValidationError,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from kvplug.errors import ConfigError
from kvplug.runtime.config.conversions import (
    CachePolicy,
    ChunkSize,
    ConfigValue,
    Converter,
    ExtraConfig,
    Flag,
    OptionalDirectory,
    OptionalSeconds,
    OptionalSize,
    OptionalSizeInMiB,
    OptionalURL,
    SerdeName,
    SizeInGiB,
    Sourced,
    Tiers,
)
from kvplug.runtime.config.lmcache import lmcache_tiers
from kvplug.runtime.config.messages import show, warn
from kvplug.runtime.config.tier import TierConfig
from kvplug.units import GiB

DEFAULT_CHUNK_SIZE = 256
DEFAULT_CPU_SIZE = 5 * GiB


class LMCacheTierKey:
    """Marks a field that only shapes the tiers made from LMCache's keys, so none of them may
    be set beside ``tiers``."""


_LMCACHE_TIER = LMCacheTierKey()

#: The layers :func:`~kvplug.runtime.config.load_config` is building a Config from, highest first;
#: None when a Config is built from keyword arguments alone.
active_layers: ContextVar[tuple[PydanticBaseSettingsSource, ...] | None] = ContextVar(
    "kvplug_config_layers", default=None
)


def default_tiers() -> tuple[TierConfig, ...]:
    """The tiers of a configuration that sets none: host memory, 5 GiB, LRU."""
    return (TierConfig("cpu://", {"max_size": DEFAULT_CPU_SIZE, "eviction": "lru"}),)


def _empty_mapping() -> Mapping[str, Any]:
    return MappingProxyType({})


class Config(BaseSettings):
    """A validated kvplug configuration. Read :attr:`tiers`; build it with :func:`load_config`,
    :meth:`from_dict` or :meth:`from_yaml`.

    Fields hold normalised values: sizes are **bytes** (LMCache's GiB and MiB numbers are
    converted), ``cache_policy`` is upper-case, ``local_disk``, ``gds_path`` and ``weka_path``
    are absolute paths. When the configuration uses the explicit ``tiers:`` form,
    :attr:`explicit_tiers` holds it and the LMCache tier fields keep their defaults, unused.
    The constructor checks types and ranges of already-normalised values only; use the
    builders for anything a person wrote.

    Example, an LMCache config file and its kvplug equivalent::

        >>> from kvplug.runtime.config import Config
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

    model_config = SettingsConfigDict(frozen=True, extra="forbid")

    # The order of the fields is the order of the keys in messages and docs.
    chunk_size: ChunkSize = DEFAULT_CHUNK_SIZE
    explicit_tiers: Tiers = Field(
        default=None, validation_alias=AliasChoices("tiers", "explicit_tiers")
    )
    """The config key ``tiers``: kvplug's explicit form."""
    buffer_size: OptionalSize = None
    """Bytes of host memory a Store may use in all (its memory budget); ``None``: the cpu
    tier's ``max_size`` when there is a cpu tier, else 2 GiB."""
    write_behind_size: OptionalSize = None
    """Bytes of objects a Store may hold waiting for its lower tiers; ``None``: a quarter of
    the memory budget."""
    local_cpu: Annotated[Flag, _LMCACHE_TIER] = True
    max_local_cpu_size: Annotated[SizeInGiB, _LMCACHE_TIER] = DEFAULT_CPU_SIZE
    local_disk: Annotated[OptionalDirectory, _LMCACHE_TIER] = None
    max_local_disk_size: Annotated[SizeInGiB, _LMCACHE_TIER] = 0
    remote_url: Annotated[OptionalURL, _LMCACHE_TIER] = None
    remote_serde: Annotated[SerdeName, _LMCACHE_TIER] = "naive"
    gds_path: Annotated[OptionalDirectory, _LMCACHE_TIER] = None
    weka_path: Annotated[OptionalDirectory, _LMCACHE_TIER] = None
    cufile_buffer_size: Annotated[OptionalSizeInMiB, _LMCACHE_TIER] = None
    cache_policy: Annotated[CachePolicy, _LMCACHE_TIER] = "LRU"
    blocking_timeout_secs: Annotated[OptionalSeconds, _LMCACHE_TIER] = None
    save_unfull_chunk: Flag = True
    extra_config: ExtraConfig = Field(default_factory=_empty_mapping)
    audit_actual_remote_url: Annotated[OptionalURL, _LMCACHE_TIER] = None

    _tiers: tuple[TierConfig, ...] = PrivateAttr(default=())

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as error:
            raise _config_error(error) from None

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Keyword arguments, above the layers :func:`load_config` reads when it builds this
        Config; no environment or file is read otherwise."""
        return (init_settings, *(active_layers.get() or ()))

    @model_validator(mode="wrap")
    @classmethod
    def _make_tiers(cls, data: Any, handler: ModelWrapValidatorHandler[Config]) -> Config:
        given = _sourced_keys(data)
        if given:
            _refuse_both_forms(given)
        try:
            config = handler(data)
        except ValidationError as error:
            # Of several bad values, report the one a person wrote first (the lowest layer's
            # first key), as the layers are in that order.
            raise _config_error(error, order=list(data) if given else ()) from None
        if "audit_actual_remote_url" in given:
            warn(
                "the top-level key audit_actual_remote_url "
                f"({given['audit_actual_remote_url'].source}) is deprecated in LMCache; move "
                "it under extra_config, or write remote_url: audit::<url>."
            )
        explicit = config.explicit_tiers
        config._tiers = explicit if explicit is not None else lmcache_tiers(config)
        if given:
            _warn_unused_disk(config)
        return config

    @property
    def tiers(self) -> tuple[TierConfig, ...]:
        """The tiers in lookup order: a get searches them first to last."""
        return self._tiers

    @staticmethod
    def default_tiers() -> tuple[TierConfig, ...]:
        """The tiers of a configuration that sets none: ``cpu://``, 5 GiB, LRU eviction."""
        return default_tiers()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "in the config dict") -> Config:
        """Build from a mapping with the keys of a config file (no environment is read).

        ``source`` says where the mapping came from, for error messages.
        """
        from kvplug.runtime.config.sources import (  # sources builds on this
            MappingSource,
            build_config,
        )

        return build_config([MappingSource(data, source)])

    @classmethod
    def from_yaml(cls, source: str | os.PathLike[str]) -> Config:
        """Build from YAML text or a YAML file (no environment is read).

        A :class:`~pathlib.Path`, or a one-line string that ends in ``.yaml``/``.yml``/``.json``
        or names an existing file, is read as a file; any other string is YAML text.
        """
        from kvplug.runtime.config.sources import (  # sources builds on this
            build_config,
            yaml_source,
        )

        return build_config([yaml_source(source)])

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

    def __repr_args__(self) -> Iterable[tuple[str | None, Any]]:
        # Only what masks its secrets: the tiers print their URLs and options masked.
        yield "chunk_size", self.chunk_size
        yield "save_unfull_chunk", self.save_unfull_chunk
        yield "tiers", self.tiers

    def __str__(self) -> str:
        return repr(self)


def config_key(name: str, field: FieldInfo) -> str:
    """The key that sets the field ``name`` in a config file: its name, or the first of its
    validation aliases (``tiers`` for :attr:`Config.explicit_tiers`)."""
    alias = field.validation_alias
    if isinstance(alias, AliasChoices) and isinstance(alias.choices[0], str):
        return alias.choices[0]
    return name


_KEYS_AND_FIELDS = [(config_key(name, field), field) for name, field in Config.model_fields.items()]

#: The keys a config file may set: kvplug's, and LMCache's keys about storage.
CONFIG_KEYS: tuple[str, ...] = tuple(key for key, _ in _KEYS_AND_FIELDS)

#: Keys that only shape the tiers made from LMCache's keys; none may appear beside ``tiers``.
LMCACHE_TIER_KEYS: frozenset[str] = frozenset(
    key for key, field in _KEYS_AND_FIELDS if _LMCACHE_TIER in field.metadata
)

#: How each config key's value is read from a layer.
_COERCERS: dict[str, Converter] = {
    key: meta.convert
    for key, field in _KEYS_AND_FIELDS
    for meta in field.metadata
    if isinstance(meta, ConfigValue)
}


def _config_error(error: ValidationError, order: Sequence[str] = ()) -> ConfigError:
    """The ConfigError a validator raised (the first by the keys' ``order``, where given), or
    one that words pydantic's own complaint."""
    position = {key: index for index, key in enumerate(order)}

    def written_at(detail: ErrorDetails) -> int:
        loc = detail["loc"]
        return position.get(str(loc[0]), len(position)) if loc else len(position)

    details = sorted(error.errors(), key=written_at)
    for detail in details:
        cause = detail.get("ctx", {}).get("error")
        if isinstance(cause, ConfigError):
            return cause
    first = details[0]
    name = ".".join(str(part) for part in first["loc"]) or "..."
    return ConfigError(
        f"Config({name}={show(first['input'])}) is not accepted: {first['msg']}. Pass the "
        "fields of Config with normalised values (sizes in bytes), or build the config with "
        "load_config() or Config.from_dict()."
    )


def _sourced_keys(data: Any) -> dict[str, Sourced]:
    """The keys that layers set, with their raw values and sources; empty for a Config built
    from keyword arguments."""
    if not isinstance(data, dict):
        return {}
    return {key: value for key, value in data.items() if isinstance(value, Sourced)}


def _refuse_both_forms(given: Mapping[str, Sourced]) -> None:
    tiers = given.get("tiers")
    if tiers is None or tiers.value is None:
        return
    mixed = sorted(
        key for key in LMCACHE_TIER_KEYS if key in given and given[key].value is not None
    )
    if mixed:
        named = "; ".join(f"{key} {given[key].source}" for key in mixed)
        raise ConfigError(
            f"the config sets tiers {tiers.source} and also LMCache's tier keys ({named}). The "
            "two forms describe the same thing, so kvplug cannot tell which one you mean. "
            "Use one form: list every tier under tiers: (docs/config.md shows the tiers "
            "equivalent of each LMCache key), or remove tiers and keep the LMCache keys."
        )


def _warn_unused_disk(config: Config) -> None:
    if config.explicit_tiers is not None:
        return
    if config.local_disk is not None and config.max_local_disk_size == 0:
        warn(
            "local_disk is set but max_local_disk_size is 0, so there is no disk tier. Set "
            "max_local_disk_size (GiB) to use the disk."
        )
    elif config.local_disk is None and config.max_local_disk_size > 0:
        warn(
            "max_local_disk_size is set but local_disk is not, so there is no disk tier. Set "
            "local_disk to a directory to use the disk."
        )
