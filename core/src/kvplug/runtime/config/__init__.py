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

The operator's reference is ``docs/config.md``. This package never imports a plugin: tier
options are checked by their backend when the tier is opened; URLs are checked here, at load
time. Its modules: :mod:`~kvplug.runtime.config.model` (:class:`Config`),
:mod:`~kvplug.runtime.config.tier`
(:class:`TierConfig`), :mod:`~kvplug.runtime.config.conversions` (how each key's value is read),
:mod:`~kvplug.runtime.config.sources` (the layers and :func:`load_config`),
:mod:`~kvplug.runtime.config.yaml_file`, :mod:`~kvplug.runtime.config.lmcache` (LMCache's keys) and
:mod:`~kvplug.runtime.config.messages`.
"""

from kvplug.env import ENV_PREFIX
from kvplug.runtime.config.conversions import CACHE_POLICIES
from kvplug.runtime.config.lmcache import IGNORED_LMCACHE_KEYS
from kvplug.runtime.config.messages import ConfigWarning
from kvplug.runtime.config.model import (
    CONFIG_KEYS,
    DEFAULT_CHUNK_SIZE,
    DEFAULT_CPU_SIZE,
    LMCACHE_TIER_KEYS,
    Config,
    default_tiers,
)
from kvplug.runtime.config.sources import (
    CONFIG_FILE_ENV,
    OTHER_ENV_VARS,
    core_env_names,
    load_config,
)
from kvplug.runtime.config.tier import TierConfig

__all__ = [
    "CACHE_POLICIES",
    "CONFIG_FILE_ENV",
    "CONFIG_KEYS",
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_CPU_SIZE",
    "ENV_PREFIX",
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
