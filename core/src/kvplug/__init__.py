"""kvplug: a pluggable storage-backend SDK for LLM KV-cache offloading.

Start with :func:`open_backend` (async) or :class:`SyncClient` (from threads), a
:class:`CacheKey` and a :class:`MemoryObj` from a :class:`FreeListAllocator`.

``import kvplug`` is light: it loads neither torch, numpy, pydantic nor prometheus_client.
Each name below is imported from its module on first use (PEP 562), so
``from kvplug import MemoryObj`` loads torch while ``from kvplug import hookimpl`` does not.

Example::

    >>> import kvplug
    >>> from kvplug import BackendSpec, hookimpl
    >>> "open_backend" in dir(kvplug)
    True
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from typing import TYPE_CHECKING, Any

from kvplug.secrets import install_log_filter

__version__ = importlib.metadata.version("kvplug")

# Installed before any kvplug logger can write, so that no password reaches a log.
install_log_filter()

# Every public name, by the module it comes from.
_EXPORTS: dict[str, str] = {
    "Backend": "kvplug.backend",
    "BackendOptions": "kvplug.backend",
    "BytesBackend": "kvplug.backend",
    "Capabilities": "kvplug.backend",
    "Config": "kvplug.runtime.config",
    "TierConfig": "kvplug.runtime.config",
    "load_config": "kvplug.runtime.config",
    "DamagedValues": "kvplug.damage",
    "BackendClosed": "kvplug.errors",
    "BackendError": "kvplug.errors",
    "BackendTimeout": "kvplug.errors",
    "BackendUnavailable": "kvplug.errors",
    "CapacityExceeded": "kvplug.errors",
    "ConfigError": "kvplug.errors",
    "CorruptObject": "kvplug.errors",
    "InvalidBackendURL": "kvplug.errors",
    "KvplugError": "kvplug.errors",
    "LayoutMismatch": "kvplug.errors",
    "NotSupported": "kvplug.errors",
    "PluginConflict": "kvplug.errors",
    "PluginLoadError": "kvplug.errors",
    "RefCountError": "kvplug.errors",
    "UnexpectedBackendError": "kvplug.errors",
    "UnknownOption": "kvplug.errors",
    "UnknownScheme": "kvplug.errors",
    "UnreadableObject": "kvplug.errors",
    "BackendSpec": "kvplug.hookspecs",
    "hookimpl": "kvplug.hookspecs",
    "CacheKey": "kvplug.keys",
    "chunk_hashes": "kvplug.keys",
    "chunk_keys": "kvplug.keys",
    "Allocator": "kvplug.memory",
    "AllocatorStats": "kvplug.memory",
    "FreeListAllocator": "kvplug.memory",
    "MemoryFormat": "kvplug.memory",
    "MemoryObj": "kvplug.memory",
    "shared_host_allocator": "kvplug.memory",
    "plugin_env": "kvplug.env",
    "available_schemes": "kvplug.registry",
    "create_backend": "kvplug.registry",
    "open_backend": "kvplug.registry",
    "plugins": "kvplug.registry",
    "register_backend": "kvplug.registry",
    "register_plugin": "kvplug.registry",
    "BackendURL": "kvplug.url",
}

if TYPE_CHECKING:
    from kvplug.backend import Backend, BackendOptions, BytesBackend, Capabilities
    from kvplug.damage import DamagedValues
    from kvplug.env import plugin_env
    from kvplug.errors import (
        BackendClosed,
        BackendError,
        BackendTimeout,
        BackendUnavailable,
        CapacityExceeded,
        ConfigError,
        CorruptObject,
        InvalidBackendURL,
        KvplugError,
        LayoutMismatch,
        NotSupported,
        PluginConflict,
        PluginLoadError,
        RefCountError,
        UnknownOption,
        UnknownScheme,
        UnreadableObject,
    )
    from kvplug.hookspecs import BackendSpec, hookimpl
    from kvplug.keys import CacheKey, chunk_hashes, chunk_keys
    from kvplug.memory import (
        Allocator,
        AllocatorStats,
        FreeListAllocator,
        MemoryFormat,
        MemoryObj,
        shared_host_allocator,
    )
    from kvplug.registry import (
        available_schemes,
        create_backend,
        open_backend,
        plugins,
        register_backend,
        register_plugin,
    )
    from kvplug.runtime.config import Config, TierConfig, load_config
    from kvplug.url import BackendURL


def __getattr__(name: str) -> Any:
    module_name = _EXPORTS.get(name)
    if module_name is not None:
        value = getattr(importlib.import_module(module_name), name)
        # A logger's filters do not reach its children: the loggers the module just made get
        # the secret filter too.
        install_log_filter()
        globals()[name] = value
        return value
    # A submodule not imported yet (kvplug.registry after a bare ``import kvplug``), as when
    # this package imported them all eagerly.
    if name.isidentifier() and not name.startswith("_"):
        submodule = f"{__name__}.{name}"
        if importlib.util.find_spec(submodule) is not None:
            module = importlib.import_module(submodule)
            install_log_filter()
            return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "Allocator",
    "AllocatorStats",
    "Backend",
    "BackendClosed",
    "BackendError",
    "BackendOptions",
    "BackendSpec",
    "BackendTimeout",
    "BackendURL",
    "BackendUnavailable",
    "BytesBackend",
    "CacheKey",
    "Capabilities",
    "CapacityExceeded",
    "Config",
    "ConfigError",
    "CorruptObject",
    "DamagedValues",
    "FreeListAllocator",
    "InvalidBackendURL",
    "KvplugError",
    "LayoutMismatch",
    "MemoryFormat",
    "MemoryObj",
    "NotSupported",
    "PluginConflict",
    "PluginLoadError",
    "RefCountError",
    "TierConfig",
    "UnexpectedBackendError",
    "UnknownOption",
    "UnknownScheme",
    "UnreadableObject",
    "__version__",
    "available_schemes",
    "chunk_hashes",
    "chunk_keys",
    "create_backend",
    "hookimpl",
    "load_config",
    "open_backend",
    "plugin_env",
    "plugins",
    "register_backend",
    "register_plugin",
    "shared_host_allocator",
]
