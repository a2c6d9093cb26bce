"""The kvplug error taxonomy.

Every error kvplug raises on purpose derives from :class:`KvplugError`. Messages state the fact,
the cause and the fix, so that an operator reading a log line knows what to change.

A *miss* is never an error: ``get`` returns ``None`` (contract clause 1).

The hierarchy::

    KvplugError
    ├── ConfigError (also a ValueError)
    │   ├── InvalidBackendURL
    │   ├── UnknownScheme
    │   └── UnknownOption
    ├── PluginConflict
    ├── PluginLoadError
    ├── RefCountError
    ├── LayoutMismatch               get_into's buffer is not the stored object's size
    └── BackendError                 an operation on a backend failed
        ├── BackendUnavailable       retryable: the store cannot be reached now
        │   └── BackendTimeout       retryable: the deadline passed
        ├── CorruptObject
        │   └── UnreadableObject     sound, but not readable with this reader's keys
        ├── CapacityExceeded
        ├── NotSupported
        ├── BackendClosed
        └── UnexpectedBackendError   a hook raised something that is not a kvplug error

Every operation of a :class:`~kvplug.backend.Backend` raises kvplug errors only: the template
turns an exception a backend's hook raises that is not a :class:`KvplugError` into one
(:meth:`~kvplug.backend.Backend.translate_error`), with the original chained as its
``__cause__``. Only ``asyncio.CancelledError``, ``KeyboardInterrupt``, ``SystemExit`` and
``MemoryError`` (the task's or the process's condition, not the backend's) pass as they are;
the ``TypeError``/``ValueError`` of a wrong argument is the caller's, raised before any hook.
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


class LayoutMismatch(KvplugError):
    """``get_into`` (or its batched form) found the key stored with another size than the
    caller's buffer: the engine's layout (model, dtype, chunk size, parallelism) is not the
    one the object was stored with. Not a miss, so an engine does not recompute silently, and
    not a failing store, so a tiered store does not take the tier out of service."""

    @classmethod
    def between(
        cls,
        key: object,
        stored: tuple[tuple[int, ...], object, int],
        wanted: tuple[tuple[int, ...], object, int],
    ) -> LayoutMismatch:
        """The error for ``key``, stored as ``(shape, dtype, nbytes)`` and asked for into a
        buffer of ``wanted`` (the same three)."""
        (shape, dtype, nbytes), (into_shape, into_dtype, into_nbytes) = stored, wanted
        return cls(
            f"{key} is stored as {list(shape)} {dtype} ({nbytes} bytes), but get_into's buffer "
            f"is {list(into_shape)} {into_dtype} ({into_nbytes} bytes): the layout it was "
            "stored with (model, dtype, chunk size or parallelism) is not the reader's. Read "
            "it with the layout that stored it, or remove the old entries (their keys name "
            "the model and the worker)."
        )


class BackendError(KvplugError):
    """An operation on a backend failed.

    ``stored``: for a ``batched_put`` that failed part-way, which of its keys were stored (a
    tuple aligned with the keys), where the backend knows; None when it does not, and then any
    of them may or may not be stored."""

    stored: tuple[bool, ...] | None = None


class BackendUnavailable(BackendError):
    """The store cannot be reached now. Retryable: the backend recovers by itself."""


class BackendTimeout(BackendUnavailable):
    """An operation did not finish within its deadline. Retryable."""


class CorruptObject(BackendError):
    """Stored bytes are torn, truncated or altered. Backends turn this into a counted miss."""


class UnreadableObject(CorruptObject):
    """A stored value that is sound but that this reader cannot decode: its serde is not
    installed or not configured here, or it was sealed with a cipher key this reader does not
    hold. Read as a counted miss like damage, but left in the store, for the readers that
    can read it (a writer with a newer key during a rotation)."""


class CapacityExceeded(BackendError):
    """The store is full and nothing can be evicted to make room."""


class NotSupported(BackendError):
    """The backend does not declare the capability this operation needs."""


class BackendClosed(BackendError):
    """The backend was closed; open a new one."""


class UnexpectedBackendError(BackendError):
    """A backend's hook raised an exception that is not a kvplug error (an ``AttributeError``,
    a ``KeyError``, a ``RuntimeError`` ...): a bug in the backend or in its client library, or
    a failure its plugin does not translate. The template raises this in its place, naming the
    operation, the backend and the original error, which is its ``__cause__``. Not known to be
    retryable; a plugin that knows a failure is transient raises
    :class:`BackendUnavailable` itself."""


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
    "LayoutMismatch",
    "NotSupported",
    "PluginConflict",
    "PluginLoadError",
    "RefCountError",
    "UnexpectedBackendError",
    "UnknownOption",
    "UnknownScheme",
    "UnreadableObject",
]
