"""kvplug: a pluggable storage-backend SDK for LLM KV-cache offloading.

Start with :func:`open_backend` (async) or :class:`SyncClient` (from threads), a
:class:`CacheKey` and a :class:`MemoryObj` from a :class:`FreeListAllocator`.
"""

from kvplug.backend import Backend, BackendOptions, BytesBackend, Capabilities
from kvplug.config import Config, TierConfig, load_config
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
    NotSupported,
    PluginConflict,
    PluginLoadError,
    RefCountError,
    UnknownOption,
    UnknownScheme,
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
)
from kvplug.secrets import install_log_filter
from kvplug.url import BackendURL

__version__ = "0.1.0"

install_log_filter()

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
    "FreeListAllocator",
    "InvalidBackendURL",
    "KvplugError",
    "MemoryFormat",
    "MemoryObj",
    "NotSupported",
    "PluginConflict",
    "PluginLoadError",
    "RefCountError",
    "TierConfig",
    "UnknownOption",
    "UnknownScheme",
    "__version__",
    "available_schemes",
    "chunk_hashes",
    "chunk_keys",
    "create_backend",
    "hookimpl",
    "load_config",
    "open_backend",
    "plugins",
    "register_backend",
    "shared_host_allocator",
]
