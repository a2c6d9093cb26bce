"""The ``lm://host:port`` backend: kvplug's client of LMCache's ``lm://`` server protocol.

It talks to ``kvplug lm-server`` and to LMCache 0.5.6's ``lmcache_server`` alike. Objects
travel as their raw bytes with LMCache's metadata (format, dtype code, shape) under LMCache
0.5.x's key string (:meth:`kvplug.CacheKey.to_string`), so kvplug and LMCache clients of one
server share its objects.

**Modes.** Every new connection opens with the hello (:data:`kvplug_lm.wire.HELLO_KEY`,
``mode=auto``). A kvplug server answers it, and the connection uses the *extended* mode:
acknowledged, checksummed puts, delete, listing, batched existence checks, pipelined batches,
keys up to the server's limit and optional authentication. LMCache's server answers an
ordinary HEALTH, and the connection uses the *plain* mode, LMCache's own protocol.

**Plain mode, and what kvplug does where LMCache's protocol is silent:**

* A PUT has no reply, so a put could return before the server stored the object (and a get
  on another connection of the pool would then miss). kvplug follows every PUT, on the same
  connection, with an EXIST of the same key, and returns only after its 200: the server
  handles one connection's requests in order, so the object is stored (read-your-writes
  across the pool). A 400 means the server dropped the object (a kvplug server does when it
  is full or the object is over its limit), and put raises
  :class:`~kvplug.errors.CapacityExceeded`.
* LMCache's server cannot delete or list: ``remove`` and ``list_keys`` raise
  :class:`~kvplug.errors.NotSupported` (the instance's capabilities say so once open).
* Keys longer than 150 bytes, shapes of more than four dims and dtypes without an LMCache
  code (int8 to int64) raise :class:`~kvplug.errors.NotSupported`; a kvplug server (the
  extended mode) stores them.
* Nothing is checksummed but what a serde other than ``naive`` framed (below): the damage of
  other values cannot be detected, and none can be deleted.
* A reply's dtype code 0 (LMCache's byte buffers) reads as uint8; shapes come back without
  their zero padding.

**Serdes.** With ``serde=naive`` (the default) objects travel as their own bytes, as above.
Any other serde (``?serde=zstd``) puts each object as a kvplug frame, the serde's payload
behind a header that names the serde and checksums it, described to the server as LMCache's
opaque bytes (format ``BINARY``, uint8, ``[frame_len]``; :mod:`kvplug_lm.framing`). Every
reader decodes such a value with the serde its frame names, whatever its own configuration: a
frame that does not verify is a counted miss, and deleted where the mode can delete; one of a
serde not installed here is a counted miss that stays stored. A reader with an authenticated
serde (``aesgcm``) serves only frames it sealed. LMCache's own engines cannot read frames: keep
``naive`` on a server they share.

**Keys.** The key on the wire is ``key_prefix`` and LMCache's key string, as it is. In the
extended mode a key the server's rules refuse (whitespace, control or invisible characters)
travels escaped (:func:`kvplug_lm.keys.encode_key`); LMCache clients never make such keys, so
every key they can share travels unchanged.

**TLS.** ``lms://host:port`` is the same protocol over TLS, to a kvplug lm-server started
with ``--tls-cert-file`` and ``--tls-key-file``; the ``ssl_*`` options are those of every TLS
scheme (:class:`kvplug.tls.TLSOptions`). LMCache's server has no TLS.

**Both modes:** when the allocator cannot hold an object a get read, its payload is drained
(the connection stays in step) and the get is a miss. Objects stored in a memory format
kvplug does not know (7 and 8, from newer LMCache) are misses too, with a warning.

Its modules, one job each: this one (the backend: modes, requests, hooks),
:mod:`kvplug_lm.client_options`, :mod:`kvplug_lm.keys` (keys on the wire),
:mod:`kvplug_lm.replies` (the extended mode's replies and refusals), :mod:`kvplug_lm.framing`
(values a serde transformed),
:mod:`kvplug_lm.pipelining` (pipelined batches) and :mod:`kvplug_lm.connection` (the pool).
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import xxhash

from kvplug.backend import Backend, Capabilities, fill_into
from kvplug.damage import DamagedValues
from kvplug.errors import (
    BackendUnavailable,
    CapacityExceeded,
    ConfigError,
    CorruptObject,
    InvalidBackendURL,
    KvplugError,
    LayoutMismatch,
    NotSupported,
)
from kvplug.keys import CacheKey
from kvplug.options import BackendOptions
from kvplug.tls import TLSFilesError, TLSOptions, client_context
from kvplug.url import BackendURL
from kvplug_lm import wire
from kvplug_lm.client_options import LMOptions
from kvplug_lm.connection import Connection, Hasher, Pool
from kvplug_lm.keys import ESCAPED_KEY_MARK, decode_key, encode_key, travels_plain
from kvplug_lm.pipelining import pipelined
from kvplug_lm.replies import read_reply, refusal, send_simple, simple_request, status_name
from kvplug_lm.server_options import DEFAULT_PORT

if TYPE_CHECKING:
    from kvplug.memory import Allocator, MemoryObj
    from kvplug.serde import Serde
    from kvplug_lm.framing import Outgoing

logger = logging.getLogger(__name__)

HEALTH_KEY = "kvplug-health@1@0@0@half"
"""The key of a plain HEALTH (not the hello's: a kvplug server answers that one with more)."""


CHECKSUM_FAILED = "its payload does not match the checksum it was stored with"
Damage = str | CorruptObject
"""Why a value read is damaged: :data:`CHECKSUM_FAILED`, or what its frame failed."""

# releases_on_cancel in both modes: every byte moves on the event loop (sock_sendall,
# sock_recv_into), whose socket futures stop at once when cancelled, and a request cut short
# closes its connection before the cancellation ends (connection.Pool.lease).
_EXTENDED_CAPABILITIES = Capabilities(
    remove=True,
    list_keys=True,
    native_batching=True,
    shared_across_processes=True,
    releases_on_cancel=True,
)
_PLAIN_CAPABILITIES = Capabilities(shared_across_processes=True, releases_on_cancel=True)


class LMBackend(Backend):
    """``lm://host:port``: objects on a ``kvplug lm-server`` or LMCache 0.5.6
    ``lmcache_server`` (see the module for the modes and :class:`LMOptions`).

    The capabilities are the extended mode's until :meth:`open` finds a plain server; then
    they are the plain mode's (no remove, list or native batching)."""

    Options: ClassVar[type[BackendOptions]] = LMOptions
    # The clause the contract suite cannot run here, and why (its verdict says "waived").
    contract_waivers: ClassVar[dict[int, str]] = {
        6: "values live in the server's memory, out of the suite's reach, and the server "
        "refuses a damaged put; kvplug-lm's own tests damage replies in flight"
    }
    options: LMOptions
    capabilities = _EXTENDED_CAPABILITIES
    loop_bound: ClassVar[bool] = True

    def __init__(
        self, url: BackendURL | str, *, allocator: Allocator | None = None, **options: Any
    ) -> None:
        super().__init__(url, allocator=allocator, **options)
        from kvplug.serde import open_serde
        from kvplug_lm.framing import writes_frames

        self.serde: Serde = open_serde(self.options.serde, self.options.serde_options)
        """What a put turns objects into (``naive``: their own bytes; else a frame)."""
        self._writes_frames = writes_frames(self.serde)
        host = self.url.host or "127.0.0.1"
        port = self.url.port or DEFAULT_PORT
        self.damaged_values = self._damage_ledger(self.options.mode)
        """Damaged values read (checksum or frame): misses, counted, logged, deleted."""
        self.mode: Literal["plain", "extended"] | None = (
            None if self.options.mode == "auto" else self.options.mode
        )
        self.hello: wire.Hello | None = None
        self._max_key_bytes = wire.PLAIN_KEY_BYTES
        self._pool = Pool(
            host,
            port,
            size=self.options.connections,
            connect_timeout=self.options.connect_timeout,
            initial_delay=self.options.reconnect_delay,
            max_delay=max(self.options.reconnect_delay, self.options.reconnect_max_delay),
            handshake=self._handshake,
            tls=self._tls_context(),
        )

    def _damage_ledger(self, mode: str) -> DamagedValues[bytes]:
        if mode == "plain":  # LMCache's protocol cannot delete: damage is counted only
            return DamagedValues[bytes](self.url)
        return DamagedValues[bytes](self.url, remove=lambda key: self._pool.run(self._deleter(key)))

    def _tls_context(self) -> ssl.SSLContext | None:
        """``lms://``: the context of the ``ssl_*`` options; ``lm://``: None, and an ``ssl_*``
        option given there is refused (it would be ignored)."""
        if self.url.scheme == "lms":
            try:
                return client_context(self.options)
            except TLSFilesError as error:
                raise InvalidBackendURL(f"{self.url}: {error}") from None
        given = sorted(self.options.model_fields_set & set(TLSOptions.model_fields))
        if given:
            raise InvalidBackendURL(
                f"{self.url}: {', '.join(given)} apply to TLS connections only, which lm:// "
                "does not make. Use lms:// (a kvplug lm-server started with --tls-cert-file "
                "and --tls-key-file), or drop the option."
            )
        return None

    @property
    def address(self) -> str:
        """The server's ``host:port``."""
        return f"{self._pool.host}:{self._pool.port}"

    def describe(self) -> dict[str, str]:
        if self.mode == "extended":
            server = f"kvplug lm-server (protocol {wire.PROTOCOL_VERSION})"
            if self.hello is not None:
                server += (
                    f", keys up to {self.hello.max_key_bytes} bytes, objects up to "
                    f"{self.hello.max_object_bytes} bytes"
                    + (", authenticated" if self.hello.auth_required else "")
                )
        elif self.options.mode == "plain":
            server = "plain protocol forced (mode=plain); LMCache's lmcache_server or kvplug's"
        else:
            server = "LMCache lmcache_server (plain protocol)"
        return {"mode": self.mode or "unknown", "server": server}

    # -- connections ------------------------------------------------------------------------

    async def _handshake(self, connection: Connection) -> None:
        if self.options.mode == "plain":
            return
        await connection.send(wire.pack_plain_request(wire.Command.HEALTH, wire.HELLO_KEY))
        reply = wire.unpack_plain_reply(await connection.recv_exact(wire.PLAIN_REPLY.size))
        if not wire.is_kvplug_hello(reply):
            self._found_mode("plain")
            return
        hello = wire.unpack_hello_body(await connection.recv_exact(wire.HELLO_BODY.size))
        self._found_mode("extended")
        self.hello = hello
        self._max_key_bytes = hello.max_key_bytes
        if hello.auth_required:
            if not self.options.secret:
                raise ConfigError(
                    f"the kvplug lm-server at {self._pool.address} requires authentication; set "
                    "the 'secret' option (lm://host:port?secret=...) to its shared secret."
                )
            proof = wire.auth_proof(self.options.secret, hello.nonce)
            request_id = connection.next_request_id()
            await connection.send(
                wire.pack_ext_request(wire.Op.AUTH, request_id=request_id, payload_len=len(proof)),
                proof,
            )
            header, _ = await read_reply(connection, request_id, self._pool.address)
            if header.status != wire.Status.OK:
                raise ConfigError(
                    f"the kvplug lm-server at {self._pool.address} refused the secret "
                    f"({status_name(header.status)}); set 'secret' to the server's shared "
                    "secret."
                )

    def _found_mode(self, found: Literal["plain", "extended"]) -> None:
        if found == "plain":
            if self.options.mode == "extended":
                raise ConfigError(
                    f"{self._pool.address} is not a kvplug lm-server (it answered the hello as "
                    "LMCache's lmcache_server does), but mode=extended requires one. Use "
                    "mode=auto or mode=plain, or point the URL at a kvplug lm-server."
                )
            if self.options.secret:
                raise ConfigError(
                    f"{self._pool.address} speaks LMCache's plain protocol, which has no "
                    "authentication, but the 'secret' option is set. Point the URL at a "
                    "kvplug lm-server that requires the secret, or drop the option."
                )
        if self.mode is None:
            self.mode = found
            self.capabilities = (
                _EXTENDED_CAPABILITIES if found == "extended" else _PLAIN_CAPABILITIES
            )
            self.damaged_values = self._damage_ledger(found)
        elif self.mode != found:
            raise BackendUnavailable(
                f"the server at {self._pool.address} changed kind: it was opened in the "
                f"{self.mode} mode and now answers as a {found}-mode server. Reopen the backend."
            )

    async def _open(self) -> None:
        if self.options.mode == "plain":
            self.capabilities = _PLAIN_CAPABILITIES
        await self._pool.run(self._ping)

    async def _ping(self, connection: Connection) -> None:
        if self.mode != "plain":
            return  # the handshake of a new connection was the round trip
        await connection.send(wire.pack_plain_request(wire.Command.HEALTH, HEALTH_KEY))
        reply = wire.unpack_plain_reply(await connection.recv_exact(wire.PLAIN_REPLY.size))
        if reply.code != wire.Code.SUCCESS:
            raise BackendUnavailable(
                f"{self._pool.address} answered HEALTH with {reply.code}; check the server."
            )

    async def _close(self) -> None:
        self._pool.close()

    # -- keys and metadata ------------------------------------------------------------------

    def wire_key(self, key: CacheKey) -> bytes:
        """The key string on the wire: ``key_prefix`` and LMCache's string form, as it is
        when the server can take it (so LMCache clients share the object), else (extended
        mode) :func:`encode_key`'s escaped form."""
        text = self.options.key_prefix + key.to_string()
        raw = text.encode()
        if self.mode == "plain":
            if not travels_plain(raw):
                raise NotSupported(
                    f"key {key} cannot travel in LMCache's plain protocol: it is {len(raw)} "
                    f"bytes (at most {wire.PLAIN_KEY_BYTES}) or holds whitespace or control "
                    "characters. Use a kvplug lm-server (the extended mode carries any key), "
                    "or a shorter model name or key_prefix."
                )
            return raw
        raw = encode_key(text)
        if len(raw) > self._max_key_bytes:
            raise NotSupported(
                f"key {key} is {len(raw)} bytes on the wire; the server at {self._pool.address} "
                f"accepts at most {self._max_key_bytes}. Shorten the model name or key_prefix, "
                "or raise the server's --max-key-bytes."
            )
        return raw

    def _outgoing(self, key: CacheKey, obj: MemoryObj) -> Outgoing:
        """What a put of ``obj`` sends: its bytes, or its frame with a serde other than naive."""
        from kvplug_lm.framing import outgoing

        return outgoing(obj, self.serde, key)

    def _plain_meta(self, value: Outgoing) -> tuple[int, tuple[int, int, int, int]]:
        from kvplug.memory import DTYPE_CODES

        code = DTYPE_CODES.get(value.dtype)
        if code is None or code not in range(2, 9):
            raise NotSupported(
                f"dtype {value.dtype} has no LMCache wire code, so LMCache's plain protocol "
                "cannot carry it. Use a kvplug lm-server (the extended mode stores it) or "
                "convert the tensor to float16, bfloat16, float32, float64, uint8 or float8."
            )
        if len(value.shape) > 4:
            raise NotSupported(
                f"shape {value.shape} has {len(value.shape)} dims; LMCache's plain protocol "
                "carries at most 4. Use a kvplug lm-server (the extended mode stores any rank) "
                "or reshape the object."
            )
        if value.nbytes > wire.INT32_MAX:
            raise NotSupported(
                f"a value of {value.nbytes} bytes does not fit LMCache's plain header (at most "
                f"{wire.INT32_MAX} bytes). Use a kvplug lm-server or smaller chunks."
            )
        return code, wire.pad_shape(value.shape)

    def _allocate(
        self, shape: Sequence[int], dtype_code: int, fmt: int, length: int
    ) -> MemoryObj | str:
        """An object for a reply's payload, or a reason string why it cannot be read."""
        import torch

        from kvplug.memory import DTYPES_BY_CODE, MemoryFormat, nbytes_of

        dtype = torch.uint8 if dtype_code == 0 else DTYPES_BY_CODE.get(dtype_code)
        if dtype is None:
            return f"unknown dtype code {dtype_code}"
        try:
            memory_format = MemoryFormat(fmt)
        except ValueError:
            return f"memory format {fmt}, which kvplug does not know"
        if nbytes_of(shape, dtype) != length:
            return f"a payload of {length} bytes that does not match shape {tuple(shape)} {dtype}"
        obj = self.allocator.allocate(shape, dtype, memory_format)
        if obj is None:
            return "no room in the allocator"
        return obj

    # -- plain mode -------------------------------------------------------------------------

    async def _plain_put(self, connection: Connection, key: bytes, value: Outgoing) -> None:
        code, shape = self._plain_meta(value)
        header = wire.pack_plain_request(
            wire.Command.PUT, key, length=value.nbytes, fmt=int(value.fmt), dtype=code, shape=shape
        )
        check = wire.pack_plain_request(wire.Command.EXIST, key)
        await connection.send(header, *value.parts, check)
        reply = wire.unpack_plain_reply(await connection.recv_exact(wire.PLAIN_REPLY.size))
        if reply.code != wire.Code.SUCCESS:
            raise CapacityExceeded(
                f"{self._pool.address} did not keep {key.decode()}: EXIST right after its PUT "
                f"answered {reply.code}, so the server dropped the value of {value.nbytes} "
                "bytes (a kvplug lm-server does so when it is full or the object exceeds its "
                "limit). Raise the server's --max-memory, or check its log."
            )

    async def _plain_get(
        self, connection: Connection, key: bytes, cache_key: CacheKey, dest: MemoryObj | None
    ) -> tuple[MemoryObj | None, Damage | None]:
        """The object of a GET (or ``dest`` filled), or None and why the value is damaged."""
        await connection.send(wire.pack_plain_request(wire.Command.GET, key))
        reply = wire.unpack_plain_reply(await connection.recv_exact(wire.PLAIN_REPLY.size))
        if reply.code != wire.Code.SUCCESS:
            await connection.drain(max(reply.length, 0))
            return None, None
        shape = wire.strip_shape(reply.shape)
        try:
            got = await self._receive(
                connection, key, cache_key, reply.length, shape, reply.dtype, reply.fmt, dest
            )
        except CorruptObject as damage:
            return None, damage
        return got, None

    async def _plain_read(self, key: CacheKey, dest: MemoryObj | None) -> MemoryObj | None:
        name = self.wire_key(key)
        got, damage = await self._pool.run(lambda c: self._plain_get(c, name, key, dest))
        if damage is not None:
            await self.damaged_values.drop({name: damage})
        return got

    async def _receive(
        self,
        connection: Connection,
        key: bytes,
        cache_key: CacheKey,
        length: int,
        shape: Sequence[int],
        dtype_code: int,
        fmt: int,
        dest: MemoryObj | None,
        hasher: Hasher | None = None,
    ) -> MemoryObj | None:
        """Read a payload of ``length`` bytes into ``dest`` or a new object, feeding
        ``hasher`` as it arrives; drain it and return None when no new object can take it.
        A ``dest`` of another size drains it and raises
        :class:`~kvplug.errors.LayoutMismatch`. A ``BINARY`` payload that is a kvplug frame
        is decoded (:mod:`kvplug_lm.framing`), and so is every payload for an authenticated
        serde, which serves only what it sealed; one that does not verify raises
        :class:`~kvplug.errors.CorruptObject`, the stream in step."""
        from kvplug_lm.framing import FRAMED_FORMAT, receive_rest

        prefix = bytearray()
        if fmt == FRAMED_FORMAT or self.serde.authenticated:
            from kvplug.frame import FrameReceiver
            from kvplug_lm.framing import finish_frame, receive_frame

            receiver = FrameReceiver(self.allocator, dest, serde=self.serde, key=cache_key)
            read = await receive_frame(
                connection, length, receiver, hasher, frames_only=self._writes_frames
            )
            if read is None:
                return finish_frame(receiver, dest, key.decode(errors="replace"))
            prefix = read
        if dest is not None:
            if dest.nbytes != length:
                await connection.drain(length - len(prefix))
                import torch

                from kvplug.memory import DTYPES_BY_CODE

                stored = torch.uint8 if dtype_code == 0 else DTYPES_BY_CODE.get(dtype_code)
                raise LayoutMismatch.between(
                    key.decode(errors="replace"),
                    (tuple(shape), stored, length),
                    (dest.shape, dest.dtype, dest.nbytes),
                )
            await receive_rest(connection, dest.memoryview(), prefix, hasher)
            return dest
        target = self._allocate(shape, dtype_code, fmt, length)
        if isinstance(target, str):
            logger.warning("get of %s from %s is a miss: %s", key.decode(), self.url, target)
            await connection.drain(length - len(prefix))
            return None
        try:
            await receive_rest(connection, target.memoryview(), prefix, hasher)
        except BaseException:
            target.release()
            raise
        return target

    async def _plain_contains(self, connection: Connection, key: bytes) -> bool:
        await connection.send(wire.pack_plain_request(wire.Command.EXIST, key))
        reply = wire.unpack_plain_reply(await connection.recv_exact(wire.PLAIN_REPLY.size))
        return reply.code == wire.Code.SUCCESS

    # -- extended mode ----------------------------------------------------------------------

    async def _send_put(self, connection: Connection, key: bytes, value: Outgoing) -> int:
        from kvplug.memory import DTYPE_CODES

        code = DTYPE_CODES.get(value.dtype)
        if code is None or len(value.shape) > wire.MAX_RANK:
            raise NotSupported(
                f"an object of {value.dtype} and shape {value.shape} cannot travel: the extended "
                f"mode carries kvplug's dtypes ({', '.join(map(str, DTYPE_CODES))}) and at "
                f"most {wire.MAX_RANK} dims. Convert or reshape the object."
            )
        if self.hello is not None and value.nbytes > self.hello.max_object_bytes:
            raise CapacityExceeded(
                f"a value of {value.nbytes} bytes exceeds the largest the server at "
                f"{self._pool.address} accepts ({self.hello.max_object_bytes} bytes). Raise its "
                "--max-object-bytes or --max-memory, or store smaller chunks."
            )
        meta = wire.pack_meta(wire.Meta(int(value.fmt), code, value.shape))
        request_id = connection.next_request_id()
        header = wire.pack_ext_request(
            wire.Op.PUT,
            request_id=request_id,
            key=key,
            meta=meta,
            payload_len=value.nbytes,
            checksum=value.checksum() if self.options.checksums else None,
        )
        await connection.send(header, *value.parts)
        return request_id

    async def _read_put(self, connection: Connection, request_id: int, key: bytes) -> None:
        header, _ = await read_reply(connection, request_id, self._pool.address)
        if header.status != wire.Status.OK:
            raise await refusal(connection, header, f"put of {key.decode()}", self._pool.address)
        await connection.drain(header.payload_len)

    async def _read_get(
        self,
        connection: Connection,
        request_id: int,
        key: bytes,
        cache_key: CacheKey,
        dest: MemoryObj | None,
    ) -> tuple[MemoryObj | None, Damage | None]:
        """The object of a GET reply (or ``dest`` filled), or None and why it is damaged."""
        header, raw_meta = await read_reply(connection, request_id, self._pool.address)
        if header.status == wire.Status.NOT_FOUND:
            await connection.drain(header.payload_len)
            return None, None
        if header.status != wire.Status.OK:
            raise await refusal(connection, header, f"get of {key.decode()}", self._pool.address)
        try:
            meta = wire.unpack_meta(raw_meta)
        except wire.WireError as error:
            logger.warning("get of %s from %s is a miss: %s", key.decode(), self.url, error)
            await connection.drain(header.payload_len)
            return None, None
        verify = self.options.checksums and header.flags & wire.FLAG_CHECKSUM
        hasher = xxhash.xxh3_64() if verify else None
        try:
            got = await self._receive(
                connection,
                key,
                cache_key,
                header.payload_len,
                meta.shape,
                meta.dtype,
                meta.fmt,
                dest,
                hasher,
            )
        except CorruptObject as damage:
            return None, damage
        if got is None or hasher is None or hasher.intdigest() == header.checksum:
            return got, None
        if got is not dest:
            got.release()
        return None, CHECKSUM_FAILED

    @property
    def corrupt_objects(self) -> int:
        """:class:`~kvplug.backend.CountsCorruptObjects`: damaged payloads read as misses."""
        return self.damaged_values.count

    def _deleter(self, key: bytes) -> Callable[[Connection], Awaitable[bool]]:
        def delete(connection: Connection) -> Awaitable[bool]:
            return simple_request(
                connection, wire.Op.DELETE, key, f"delete of {key.decode()}", self._pool.address
            )

        return delete

    async def _ext_get(self, key: CacheKey, dest: MemoryObj | None) -> MemoryObj | None:
        name = self.wire_key(key)

        async def request(connection: Connection) -> tuple[MemoryObj | None, Damage | None]:
            request_id = await send_simple(connection, wire.Op.GET, name)
            return await self._read_get(connection, request_id, name, key, dest)

        got, damage = await self._pool.run(request)
        if damage is not None:
            await self.damaged_values.drop({name: damage})
        return got

    # -- hooks ------------------------------------------------------------------------------

    def _is_plain(self) -> bool:
        return self.mode == "plain"

    async def _get(self, key: CacheKey) -> MemoryObj | None:
        if self._is_plain():
            return await self._plain_read(key, None)
        return await self._ext_get(key, None)

    async def _get_into(self, key: CacheKey, dest: MemoryObj) -> bool:
        if dest.device.type != "cpu":
            return fill_into([await self._get(key)], [dest], [key])[0]
        if self._is_plain():
            return await self._plain_read(key, dest) is not None
        return await self._ext_get(key, dest) is not None

    async def _put(self, key: CacheKey, obj: MemoryObj) -> None:
        name = self.wire_key(key)
        value = self._outgoing(key, obj)
        if self._is_plain():
            await self._pool.run(lambda c: self._plain_put(c, name, value))
            return

        async def request(connection: Connection) -> None:
            await self._read_put(connection, await self._send_put(connection, name, value), name)

        await self._pool.run(request)

    async def _contains(self, key: CacheKey) -> bool:
        name = self.wire_key(key)
        if self._is_plain():
            return await self._pool.run(lambda c: self._plain_contains(c, name))
        return await self._pool.run(
            lambda c: simple_request(
                c, wire.Op.EXISTS, name, f"contains of {key}", self._pool.address
            )
        )

    async def _remove(self, key: CacheKey) -> bool:
        name = self.wire_key(key)
        return await self._pool.run(
            lambda c: simple_request(
                c, wire.Op.DELETE, name, f"remove of {key}", self._pool.address
            )
        )

    async def _batched_exists(self, keys: Sequence[CacheKey]) -> list[bool]:
        if self._is_plain():
            return await super()._batched_exists(keys)
        names = [self.wire_key(key) for key in keys]
        payload = wire.pack_keys(names)

        async def request(connection: Connection) -> list[bool]:
            request_id = connection.next_request_id()
            await connection.send(
                wire.pack_ext_request(
                    wire.Op.EXISTS_MANY, request_id=request_id, payload_len=len(payload)
                ),
                payload,
            )
            header, _ = await read_reply(connection, request_id, self._pool.address)
            if header.status != wire.Status.OK:
                raise await refusal(connection, header, "batched_exists", self._pool.address)
            found = await connection.recv_exact(header.payload_len)
            if len(found) != len(names):
                raise KvplugError(
                    f"{self._pool.address} answered EXISTS_MANY of {len(names)} keys with "
                    f"{len(found)} flags; the connection was closed."
                )
            return [bool(flag) for flag in found]

        return await self._pool.run(request)

    async def _ext_batched_read(
        self, keys: Sequence[CacheKey], dests: Sequence[MemoryObj | None]
    ) -> list[MemoryObj | None]:
        names = [self.wire_key(key) for key in keys]
        damaged: dict[bytes, Damage] = {}

        async def send(connection: Connection, index: int) -> int:
            return await send_simple(connection, wire.Op.GET, names[index])

        async def read(connection: Connection, request_id: int, index: int) -> MemoryObj | None:
            got, damage = await self._read_get(
                connection, request_id, names[index], keys[index], dests[index]
            )
            if damage is not None:
                damaged[names[index]] = damage
            return got

        results = await pipelined(self._pool, names, send, read, dests)
        await self.damaged_values.drop(damaged)
        return results

    async def _batched_get(self, keys: Sequence[CacheKey]) -> list[MemoryObj | None]:
        if self._is_plain():
            return await super()._batched_get(keys)
        return await self._ext_batched_read(keys, [None] * len(keys))

    async def _batched_get_into(
        self, keys: Sequence[CacheKey], dests: Sequence[MemoryObj]
    ) -> list[bool]:
        if self._is_plain() or any(dest.device.type != "cpu" for dest in dests):
            return await super()._batched_get_into(keys, dests)
        got = await self._ext_batched_read(keys, dests)
        return [obj is not None for obj in got]

    async def _batched_put(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]) -> None:
        if self._is_plain():
            await super()._batched_put(keys, objs)
            return
        names = [self.wire_key(key) for key in keys]

        async def send(connection: Connection, index: int) -> int:
            value = self._outgoing(keys[index], objs[index])
            return await self._send_put(connection, names[index], value)

        async def read(connection: Connection, request_id: int, index: int) -> None:
            await self._read_put(connection, request_id, names[index])

        await pipelined(self._pool, names, send, read)

    async def _list_keys(self) -> AsyncIterator[CacheKey]:
        async def request(connection: Connection) -> bytes:
            request_id = connection.next_request_id()
            await connection.send(wire.pack_ext_request(wire.Op.LIST, request_id=request_id))
            header, _ = await read_reply(connection, request_id, self._pool.address)
            if header.status != wire.Status.OK:
                raise await refusal(connection, header, "list_keys", self._pool.address)
            return bytes(await connection.recv_exact(header.payload_len))

        listing = await self._run_listing(request)
        prefix = self.options.key_prefix
        for line in listing.split(b"\n"):
            text = decode_key(line)
            if text is None or not text.startswith(prefix):
                continue
            try:
                yield CacheKey.parse(text[len(prefix) :])
            except KvplugError:
                continue  # not a kvplug key (another client's, or another prefix's)

    async def _run_listing(self, request: Callable[[Connection], Awaitable[bytes]]) -> bytes:
        """The LIST round trip, on the backend's loop and under its deadline (counted apart
        from ``list_keys``'s calls, which the template counts)."""
        return await self._run_hook("list_keys_round_trip", self._pool.run, request)


__all__ = [
    "DEFAULT_PORT",
    "ESCAPED_KEY_MARK",
    "HEALTH_KEY",
    "LMBackend",
    "LMOptions",
    "decode_key",
    "encode_key",
]
