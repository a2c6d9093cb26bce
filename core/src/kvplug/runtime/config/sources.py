"""The layers a configuration is read from, as pydantic-settings sources, and
:func:`load_config`, which stacks them: defaults < YAML file < ``KVPLUG_*`` variables <
keyword arguments.

Each source reads its input when it is made, so that a bad file is reported before a bad
variable, and gives every config key it sets as a
:class:`~kvplug.runtime.config.conversions.Sourced`
value; :class:`~kvplug.runtime.config.model.Config` converts them, naming the key and the source in
any error. pydantic-settings lays the sources over each other: a higher layer's key replaces a
lower one's, except ``extra_config``, whose items are merged (each source gives it as a dict).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pydantic.fields import FieldInfo
from pydantic_settings import PydanticBaseSettingsSource

from kvplug.env import ENV_PREFIX, env_owner, installed_plugin_names, plugin_env_prefix
from kvplug.errors import ConfigError
from kvplug.runtime.config.conversions import Sourced, expand
from kvplug.runtime.config.lmcache import IGNORED_LMCACHE_KEYS, is_ignored_lmcache_key
from kvplug.runtime.config.messages import (
    ignored_keys_warning,
    unknown_env_message,
    unknown_keys_message,
    warn,
)
from kvplug.runtime.config.model import CONFIG_KEYS, Config, active_layers, config_key
from kvplug.runtime.config.yaml_file import (
    MAX_NESTING,
    looks_like_path,
    nesting_depth,
    parse_yaml,
    read_yaml_file,
    too_deep,
)

CONFIG_FILE_ENV = "KVPLUG_CONFIG_FILE"

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


def env_name(key: str) -> str:
    """``KVPLUG_<KEY>``: the variable that sets config key ``key``."""
    return ENV_PREFIX + key.upper()


_CORE_ENV_NAMES = frozenset(
    {env_name(key) for key in (*CONFIG_KEYS, *IGNORED_LMCACHE_KEYS)} | OTHER_ENV_VARS
)


def core_env_names() -> frozenset[str]:
    """Every ``KVPLUG_*`` variable that kvplug itself reads: ``KVPLUG_<KEY>`` for each config
    key and each LMCache key it accepts and ignores, and :data:`OTHER_ENV_VARS`. These stay
    kvplug's whatever plugins are installed; the rest of ``KVPLUG_<PLUGIN>_*`` is the plugin's
    (:mod:`kvplug.env`)."""
    return _CORE_ENV_NAMES


class LayerSource(PydanticBaseSettingsSource):
    """One layer of a configuration: the config keys it sets, each a
    :class:`~kvplug.runtime.config.conversions.Sourced` value, and the LMCache settings it names
    that kvplug ignores (:attr:`ignored`)."""

    def __init__(self) -> None:
        super().__init__(Config)
        self.values: dict[str, Any] = {}
        self.ignored: set[str] = set()

    def set(self, key: str, value: Any, source: str) -> None:
        """Set config key ``key`` to ``value``, as written ``source``."""
        if key == "extra_config" and isinstance(value, Mapping):
            self.values[key] = {name: Sourced(item, key, source) for name, item in value.items()}
        else:
            self.values[key] = Sourced(value, key, source)

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        """The value this layer sets for the field (None when it sets none), and its key."""
        key = config_key(field_name, field)
        return self.values.get(key), key, False

    def __call__(self) -> dict[str, Any]:
        return dict(self.values)


class MappingSource(LayerSource):
    """A mapping with the keys of a config file (``Config.from_dict``, a file's content, or
    the keyword arguments of :func:`load_config`); ``source`` says where it came from."""

    def __init__(self, data: Mapping[Any, Any], source: str) -> None:
        super().__init__()
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
            if key in CONFIG_KEYS:
                self.set(key, value, source)
            elif is_ignored_lmcache_key(key):
                self.ignored.add(key)
            else:
                unknown.append(key)
        if unknown:
            raise ConfigError(
                unknown_keys_message(unknown, source, CONFIG_KEYS, IGNORED_LMCACHE_KEYS)
            )


class YamlFileSource(MappingSource):
    """A YAML config file; ``named_by`` is the variable that named it, for errors."""

    def __init__(self, path: str | os.PathLike[str], named_by: str | None = None) -> None:
        file = expand(path)
        super().__init__(read_yaml_file(file, named_by), f"in {file}")


def yaml_source(text_or_path: str | os.PathLike[str]) -> MappingSource:
    """A layer from YAML text, or from a file when ``text_or_path`` is a path or looks like
    one (see :meth:`Config.from_yaml <kvplug.runtime.config.Config.from_yaml>`)."""
    if isinstance(text_or_path, str) and not looks_like_path(text_or_path):
        return MappingSource(parse_yaml(text_or_path, "the YAML text"), "in the YAML text")
    return YamlFileSource(text_or_path)


class EnvironmentSource(LayerSource):
    """The ``KVPLUG_<KEY>`` variables of ``environ``.

    ``KVPLUG_TIERS`` holds URLs separated by ``;`` or newlines, ``KVPLUG_EXTRA_CONFIG`` a JSON
    object. :data:`OTHER_ENV_VARS` and installed plugins' ``KVPLUG_<PLUGIN>_*`` are left alone;
    any other ``KVPLUG_*`` variable is an error with a did-you-mean.
    """

    def __init__(self, environ: Mapping[str, str]) -> None:
        super().__init__()
        plugin_names: list[str] | None = None
        for name in sorted(environ):
            if not name.startswith(ENV_PREFIX) or name in OTHER_ENV_VARS:
                continue
            raw = environ[name]
            key = name.removeprefix(ENV_PREFIX).lower()
            source = f"from environment variable {name}"
            if key == "tiers":
                urls = [part.strip() for part in re.split(r"[;\n]", raw) if part.strip()]
                self.set(key, urls or None, source)
            elif key == "extra_config":
                self.set(key, _json_object(name, raw), source)
            elif key in CONFIG_KEYS:
                self.set(key, raw, source)
            elif key in IGNORED_LMCACHE_KEYS:
                self.ignored.add(name)
            else:
                if plugin_names is None:
                    plugin_names = installed_plugin_names()
                if env_owner(name, plugin_names) is not None:
                    continue  # KVPLUG_<PLUGIN>_*: the plugin reads it (kvplug.env.plugin_env)
                if is_ignored_lmcache_key(key):
                    self.ignored.add(name)
                else:
                    raise ConfigError(
                        unknown_env_message(
                            name,
                            [env_name(key) for key in CONFIG_KEYS],
                            OTHER_ENV_VARS,
                            [plugin_env_prefix(plugin) for plugin in plugin_names],
                        )
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
    except RecursionError:
        raise too_deep(f"environment variable {name}") from None
    if nesting_depth(value) > MAX_NESTING:
        raise too_deep(f"environment variable {name}")
    if not isinstance(value, dict):
        raise ConfigError(
            f"environment variable {name} must be a JSON object, got {type(value).__name__}. "
            f"Set it to e.g. {name}='{{\"use_odirect\": true}}'."
        )
    return value


def build_config(layers: Sequence[LayerSource]) -> Config:
    """The Config of ``layers`` (lowest first) over the defaults, after one warning naming
    the LMCache settings they hold that kvplug ignores."""
    ignored: Iterable[str] = set().union(*(layer.ignored for layer in layers))
    if ignored:
        warn(ignored_keys_warning(ignored))
    token = active_layers.set(tuple(reversed(layers)))
    try:
        return Config()
    finally:
        active_layers.reset(token)


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
    layers: list[LayerSource] = []
    if path is not None:
        layers.append(YamlFileSource(path))
    elif environ.get(CONFIG_FILE_ENV):
        layers.append(YamlFileSource(environ[CONFIG_FILE_ENV], CONFIG_FILE_ENV))
    layers.append(EnvironmentSource(environ))
    layers.append(MappingSource(overrides, "passed to load_config()"))
    return build_config(layers)
