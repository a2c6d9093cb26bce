"""The extended mode's replies, as the ``lm://`` client reads them: a reply's header and meta
checked against the request it answers, and a refusal (any status but OK and NOT_FOUND) turned
into the kvplug error that says what happened and what to do."""

from __future__ import annotations

from kvplug.errors import (
    BackendError,
    BackendUnavailable,
    CapacityExceeded,
    ConfigError,
    KvplugError,
    NotSupported,
)
from kvplug_lm import wire
from kvplug_lm.connection import Connection, ReplyError


async def read_reply(
    connection: Connection, request_id: int, address: str
) -> tuple[wire.ExtReply, bytearray]:
    """The next reply's header and meta, from the server at ``address``; its payload is still
    to be read."""
    try:
        header = wire.unpack_ext_reply(await connection.recv_exact(wire.EXT_REPLY.size))
    except wire.WireError as error:
        raise KvplugError(
            f"{address} sent a reply kvplug cannot parse ({error}); the connection was closed."
        ) from None
    if header.request_id != request_id:
        raise KvplugError(
            f"{address} answered request {header.request_id} where {request_id} "
            "was expected; the connection was closed."
        )
    meta = await connection.recv_exact(header.meta_len)
    return header, meta


async def refusal(
    connection: Connection, header: wire.ExtReply, what: str, address: str
) -> Exception:
    """What to raise for a reply that is neither OK nor NOT_FOUND (its payload is read):
    a :class:`ReplyError` keeps the connection, except after BAD_REQUEST (the server
    closes the connection after it)."""
    error = await reply_error(connection, header, what, address)
    return error if header.status == wire.Status.BAD_REQUEST else ReplyError(error)


async def reply_error(
    connection: Connection, header: wire.ExtReply, what: str, address: str
) -> Exception:
    """The error of a reply that is neither OK nor NOT_FOUND (its payload is read)."""
    reason = (await connection.recv_exact(header.payload_len)).decode("utf-8", "replace")
    status = header.status
    name = status_name(status)
    detail = f": {reason}" if reason else ""
    if status in (wire.Status.TOO_LARGE, wire.Status.NO_SPACE):
        return CapacityExceeded(
            f"{what} on {address} was refused ({name}{detail}); the server is "
            "full or the object exceeds its limit. Raise --max-memory or the object limit."
        )
    if status in (wire.Status.AUTH_REQUIRED, wire.Status.AUTH_FAILED):
        return ConfigError(
            f"{what} on {address} was refused ({name}); set 'secret' to the server's shared secret."
        )
    if status in (wire.Status.SHUTTING_DOWN, wire.Status.INTERNAL):
        return BackendUnavailable(
            f"{what} on {address} failed ({name}{detail}); the server is "
            "shutting down or failed. Retry once it is back."
        )
    if status == wire.Status.UNSUPPORTED:
        return NotSupported(f"{what}: {address} does not support it{detail}.")
    if status == wire.Status.BAD_CHECKSUM:
        return BackendError(
            f"{what} on {address} was refused: the payload arrived damaged (its "
            "checksum did not match), so nothing was stored. Retry; if it persists, check "
            "the network path and the client's memory."
        )
    return KvplugError(
        f"{what} on {address} failed ({name}{detail}). This is a bug in kvplug's "
        "client or server; report it with the server's log."
    )


async def simple_request(
    connection: Connection, op: wire.Op, key: bytes, what: str, address: str
) -> bool:
    """A request without payload in either direction: True for OK, False for NOT_FOUND."""
    request_id = await send_simple(connection, op, key)
    return await read_simple(connection, request_id, what, address)


async def send_simple(connection: Connection, op: wire.Op, key: bytes) -> int:
    """Send a request of ``op`` that carries ``key`` alone; returns its request id."""
    request_id = connection.next_request_id()
    await connection.send(wire.pack_ext_request(op, request_id=request_id, key=key))
    return request_id


async def read_simple(connection: Connection, request_id: int, what: str, address: str) -> bool:
    """The reply to a request without payload: True for OK, False for NOT_FOUND."""
    header, _ = await read_reply(connection, request_id, address)
    if header.status == wire.Status.OK:
        await connection.drain(header.payload_len)
        return True
    if header.status == wire.Status.NOT_FOUND:
        await connection.drain(header.payload_len)
        return False
    raise await refusal(connection, header, what, address)


def status_name(status: int) -> str:
    """The name of a reply's status, or its number when it has none."""
    try:
        return wire.Status(status).name
    except ValueError:
        return f"status {status}"


__all__ = [
    "read_reply",
    "read_simple",
    "refusal",
    "reply_error",
    "send_simple",
    "simple_request",
    "status_name",
]
