"""``kvplug lm-server``'s extended mode (kvplug's client): one request at a time per
connection, each answered by the handler of its op in :data:`HANDLERS`.

Every request is checked against its op's :class:`OpShape` (whether it carries a key, meta
and a payload, and how large) before its handler runs; a request that breaks it is answered
BAD_REQUEST with the reason and ends the connection. The wire format is :mod:`kvplug_lm.wire`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

from kvplug.memory import DTYPES_BY_CODE
from kvplug_lm import wire
from kvplug_lm.memstore import EXTENDED, MemStore
from kvplug_lm.server_options import HARD_KEY_LIMIT
from kvplug_lm.server_reader import ClientConnection, CloseConnection

if TYPE_CHECKING:
    from kvplug_lm.server import LMServer

MAX_SMALL_PAYLOAD = 4 << 20
"""The largest EXISTS_MANY payload (a list of keys; about 70 000 LMCache keys)."""
MAX_AUTH_PAYLOAD = 1024
MAX_META = wire.META.size + wire.MAX_RANK * wire.DIM.size

_EXT_DTYPES = frozenset({0, *DTYPES_BY_CODE})
OP_NAMES = {op.value: op.name for op in wire.Op}


@dataclass(frozen=True)
class OpShape:
    """What a request of one op may carry."""

    keyed: bool = False
    meta: bool = False
    max_payload: int | None = 0
    """Most payload bytes; 0: none; None: any (the handler checks it)."""


class ExtendedRequest:
    """One extended request being answered: its header, key and meta, read; its payload, if
    any, still on the connection."""

    def __init__(
        self, server: LMServer, connection: ClientConnection, request: wire.ExtRequest
    ) -> None:
        self.server = server
        store = server.store
        assert store is not None
        self.store: MemStore = store
        self.connection = connection
        self.reader = connection.reader
        self.request = request
        self.name = OP_NAMES.get(request.op, str(request.op))
        self.key = b""
        self.meta = b""

    async def reply(
        self,
        status: wire.Status,
        meta: bytes = b"",
        payload: bytes | memoryview = b"",
        checksum: int | None = None,
    ) -> None:
        head = wire.pack_ext_reply(
            status,
            request_id=self.request.request_id,
            meta=meta,
            payload_len=len(payload),
            checksum=checksum,
        )
        # Counted before the send: a client that has its reply must find it in the metrics.
        self.server.requests["extended", self.name, status.name] += 1
        await self.server.send(self.connection, head, payload)

    async def refuse(self, kind: str, reason: str) -> NoReturn:
        """Answer BAD_REQUEST with ``reason``, count it as ``kind`` and end the connection."""
        self.server.protocol_error(kind, self.connection, reason)
        with contextlib.suppress(Exception):
            await self.reply(wire.Status.BAD_REQUEST, payload=reason.encode())
        raise CloseConnection

    async def check_shape(self, shape: OpShape) -> None:
        request, name = self.request, self.name
        if request.key_len > HARD_KEY_LIMIT:
            await self.refuse(
                "bad_key", f"key length {request.key_len} over {HARD_KEY_LIMIT} bytes"
            )
        if request.meta_len > MAX_META:
            await self.refuse("bad_meta", f"meta length {request.meta_len} over {MAX_META} bytes")
        if not shape.keyed and request.key_len:
            await self.refuse("bad_key", f"{name} carries a key")
        if not shape.meta and request.meta_len:
            await self.refuse("bad_meta", f"{name} carries meta")
        if shape.max_payload == 0 and request.payload_len:
            await self.refuse("bad_length", f"{name} carries a payload of {request.payload_len}")
        if shape.max_payload and request.payload_len > shape.max_payload:
            await self.refuse("bad_length", f"{name} payload of {request.payload_len} bytes")


Handler = Callable[[ExtendedRequest], Awaitable[None]]


async def serve_extended(server: LMServer, connection: ClientConnection) -> None:
    """Read one extended request from ``connection`` and answer it."""
    options = server.options
    reader = connection.reader
    header = await reader.read(wire.EXT_REQUEST.size, options.frame_timeout)
    exchange = ExtendedRequest(server, connection, wire.unpack_ext_request(header))
    request = exchange.request
    entry = HANDLERS.get(request.op)
    if entry is None:
        await exchange.refuse(
            "unknown_command", f"unknown extended op {request.op} (1 to {max(OP_NAMES)})"
        )
    shape, handler = entry
    await exchange.check_shape(shape)
    body = await reader.read(request.key_len + request.meta_len, options.frame_timeout)
    exchange.key, exchange.meta = body[: request.key_len], body[request.key_len :]

    if options.secret is not None and not connection.authenticated and request.op != wire.Op.AUTH:
        await reader.discard(request.payload_len)
        server.counters["auth_failures"] += 1
        await exchange.reply(wire.Status.AUTH_REQUIRED)
        return
    if shape.keyed:
        if request.key_len > options.max_key_bytes:
            await reader.discard(request.payload_len)
            server.protocol_error("too_large", connection, f"key of {request.key_len} bytes")
            await exchange.reply(wire.Status.TOO_LARGE, payload=b"key too long")
            return
        try:
            wire.check_key(exchange.key, options.max_key_bytes)
        except wire.WireError as error:
            await exchange.refuse("bad_key", str(error))
    await handler(exchange)


async def _put(exchange: ExtendedRequest) -> None:
    server, connection = exchange.server, exchange.connection
    try:
        parsed = wire.unpack_meta(exchange.meta)
    except wire.WireError as error:
        await exchange.refuse(error.kind, str(error))
    if parsed.dtype not in _EXT_DTYPES:
        await exchange.refuse("bad_dtype", f"unknown dtype code {parsed.dtype}")
    length = exchange.request.payload_len
    if length > server.object_limit:
        await exchange.reader.discard(length)
        server.protocol_error("too_large", connection, f"PUT of {length} bytes")
        await exchange.reply(wire.Status.TOO_LARGE, payload=b"object too large")
        return
    received = await server.receive(connection, exchange.key, EXTENDED, exchange.meta, length)
    if received is None:
        server.protocol_error("no_space", connection, f"PUT of {length} bytes")
        await exchange.reply(wire.Status.NO_SPACE)
        return
    entry, digest = received
    if exchange.request.flags & wire.FLAG_CHECKSUM and digest != exchange.request.checksum:
        entry.block.release()
        server.protocol_errors["bad_checksum"] += 1
        await exchange.reply(wire.Status.BAD_CHECKSUM)
        return
    exchange.store.commit(entry, digest)
    await exchange.reply(wire.Status.OK)


async def _get(exchange: ExtendedRequest) -> None:
    store = exchange.store
    found = store.lookup(exchange.key) or await store.load_spilled(exchange.key)
    if found is None:
        await exchange.reply(wire.Status.NOT_FOUND)
        return
    block = found.block.retain()
    try:
        await exchange.reply(wire.Status.OK, found.ext_meta(), found.payload, found.checksum)
    finally:
        block.release()


async def _exists(exchange: ExtendedRequest) -> None:
    store = exchange.store
    present = exchange.key in store or await store.spill_contains(exchange.key)
    await exchange.reply(wire.Status.OK if present else wire.Status.NOT_FOUND)


async def _delete(exchange: ExtendedRequest) -> None:
    removed = await exchange.store.delete(exchange.key)
    await exchange.reply(wire.Status.OK if removed else wire.Status.NOT_FOUND)


async def _exists_many(exchange: ExtendedRequest) -> None:
    store = exchange.store
    data = await exchange.reader.read_all(exchange.request.payload_len)
    try:
        keys = wire.unpack_keys(data, exchange.server.options.max_key_bytes)
    except wire.WireError as error:
        await exchange.refuse(error.kind, str(error))
    answer = bytearray(len(keys))
    for index, one in enumerate(keys):
        if one in store or await store.spill_contains(one):
            answer[index] = 1
    await exchange.reply(wire.Status.OK, payload=bytes(answer))


async def _list(exchange: ExtendedRequest) -> None:
    await exchange.reply(wire.Status.OK, payload=b"\n".join(exchange.store.keys()))


async def _ping(exchange: ExtendedRequest) -> None:
    await exchange.reply(wire.Status.OK)


async def _auth(exchange: ExtendedRequest) -> None:
    options, connection = exchange.server.options, exchange.connection
    proof = await exchange.reader.read(exchange.request.payload_len, options.frame_timeout)
    if options.secret is None or (
        connection.nonce is not None and wire.proof_matches(options.secret, connection.nonce, proof)
    ):
        connection.authenticated = True
        await exchange.reply(wire.Status.OK)
    else:
        exchange.server.counters["auth_failures"] += 1
        await exchange.reply(wire.Status.AUTH_FAILED)


HANDLERS: dict[int, tuple[OpShape, Handler]] = {
    wire.Op.PUT: (OpShape(keyed=True, meta=True, max_payload=None), _put),
    wire.Op.GET: (OpShape(keyed=True), _get),
    wire.Op.EXISTS: (OpShape(keyed=True), _exists),
    wire.Op.DELETE: (OpShape(keyed=True), _delete),
    wire.Op.EXISTS_MANY: (OpShape(max_payload=MAX_SMALL_PAYLOAD), _exists_many),
    wire.Op.LIST: (OpShape(), _list),
    wire.Op.PING: (OpShape(), _ping),
    wire.Op.AUTH: (OpShape(max_payload=MAX_AUTH_PAYLOAD), _auth),
}
"""Each extended op's shape and handler."""

__all__ = ["HANDLERS", "MAX_META", "MAX_SMALL_PAYLOAD", "OP_NAMES", "OpShape", "serve_extended"]
