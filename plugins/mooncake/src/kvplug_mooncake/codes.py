"""Mooncake Store's return codes (its ``ErrorCode``, mooncake-store/include/types.h) and what
each means to kvplug. Every error kvplug raises for a code names the code and its meaning."""

from __future__ import annotations

from kvplug.errors import BackendError, BackendTimeout, BackendUnavailable, CapacityExceeded

OK = 0
NO_AVAILABLE_HANDLE = -200
INVALID_PARAMS = -600
REPLICA_IS_NOT_READY = -703
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706
TRANSFER_FAIL = -800
RPC_FAIL = -900
RPC_TIMEOUT = -901

NAMES = {
    -1: "INTERNAL_ERROR",
    -10: "BUFFER_OVERFLOW",
    -100: "SHARD_INDEX_OUT_OF_RANGE",
    -101: "SEGMENT_NOT_FOUND",
    -102: "SEGMENT_ALREADY_EXISTS",
    -103: "CLIENT_NOT_FOUND",
    -200: "NO_AVAILABLE_HANDLE",
    -300: "INVALID_VERSION",
    -400: "INVALID_KEY",
    -500: "WRITE_FAIL",
    -600: "INVALID_PARAMS",
    -601: "ILLEGAL_CLIENT",
    -700: "INVALID_WRITE",
    -701: "INVALID_READ",
    -702: "INVALID_REPLICA",
    -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    -708: "OBJECT_HAS_REPLICATION_TASK",
    -709: "OBJECT_NO_REPLICATION_TASK",
    -710: "REPLICA_NOT_FOUND",
    -711: "REPLICA_ALREADY_EXISTS",
    -712: "REPLICA_IS_GONE",
    -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL",
    -901: "RPC_TIMEOUT",
    -1000: "ETCD_OPERATION_ERROR",
    -1010: "UNAVAILABLE_IN_CURRENT_STATUS",
    -1011: "UNAVAILABLE_IN_CURRENT_MODE",
    -1401: "TASK_PENDING_LIMIT_EXCEEDED",
}

UNREACHABLE = frozenset({-101, -103, -900, -1000, -1010, -1011})
"""The master or the segment holding the data cannot be reached: the store is down or
recovering (the client reconnects and remounts by itself)."""
MISSES = frozenset({OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY, -710, -712})
"""The object is absent, still being written, or its replica went away: a read is a miss."""


def describe(code: int) -> str:
    """``-704 (OBJECT_NOT_FOUND)``."""
    return f"{code} ({NAMES.get(code, 'unknown code')})"


def error_for(code: int, operation: str, key: str, url: object) -> BackendError:
    """The kvplug error of a Mooncake call that returned ``code`` (negative)."""
    where = f"Mooncake {operation} of {key!r} on {url} returned {describe(code)}"
    if code == NO_AVAILABLE_HANDLE:
        return CapacityExceeded(
            f"{where}: no segment has room for the object. Mount more memory "
            "(global_segment_size on the clients that lend it) or lower the master's "
            "eviction_high_watermark_ratio so that it evicts sooner."
        )
    if code == INVALID_PARAMS and operation == "put":
        return CapacityExceeded(
            f"{where}: the object is larger than any segment can hold. Store smaller chunks "
            "or mount larger segments (global_segment_size)."
        )
    if code == RPC_TIMEOUT:
        return BackendTimeout(
            f"{where}: the master did not answer in time (it is paused, overloaded or cut "
            "off). Check mooncake_master."
        )
    if code in UNREACHABLE:
        return BackendUnavailable(
            f"{where}: the master or the segment holding the data is unreachable. Check that "
            "mooncake_master and the clients that lend memory are running; the client "
            "reconnects by itself once they are."
        )
    return BackendUnavailable(
        f"{where}. The store refused or failed the request; its client log (stderr) says more."
    )


__all__ = ["NAMES", "describe", "error_for"]
