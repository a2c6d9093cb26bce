"""What a hook's exception becomes: the kvplug error the caller of a backend sees, with a
message that names the operation, its keys and the backend, and shows the original error with
its secrets masked.

:meth:`~kvplug.backend.Backend.translate_error` (which a backend may extend) calls
:func:`kvplug_error_for`; :func:`error_text` is the masked, bounded text of any error, for
plugins' own messages too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvplug.errors import (
    BackendError,
    BackendTimeout,
    BackendUnavailable,
    KvplugError,
    UnexpectedBackendError,
)
from kvplug.keys import CacheKey
from kvplug.secrets import mask_text

if TYPE_CHECKING:
    from kvplug.template import Backend


def error_text(error: BaseException, limit: int = 500) -> str:
    """The text of ``error`` as a message of kvplug's shows it: secrets masked
    (:func:`~kvplug.secrets.mask_text`) and cut to about ``limit`` characters, since a client
    library may put a whole command, value and all, into its error.

    Example::

        >>> text = error_text(ValueError("redis://app:s3cret@h:1 refused: " + "x" * 900))
        >>> text[:32], text[-12:], len(text)
        ('redis://app:***@h:1 refused: xxx', 'xxx... (cut)', 509)
    """
    text = str(error)
    if len(text) > 4 * limit:  # masking reads it all: the part shown, with room to spare
        text = text[: 4 * limit]
    text = mask_text(text)
    if len(text) > limit:
        text = f"{text[:limit]}... (cut)"
    return text


def of_keys(args: Sequence[object]) -> str:
    """`` of <key>`` (or of the first of several keys) for a message about an operation."""
    for arg in args:
        if isinstance(arg, CacheKey):
            return f" of {arg}"
        if isinstance(arg, Sequence) and arg and isinstance(arg[0], CacheKey):
            more = f" and {len(arg) - 1} more key(s)" if len(arg) > 1 else ""
            return f" of {arg[0]}{more}"
    return ""


def kvplug_error_for(
    backend: Backend, operation: str, error: Exception, args: Sequence[object] = ()
) -> Exception:
    """The kvplug error for ``error``, raised by a hook of ``backend``'s ``operation`` called
    with ``args``: see :meth:`~kvplug.backend.Backend.translate_error`."""
    if isinstance(error, (KvplugError, MemoryError)):
        return error
    where = f"{operation}{of_keys(args)} on {backend.url}"
    cause = f"{type(error).__name__}: {error_text(error)}"
    if isinstance(error, ConnectionError):
        return BackendUnavailable(
            f"{where} failed: the connection to the store broke ({cause}). Retryable: "
            "operations succeed again once the store answers; check it if this persists."
        )
    if isinstance(error, TimeoutError):
        return BackendTimeout(
            f"{where} timed out ({cause}): the store is slow or unreachable. Check it, or "
            "raise the 'timeout' option."
        )
    if isinstance(error, OSError):
        return BackendError(
            f"{where} failed: the system refused it ({cause}). Check the device, path, "
            "permissions or free space the backend uses."
        )
    owner = type(backend).__module__.partition(".")[0]
    return UnexpectedBackendError(
        f"{where} failed: {type(backend).__qualname__} raised {cause}, which is not a kvplug "
        "error: a bug in the backend or its client library, or a failure it does not "
        "translate (a connection closed under it during a failover, say); the original "
        f"error is this one's cause. Retry; if it persists, report it to the maintainers "
        f"of {owner} with this message."
    )


__all__ = ["error_text", "kvplug_error_for", "of_keys"]
