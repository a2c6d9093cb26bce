"""The kvplug error taxonomy.

Every error kvplug raises on purpose derives from :class:`KvplugError`. Messages state the fact,
the cause and the fix, so that an operator reading a log line knows what to change.

A *miss* is never an error: ``get`` returns ``None`` (contract clause 1).
"""

from __future__ import annotations


class KvplugError(Exception):
    """Base class of every error kvplug raises on purpose."""


class ConfigError(KvplugError, ValueError):
    """A configuration value is missing, unknown or invalid."""


class InvalidBackendURL(ConfigError):
    """A backend URL cannot be parsed or has a value its backend cannot use."""


class UnknownScheme(ConfigError):
    """No installed plugin serves the URL's scheme."""


class UnknownOption(ConfigError):
    """A backend was given an option it does not know."""


class PluginConflict(KvplugError):
    """Two installed plugins claim the same scheme."""


class PluginLoadError(KvplugError):
    """A plugin, or the factory behind one of its schemes, failed to import or build."""


class RefCountError(KvplugError):
    """A :class:`~kvplug.memory.MemoryObj` was released, unpinned or used once too often."""


class BackendError(KvplugError):
    """An operation on a backend failed."""


class BackendUnavailable(BackendError):
    """The store cannot be reached now. Retryable: the backend recovers by itself."""


class BackendTimeout(BackendUnavailable):
    """An operation did not finish within its deadline. Retryable."""


class CorruptObject(BackendError):
    """Stored bytes are torn, truncated or altered. Backends turn this into a counted miss."""


class CapacityExceeded(BackendError):
    """The store is full and nothing can be evicted to make room."""


class NotSupported(BackendError):
    """The backend does not declare the capability this operation needs."""


class BackendClosed(BackendError):
    """The backend was closed; open a new one."""


__all__ = [
    "BackendClosed",
    "BackendError",
    "BackendTimeout",
    "BackendUnavailable",
    "CapacityExceeded",
    "ConfigError",
    "CorruptObject",
    "InvalidBackendURL",
    "KvplugError",
    "NotSupported",
    "PluginConflict",
    "PluginLoadError",
    "RefCountError",
    "UnknownOption",
    "UnknownScheme",
]
