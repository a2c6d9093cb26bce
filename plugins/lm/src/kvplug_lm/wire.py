"""The lm:// wire protocol: LMCache 0.5.6's plain protocol, and kvplug's extended mode.

Both sides of kvplug (the ``lm://`` client in :mod:`kvplug_lm.backend` and the server in
:mod:`kvplug_lm.server`) build and parse every byte through this module; nothing else packs a
header. All integers are little-endian (LMCache packs in native order, which is
little-endian on every host it runs on).

**Plain mode** (LMCache's ``lm://`` connector and ``lmcache_server``, lmcache <= 0.5.6).
A request is a 186-byte header (:data:`PLAIN_REQUEST`: command, length, fmt, dtype code,
location, four shape dims, the key right-padded with spaces to 150 bytes), followed by
``length`` payload bytes for PUT. A reply is a 36-byte header (:data:`PLAIN_REPLY`: code,
length, fmt, dtype code, four shape dims, location; the location is *last* here), followed
by ``length`` payload bytes for a GET hit.

=========  ============================================  =====================================
command    request                                       reply
=========  ============================================  =====================================
PUT (1)    header with the object's length, fmt, dtype,  none (fire and forget)
           shape; then the payload
GET (2)    header, length 0                              200 + stored metadata + payload, or
                                                         400 with zeros
EXIST (3)  header, length 0                              200 if stored, else 400
LIST (4)   header                                        LMCache: none (unimplemented). kvplug:
                                                         400, so a client never waits forever
HEALTH (5) header                                        200
=========  ============================================  =====================================

Shapes of fewer than four dims travel zero-padded; dtype code 0 is "none" (LMCache's byte
buffers), code 1 decodes as float16.

**Detecting each other.** A kvplug client opens every connection with a HEALTH request whose
key is :data:`HELLO_KEY` (a key LMCache's server parses without complaint). LMCache's server
answers an ordinary HEALTH reply (200, all zeros). kvplug's server answers 200 with
``shape[0] == HELLO_MAGIC``, ``shape[1]`` its protocol version and ``length`` the size of a
:data:`HELLO_BODY` that follows (a nonce for authentication and the server's limits). A plain
LMCache client never sends that key, so it never sees the difference.

**Extended mode** (kvplug with kvplug). After the hello, the client may send extended frames
on the same connection; the server tells them from plain headers by their first four bytes,
:data:`EXT_REQUEST_MAGIC` (a plain header starts with a command number from 1 to 5). A
request is :data:`EXT_REQUEST` (magic, op, flags, request id, key length, meta length,
payload length, checksum), then the key, the meta (:func:`pack_meta`: format, dtype code,
rank, dims) and the payload. Every extended request gets exactly one reply, in order:
:data:`EXT_REPLY` (magic, status, flags, request id, meta length, payload length, checksum),
then meta and payload. So a client may pipeline: write many requests, then read the replies
in order. Checksums are xxh3-64 of the payload (``FLAG_CHECKSUM``).

Example, a plain GET header and a round trip of an extended reply::

    >>> header = pack_plain_request(Command.GET, "m@1@0@1f@half")
    >>> len(header), unpack_plain_request(header).key
    (186, b'm@1@0@1f@half')
    >>> reply = pack_ext_reply(Status.OK, request_id=7, payload_len=4, checksum=checksum(b"abcd"))
    >>> unpack_ext_reply(reply).request_id
    7
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct
from collections.abc import Sequence
from typing import NamedTuple

import xxhash

Buffer = bytes | bytearray | memoryview

# -- plain mode (LMCache 0.5.6) ------------------------------------------------------------------

PLAIN_KEY_BYTES = 150
"""Bytes of the key field of a plain request (LMCache's ``MAX_KEY_LENGTH``)."""

PLAIN_REQUEST = struct.Struct(f"<9i{PLAIN_KEY_BYTES}s")
"""command, length, fmt, dtype, location, shape[0..3], key: 186 bytes."""

PLAIN_REPLY = struct.Struct("<9i")
"""code, length, fmt, dtype, shape[0..3], location: 36 bytes."""

INT32_MAX = (1 << 31) - 1
"""The largest payload a plain header can describe (its length is a signed 32-bit int)."""


class Command(enum.IntEnum):
    """Plain-mode commands (LMCache's ``ClientCommand``)."""

    PUT = 1
    GET = 2
    EXIST = 3
    LIST = 4
    HEALTH = 5


class Code(enum.IntEnum):
    """Plain-mode reply codes (LMCache's ``ServerReturnCode``)."""

    SUCCESS = 200
    FAIL = 400


PLAIN_DTYPE_CODES = range(0, 9)
"""dtype codes LMCache defines: 0 none, 1 and 2 float16, 3 bfloat16, 4 float32, 5 float64,
6 uint8, 7 float8_e4m3fn, 8 float8_e5m2."""

FORMAT_CODES = range(0, 9)
"""Memory formats on the wire: 0 to 6 as in LMCache 0.5.x and kvplug, 7 and 8 from newer
LMCache releases (stored and returned as they are)."""

# What an LMCache server sends back for a miss, a failed EXIST and a HEALTH: fmt 1, float16.
_EMPTY_FMT = 1
_EMPTY_DTYPE = 2


class WireError(ValueError):
    """Bytes that are not a valid frame. The message names the field, the value and the
    rule; :attr:`kind` names the rule for counters (``bad_key``, ``bad_shape``,
    ``unknown_command``, ...). The server replies with an error and closes the connection
    when it sees one."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class PlainRequest(NamedTuple):
    command: int
    length: int
    fmt: int
    dtype: int
    location: int
    shape: tuple[int, int, int, int]
    key: bytes
    """The key field with its padding stripped (LMCache strips whitespace on both sides)."""


class PlainReply(NamedTuple):
    code: int
    length: int
    fmt: int
    dtype: int
    shape: tuple[int, int, int, int]
    location: int


def pad_shape(shape: Sequence[int]) -> tuple[int, int, int, int]:
    """``shape`` zero-padded to four dims; more than four raise :class:`WireError`."""
    if len(shape) > 4:
        raise WireError(
            "bad_shape",
            f"shape {tuple(shape)} has {len(shape)} dims; LMCache's plain protocol carries at "
            "most 4. Use the extended mode (a kvplug server) or reshape the object.",
        )
    dims = tuple(int(d) for d in shape) + (0,) * (4 - len(shape))
    if any(not -(1 << 31) <= d <= INT32_MAX for d in dims):
        raise WireError(
            "bad_shape",
            f"shape {tuple(shape)} has a dimension outside int32; LMCache's plain protocol "
            "carries 32-bit dims. Use the extended mode (a kvplug server).",
        )
    return dims  # type: ignore[return-value]


def strip_shape(dims: Sequence[int]) -> tuple[int, ...]:
    """The shape before :func:`pad_shape`: trailing zero dims removed, at least one kept."""
    end = len(dims)
    while end > 1 and dims[end - 1] == 0:
        end -= 1
    return tuple(dims[:end])


def pack_plain_request(
    command: Command | int,
    key: str | bytes,
    *,
    length: int = 0,
    fmt: int = _EMPTY_FMT,
    dtype: int = _EMPTY_DTYPE,
    shape: Sequence[int] = (),
) -> bytes:
    """A 186-byte plain request header. Keys longer than 150 bytes raise :class:`WireError`
    (LMCache's server cannot take them; the extended mode can)."""
    raw = key.encode() if isinstance(key, str) else bytes(key)
    if len(raw) > PLAIN_KEY_BYTES:
        raise WireError(
            "bad_key",
            f"key of {len(raw)} bytes is longer than the {PLAIN_KEY_BYTES} bytes LMCache's "
            "plain protocol allows; use a kvplug server (extended mode) or a shorter model name.",
        )
    if not 0 <= length <= INT32_MAX:
        raise WireError(
            "bad_length",
            f"payload of {length} bytes does not fit a plain header (0 to {INT32_MAX} bytes); "
            "split the object or use the extended mode.",
        )
    return PLAIN_REQUEST.pack(
        int(command), length, fmt, dtype, 0, *pad_shape(shape), raw.ljust(PLAIN_KEY_BYTES)
    )


def unpack_plain_request(header: Buffer) -> PlainRequest:
    """Parse a 186-byte plain header; the fields are not checked (see
    :func:`check_plain_request`)."""
    command, length, fmt, dtype, location, s0, s1, s2, s3, key = PLAIN_REQUEST.unpack(header)
    return PlainRequest(command, length, fmt, dtype, location, (s0, s1, s2, s3), key.strip())


def check_plain_request(request: PlainRequest, max_key_bytes: int = PLAIN_KEY_BYTES) -> None:
    """Raise :class:`WireError` naming the first field of ``request`` that is invalid."""
    if request.command not in Command._value2member_map_:
        raise WireError(
            "unknown_command", f"unknown command {request.command} (plain commands are 1 to 5)"
        )
    if request.length < 0:
        raise WireError("negative_length", f"negative payload length {request.length}")
    if request.command != Command.PUT and request.length != 0:
        raise WireError(
            "bad_length", f"{Command(request.command).name} carries length {request.length}, not 0"
        )
    if request.command == Command.PUT:
        if request.fmt not in FORMAT_CODES:
            raise WireError("bad_format", f"unknown memory format {request.fmt} (0 to 8)")
        if request.dtype not in PLAIN_DTYPE_CODES:
            raise WireError("bad_dtype", f"unknown dtype code {request.dtype} (0 to 8)")
        if any(d < 0 for d in request.shape):
            raise WireError("bad_shape", f"negative dimension in shape {request.shape}")
    if request.command in (Command.PUT, Command.GET, Command.EXIST):
        check_key(request.key, max_key_bytes)


def pack_plain_reply(
    code: Code | int,
    *,
    length: int = 0,
    fmt: int = _EMPTY_FMT,
    dtype: int = _EMPTY_DTYPE,
    shape: Sequence[int] = (),
    location: int = 0,
) -> bytes:
    """A 36-byte plain reply header (a miss or failure: ``pack_plain_reply(Code.FAIL)``, the
    zeros LMCache's server sends)."""
    return PLAIN_REPLY.pack(int(code), length, fmt, dtype, *pad_shape(shape), location)


def unpack_plain_reply(header: Buffer) -> PlainReply:
    code, length, fmt, dtype, s0, s1, s2, s3, location = PLAIN_REPLY.unpack(header)
    return PlainReply(code, length, fmt, dtype, (s0, s1, s2, s3), location)


def check_key(key: bytes, max_key_bytes: int) -> None:
    """Raise :class:`WireError` unless ``key`` is 1 to ``max_key_bytes`` bytes of UTF-8
    without whitespace or control characters (LMCache's key strings never contain them, and
    the extended LIST separates keys with newlines)."""
    if not key:
        raise WireError("bad_key", "empty key")
    if len(key) > max_key_bytes:
        raise WireError(
            "bad_key", f"key of {len(key)} bytes exceeds the limit of {max_key_bytes} bytes"
        )
    try:
        text = key.decode("utf-8")
    except UnicodeDecodeError as error:
        raise WireError(
            "bad_key", f"key is not UTF-8 ({error.reason} at byte {error.start})"
        ) from None
    if not text.isprintable() or any(c.isspace() for c in text):
        raise WireError("bad_key", f"key {text[:40]!r} contains whitespace or control characters")


# -- detecting each other -------------------------------------------------------------------

HELLO_KEY = "kvplug-lm-hello@1@0@0@half"
"""The key of the HEALTH request a kvplug client opens a connection with."""

HELLO_MAGIC = 0x6B76706C
"""``shape[0]`` of a kvplug server's reply to the hello (LMCache's server sends 0)."""

PROTOCOL_VERSION = 1
"""The extended protocol's version, in ``shape[1]`` of the hello reply."""

HELLO_BODY = struct.Struct("<32sIQB")
"""What follows a kvplug server's hello reply: a nonce for authentication, the longest key
it accepts, the largest object it accepts, and whether it requires authentication (1)."""

NONCE_BYTES = 32


class Hello(NamedTuple):
    nonce: bytes
    max_key_bytes: int
    max_object_bytes: int
    auth_required: bool


def pack_hello_reply(hello: Hello) -> bytes:
    """A kvplug server's reply to the hello: the plain header, then :data:`HELLO_BODY`."""
    header = pack_plain_reply(
        Code.SUCCESS,
        length=HELLO_BODY.size,
        fmt=0,
        dtype=0,
        shape=(HELLO_MAGIC, PROTOCOL_VERSION, 0, 0),
    )
    body = HELLO_BODY.pack(
        hello.nonce, hello.max_key_bytes, hello.max_object_bytes, int(hello.auth_required)
    )
    return header + body


def is_kvplug_hello(reply: PlainReply) -> bool:
    """Whether a reply to the hello comes from a kvplug server (a body of
    :data:`HELLO_BODY` follows)."""
    return (
        reply.code == Code.SUCCESS
        and reply.shape[0] == HELLO_MAGIC
        and reply.shape[1] >= 1
        and reply.length == HELLO_BODY.size
    )


def unpack_hello_body(body: Buffer) -> Hello:
    nonce, max_key, max_object, auth = HELLO_BODY.unpack(body)
    return Hello(nonce, max_key, max_object, bool(auth))


def auth_proof(secret: str | bytes, nonce: bytes) -> bytes:
    """HMAC-SHA256 of the server's nonce under the shared secret: the payload of an AUTH
    request. The secret itself never travels."""
    key = secret.encode() if isinstance(secret, str) else secret
    return hmac.new(key, b"kvplug-lm-auth\0" + nonce, hashlib.sha256).digest()


def proof_matches(secret: str | bytes, nonce: bytes, proof: bytes) -> bool:
    return hmac.compare_digest(auth_proof(secret, nonce), proof)


# -- extended mode --------------------------------------------------------------------------

EXT_REQUEST_MAGIC = b"KVPX"
EXT_REPLY_MAGIC = b"KVPR"

EXT_REQUEST = struct.Struct("<4sHHIIIQQ")
"""magic, op, flags, request id, key length, meta length, payload length, checksum: 36
bytes; then the key, the meta, the payload."""

EXT_REPLY = struct.Struct("<4sHHIIQQ")
"""magic, status, flags, request id, meta length, payload length, checksum: 32 bytes; then
the meta, the payload."""

FLAG_CHECKSUM = 1
"""The frame's checksum field holds xxh3-64 of its payload."""

META = struct.Struct("<HHH")
"""format, dtype code (kvplug's codes, :data:`kvplug.memory.DTYPE_CODES`), rank; then
``rank`` signed 64-bit dims."""
DIM = struct.Struct("<q")
MAX_RANK = 16

KEY_COUNT = struct.Struct("<I")
"""Each key of an EXISTS_MANY payload is a length, then the key's bytes."""


class Op(enum.IntEnum):
    """Extended-mode operations. Each gets one reply."""

    PUT = 1
    """key, meta, payload (with its checksum): stores it, replacing the old value; OK, or
    TOO_LARGE, NO_SPACE, BAD_CHECKSUM."""
    GET = 2
    """key: OK with meta, payload and checksum, or NOT_FOUND."""
    EXISTS = 3
    """key: OK or NOT_FOUND."""
    LIST = 4
    """no key: OK with the stored keys, newline-separated, as the payload."""
    PING = 5
    """OK."""
    DELETE = 6
    """key: OK if it was stored (and is now gone), NOT_FOUND otherwise."""
    EXISTS_MANY = 7
    """payload of keys (:data:`KEY_COUNT` length + bytes each): OK with one byte per key, 1
    present, 0 absent."""
    AUTH = 8
    """payload :func:`auth_proof` of the hello's nonce: OK or AUTH_FAILED. Until it succeeds,
    a server that requires authentication answers every other request AUTH_REQUIRED."""


class Status(enum.IntEnum):
    OK = 0
    NOT_FOUND = 1
    BAD_REQUEST = 2
    """The frame broke a rule (the reply's payload is the reason, UTF-8); the server closes
    the connection after it."""
    TOO_LARGE = 3
    """The key or the object exceeds the server's limit."""
    NO_SPACE = 4
    """The server could not make room (everything left is being read or written)."""
    BAD_CHECKSUM = 5
    """The payload did not match its checksum: nothing was stored."""
    AUTH_REQUIRED = 6
    AUTH_FAILED = 7
    SHUTTING_DOWN = 8
    UNSUPPORTED = 9
    INTERNAL = 10


class ExtRequest(NamedTuple):
    op: int
    flags: int
    request_id: int
    key_len: int
    meta_len: int
    payload_len: int
    checksum: int


class ExtReply(NamedTuple):
    status: int
    flags: int
    request_id: int
    meta_len: int
    payload_len: int
    checksum: int


class Meta(NamedTuple):
    """What the extended mode stores beside a payload: the object's format, dtype code and
    full shape (any rank up to :data:`MAX_RANK`)."""

    fmt: int
    dtype: int
    shape: tuple[int, ...]


def pack_ext_request(
    op: Op | int,
    *,
    request_id: int = 0,
    key: bytes = b"",
    meta: bytes = b"",
    payload_len: int = 0,
    checksum: int | None = None,
) -> bytes:
    """The header, key and meta of an extended request (the payload follows separately)."""
    flags = 0 if checksum is None else FLAG_CHECKSUM
    header = EXT_REQUEST.pack(
        EXT_REQUEST_MAGIC,
        int(op),
        flags,
        request_id & 0xFFFFFFFF,
        len(key),
        len(meta),
        payload_len,
        checksum or 0,
    )
    return header + key + meta


def unpack_ext_request(header: Buffer) -> ExtRequest:
    """Parse the fixed part of an extended request; raises :class:`WireError` for a wrong
    magic. Lengths are not checked against limits here (the server does)."""
    magic, op, flags, request_id, key_len, meta_len, payload_len, crc = EXT_REQUEST.unpack(header)
    if magic != EXT_REQUEST_MAGIC:
        raise WireError(
            "bad_magic", f"extended request magic is {magic!r}, expected {EXT_REQUEST_MAGIC!r}"
        )
    return ExtRequest(op, flags, request_id, key_len, meta_len, payload_len, crc)


def pack_ext_reply(
    status: Status | int,
    *,
    request_id: int,
    meta: bytes = b"",
    payload_len: int = 0,
    checksum: int | None = None,
) -> bytes:
    """The header and meta of an extended reply (the payload follows separately)."""
    flags = 0 if checksum is None else FLAG_CHECKSUM
    header = EXT_REPLY.pack(
        EXT_REPLY_MAGIC, int(status), flags, request_id, len(meta), payload_len, checksum or 0
    )
    return header + meta


def unpack_ext_reply(header: Buffer) -> ExtReply:
    magic, status, flags, request_id, meta_len, payload_len, crc = EXT_REPLY.unpack(header)
    if magic != EXT_REPLY_MAGIC:
        raise WireError(
            "bad_magic", f"extended reply magic is {magic!r}, expected {EXT_REPLY_MAGIC!r}"
        )
    return ExtReply(status, flags, request_id, meta_len, payload_len, crc)


def pack_meta(meta: Meta) -> bytes:
    if len(meta.shape) > MAX_RANK:
        raise WireError("bad_shape", f"shape {meta.shape} has more than {MAX_RANK} dims")
    return META.pack(meta.fmt, meta.dtype, len(meta.shape)) + b"".join(
        DIM.pack(d) for d in meta.shape
    )


def unpack_meta(data: Buffer) -> Meta:
    """Parse and check a meta block; :class:`WireError` names what is wrong."""
    view = memoryview(data)
    if len(view) < META.size:
        raise WireError("bad_meta", f"meta of {len(view)} bytes is shorter than {META.size}")
    fmt, dtype, rank = META.unpack_from(view)
    if rank > MAX_RANK or len(view) != META.size + rank * DIM.size:
        raise WireError("bad_meta", f"meta of {len(view)} bytes does not hold rank {rank}")
    shape = tuple(DIM.unpack_from(view, META.size + i * DIM.size)[0] for i in range(rank))
    if fmt not in FORMAT_CODES:
        raise WireError("bad_format", f"unknown memory format {fmt} (0 to 8)")
    if any(d < 0 for d in shape):
        raise WireError("bad_shape", f"negative dimension in shape {shape}")
    return Meta(fmt, dtype, shape)


def pack_keys(keys: Sequence[bytes]) -> bytes:
    """The payload of an EXISTS_MANY request."""
    return b"".join(KEY_COUNT.pack(len(key)) + key for key in keys)


def unpack_keys(payload: Buffer, max_key_bytes: int) -> list[bytes]:
    """The keys of an EXISTS_MANY payload, each checked with :func:`check_key`."""
    view = memoryview(payload)
    keys: list[bytes] = []
    offset = 0
    while offset < len(view):
        if offset + KEY_COUNT.size > len(view):
            raise WireError("bad_payload", "EXISTS_MANY payload ends inside a key length")
        (length,) = KEY_COUNT.unpack_from(view, offset)
        offset += KEY_COUNT.size
        if offset + length > len(view):
            raise WireError("bad_payload", "EXISTS_MANY payload ends inside a key")
        key = bytes(view[offset : offset + length])
        check_key(key, max_key_bytes)
        keys.append(key)
        offset += length
    return keys


def checksum(data: Buffer) -> int:
    """xxh3-64 of ``data`` (the extended mode's payload checksum)."""
    return xxhash.xxh3_64_intdigest(data)


__all__ = [
    "DIM",
    "EXT_REPLY",
    "EXT_REPLY_MAGIC",
    "EXT_REQUEST",
    "EXT_REQUEST_MAGIC",
    "FLAG_CHECKSUM",
    "FORMAT_CODES",
    "HELLO_BODY",
    "HELLO_KEY",
    "HELLO_MAGIC",
    "INT32_MAX",
    "KEY_COUNT",
    "MAX_RANK",
    "META",
    "NONCE_BYTES",
    "PLAIN_DTYPE_CODES",
    "PLAIN_KEY_BYTES",
    "PLAIN_REPLY",
    "PLAIN_REQUEST",
    "PROTOCOL_VERSION",
    "Code",
    "Command",
    "ExtReply",
    "ExtRequest",
    "Hello",
    "Meta",
    "Op",
    "PlainReply",
    "PlainRequest",
    "Status",
    "WireError",
    "auth_proof",
    "check_key",
    "check_plain_request",
    "checksum",
    "is_kvplug_hello",
    "pack_ext_reply",
    "pack_ext_request",
    "pack_hello_reply",
    "pack_keys",
    "pack_meta",
    "pack_plain_reply",
    "pack_plain_request",
    "proof_matches",
    "strip_shape",
    "unpack_ext_reply",
    "unpack_ext_request",
    "unpack_hello_body",
    "unpack_keys",
    "unpack_meta",
    "unpack_plain_reply",
    "unpack_plain_request",
]
