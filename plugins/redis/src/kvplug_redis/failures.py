"""The client library's errors as kvplug's: each one the error that tells the caller what to
do, with the fact, the cause and the fix in its message.

* refused credentials or ACL permissions: :class:`~kvplug.errors.BackendError`;
* a full server (``OOM``) or a value over its ``proto-max-bulk-len``:
  :class:`~kvplug.errors.CapacityExceeded` (reads keep working);
* a socket timeout: :class:`~kvplug.errors.BackendTimeout`;
* an unreachable, restarting, loading or failing-over server, no master named by the
  sentinels, a cluster that is down: :class:`~kvplug.errors.BackendUnavailable` (retryable);
* an exception of no library class raised inside the library (``AttributeError: 'NoneType'
  object has no attribute 'writelines'``): :class:`~kvplug.errors.BackendUnavailable` too. The
  library raises these when a connection is closed under an operation that is using it, which
  a failover, a resharding or a restart does (the cluster client and ``disconnect()`` close
  connections in use by other tasks); the library drops that connection, and the next
  operation opens a new one;
* any other error reply or library error: :class:`~kvplug.errors.BackendError`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvplug.backend import error_text
from kvplug.errors import BackendError, BackendTimeout, BackendUnavailable, CapacityExceeded
from kvplug_redis.client_library import ClientLibrary


@dataclass(frozen=True)
class NoMasterHint:
    """What the message for "no sentinel named a master" says to check."""

    service: str | None
    """The Sentinel service asked for."""
    tls: bool
    """Whether the backend speaks TLS to the sentinels."""
    tls_sentinel_scheme: str
    """The TLS Sentinel scheme to suggest (``rediss+sentinel://``)."""

    def message(self, where: str, error_name: str) -> str:
        """Why no sentinel named a server, without the library's message: that lists every
        sentinel client's repr and says nothing of the usual cause, TLS on one side only (the
        whole error stays the ``__cause__``)."""
        if self.tls:
            check = (
                "their TLS set-up: ssl_ca_certs must hold the CA of their certificates, and "
                "sentinels with tls-auth-clients need ssl_certfile and ssl_keyfile"
            )
        else:
            check = (
                "whether they listen on TLS only: then use "
                f"{self.tls_sentinel_scheme} with the ssl_* options"
            )
        return (
            f"{where} failed ({error_name}): no sentinel named a server of service "
            f"{self.service!r}. The sentinels are unreachable or failing over, do not "
            f"watch that service, or refuse this client; check {check}. Operations succeed "
            "again once a sentinel answers."
        )


def raised_inside(error: BaseException, package: str) -> bool:
    """Whether ``error`` was raised by the code of ``package`` (``"redis"``) or by code it
    called (asyncio's streams), rather than by kvplug's: of the frames its traceback passes,
    the innermost one of either belongs to ``package``."""
    inside = False
    frame = error.__traceback__
    while frame is not None:
        top = str(frame.tb_frame.f_globals.get("__name__", "")).partition(".")[0]
        if top == package:
            inside = True
        elif top.startswith("kvplug"):
            inside = False
        frame = frame.tb_next
    return inside


def translate(
    error: Exception,
    where: str,
    lib: ClientLibrary,
    *,
    env_prefix: str,
    no_master: NoMasterHint,
) -> Exception:
    """``error``, raised by ``lib`` during ``where`` (``put on redis://h:6379``), as the kvplug
    error that tells the caller what to do; an error of no known kind is returned as it is.
    ``env_prefix`` names the credential variables in hints."""
    errors = lib.exceptions
    text = error_text(error)
    reason = f"{type(error).__name__}: {text}"

    def classes(*names: str) -> tuple[type[Exception], ...]:
        return tuple(getattr(errors, name) for name in names if hasattr(errors, name))

    if isinstance(error, classes("AuthenticationError", "AuthorizationError", "NoPermissionError")):
        return BackendError(
            f"{where} was refused ({reason}). Check the user name and password (URL, "
            f"options or ${env_prefix}_USERNAME/${env_prefix}_PASSWORD) and the "
            "user's ACL permissions."
        )
    if isinstance(error, classes("OutOfMemoryError")) or (
        isinstance(error, errors.ResponseError) and str(error).startswith("OOM")
    ):
        return CapacityExceeded(
            f"{where} failed: the server is full ({text}). Raise its maxmemory, set an "
            "eviction policy such as allkeys-lru, or use a ttl; reads keep working."
        )
    if isinstance(error, errors.ResponseError) and "invalid bulk length" in str(error):
        return CapacityExceeded(
            f"{where} failed: the server refused a value longer than its "
            f"proto-max-bulk-len ({text}). Store smaller chunks, or raise proto-max-bulk-len "
            "on the server (CONFIG SET proto-max-bulk-len); set max_value_size to the "
            "server's limit so such values are refused before they are sent."
        )
    if isinstance(error, errors.TimeoutError):
        return BackendTimeout(
            f"{where} timed out ({reason}): the server is slow or unreachable. Check it, or "
            "raise the 'timeout' option."
        )
    if type(error).__name__ in ("MasterNotFoundError", "SlaveNotFoundError"):
        return BackendUnavailable(no_master.message(where, type(error).__name__))
    unavailable = (
        errors.ConnectionError,
        OSError,
        lib.cluster_exception,
        *classes("ReadOnlyError", "ClusterDownError", "TryAgainError", "BusyLoadingError"),
    )
    if isinstance(error, unavailable):
        return BackendUnavailable(
            f"{where} failed ({reason}): the server is unreachable, restarting, loading or "
            "failing over. Operations succeed again once it answers; check the server if "
            "this persists."
        )
    if isinstance(error, errors.ResponseError):
        return BackendError(f"{where} was rejected by the server: {text}.")
    if isinstance(error, lib.base_error):
        return BackendError(f"{where} failed in {lib.name} ({reason}).")
    if raised_inside(error, errors.__name__.partition(".")[0]):
        return BackendUnavailable(
            f"{where} failed inside {lib.name} ({reason}): a connection was closed under the "
            "operation, as a failover, a resharding or a server restart does. Operations "
            "succeed again on a new connection once the server answers; if this persists "
            f"while the server is healthy, report it with this message and the {lib.name} "
            "version."
        )
    return error


__all__ = ["NoMasterHint", "raised_inside", "translate"]
