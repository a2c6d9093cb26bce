"""Who reads which ``KVPLUG_*`` environment variable: kvplug itself, or one of its plugins.

The rule:

1. kvplug's own variables are the ``KVPLUG_<KEY>`` of each config key (``KVPLUG_CHUNK_SIZE``,
   ``KVPLUG_TIERS``, ``KVPLUG_GDS_PATH``, ...; see ``docs/config.md``) and the few that other
   parts of kvplug read (:data:`kvplug.runtime.config.OTHER_ENV_VARS`: ``KVPLUG_CONFIG_FILE``,
   ``KVPLUG_DISABLE_PLUGINS``, ``KVPLUG_DISABLE_PLUGIN_AUTOLOAD``, ``KVPLUG_HOST_BUFFER_SIZE``,
   ...). They are always kvplug's, whatever plugins are installed.
2. Every other ``KVPLUG_<PLUGIN>_<SETTING>`` belongs to the installed plugin whose entry-point
   name, upper-cased with ``-`` and ``.`` as ``_``, is ``<PLUGIN>`` (``KVPLUG_REDIS_*`` to the
   plugin ``redis``). kvplug's config loader leaves these alone; the plugin reads them with
   :func:`plugin_env`.
3. Any other ``KVPLUG_*`` variable is an error of the config loader, with a did-you-mean, so a
   typo never goes unnoticed.

So a plugin cannot have a setting that spells one of kvplug's names: the gds plugin has no
``KVPLUG_GDS_PATH`` (that is kvplug's ``gds_path``), and a plugin named ``disable`` would not
get ``KVPLUG_DISABLE_PLUGINS``.

Example::

    >>> from kvplug.env import plugin_env, plugin_env_prefix
    >>> plugin_env_prefix("acme-cloud")
    'KVPLUG_ACME_CLOUD_'
    >>> env = {"KVPLUG_ACME_REGION": "eu-west", "KVPLUG_ACME_MAX_RETRIES": "3", "PATH": "/bin"}
    >>> plugin_env("acme", env)
    {'max_retries': '3', 'region': 'eu-west'}
"""

from __future__ import annotations

import importlib.metadata
import os
import re
from collections.abc import Mapping

ENV_PREFIX = "KVPLUG_"
ENTRY_POINT_GROUP = "kvplug"

_NOT_IN_ENV_NAMES = re.compile(r"[^A-Za-z0-9]+")


def plugin_env_prefix(name: str) -> str:
    """``KVPLUG_<NAME>_``: the prefix of the variables that belong to the plugin ``name``.

    ``name`` is the plugin's entry-point name (``redis`` in ``redis = "kvplug_redis.plugin"``);
    it is upper-cased, and each run of characters other than letters and digits becomes ``_``.
    """
    word = _NOT_IN_ENV_NAMES.sub("_", name).strip("_").upper()
    if not word:
        raise ValueError(
            f"plugin name {name!r} has no letter or digit to name its environment variables "
            "after. Pass the plugin's entry-point name, e.g. plugin_env('redis')."
        )
    return f"{ENV_PREFIX}{word}_"


def plugin_env(name: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The settings of plugin ``name`` from its ``KVPLUG_<NAME>_*`` environment variables.

    Keys are the rest of each variable's name in lower case (``KVPLUG_REDIS_SOCKET_TIMEOUT=5``
    gives ``{"socket_timeout": "5"}``), ready to use as backend options; values are the raw
    strings. kvplug's own variables never appear here, even when they share the prefix (see the
    module's rule). ``environ`` replaces ``os.environ`` (tests pass a dict).

    Plugins read their settings with this and nothing else under ``KVPLUG_``: the config loader
    treats the variables of installed plugins as theirs and any other unknown ``KVPLUG_*`` as a
    typo.

    Example::

        >>> plugin_env("redis", {"KVPLUG_REDIS_SOCKET_TIMEOUT": "5", "KVPLUG_CHUNK_SIZE": "512"})
        {'socket_timeout': '5'}
    """
    prefix = plugin_env_prefix(name)
    source = os.environ if environ is None else environ
    mine = [variable for variable in source if variable.startswith(prefix)]
    if not mine:
        return {}
    names = [name, *installed_plugin_names()]
    return {
        variable[len(prefix) :].lower(): source[variable]
        for variable in sorted(mine)
        if (owner := env_owner(variable, names)) is not None and plugin_env_prefix(owner) == prefix
    }


def core_env_names() -> frozenset[str]:
    """Every ``KVPLUG_*`` variable that kvplug itself reads (rule 1 of this module)."""
    from kvplug.runtime.config import core_env_names as from_config

    return from_config()


def installed_plugin_names() -> list[str]:
    """The entry-point names of the installed kvplug plugins, found without importing any."""
    return sorted({entry_point.name for entry_point in _entry_points()})


def env_owner(variable: str, plugin_names: list[str] | None = None) -> str | None:
    """The plugin that ``variable`` belongs to (rule 2), or ``None`` for kvplug's own and
    unclaimed names. ``plugin_names`` defaults to :func:`installed_plugin_names`."""
    if not variable.startswith(ENV_PREFIX) or variable in core_env_names():
        return None
    names = installed_plugin_names() if plugin_names is None else plugin_names
    # The longest prefix wins, so plugins "acme" and "acme-cloud" each keep their own.
    for name in sorted(names, key=lambda n: len(plugin_env_prefix(n)), reverse=True):
        prefix = plugin_env_prefix(name)
        if variable.startswith(prefix) and len(variable) > len(prefix):
            return name
    return None


def _entry_points() -> importlib.metadata.EntryPoints:
    return importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)


__all__ = [
    "ENV_PREFIX",
    "core_env_names",
    "env_owner",
    "installed_plugin_names",
    "plugin_env",
    "plugin_env_prefix",
]
