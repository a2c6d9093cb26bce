"""kvplug_lm.wire: every pack/unpack round-trips, every check rejects what it must with
WireError (and only WireError), and plain headers match LMCache 0.5.6's layout byte for byte."""

from __future__ import annotations

import json
import struct
import subprocess
import textwrap
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvplug_lm import wire
from kvplug_lm.wire import (
    Code,
    Command,
    Hello,
    Meta,
    Op,
    Status,
    WireError,
)
from kvplug_testing.lm import LMCACHE_ABSENT, lmcache_python

PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

int32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)
uint32 = st.integers(min_value=0, max_value=2**32 - 1)
uint64 = st.integers(min_value=0, max_value=2**64 - 1)
key_alphabet = st.characters(
    codec="utf-8", exclude_categories=("Cc", "Cf", "Cs", "Co", "Cn", "Zs", "Zl", "Zp")
)
valid_keys = (
    st.text(alphabet=key_alphabet, min_size=1, max_size=40)
    .map(str.encode)
    .filter(lambda key: 0 < len(key) <= wire.PLAIN_KEY_BYTES)
)
shapes = st.lists(st.integers(min_value=0, max_value=2**31 - 1), max_size=4)


# -- plain layout ---------------------------------------------------------------------------


def test_plain_sizes_are_lmcache_s() -> None:
    assert wire.PLAIN_REQUEST.size == 186
    assert wire.PLAIN_REPLY.size == 36
    assert wire.PLAIN_KEY_BYTES == 150


def test_plain_request_field_offsets() -> None:
    header = wire.pack_plain_request(
        Command.PUT, "m@1@0@ab@half", length=1234, fmt=3, dtype=4, shape=(5, 6, 7)
    )
    fields = struct.unpack_from("<9i", header)
    # command, length, fmt, dtype, location, shape[0..3] at offsets 0, 4, ..., 32
    assert fields == (1, 1234, 3, 4, 0, 5, 6, 7, 0)
    assert header[36:] == b"m@1@0@ab@half".ljust(150, b" ")


def test_plain_reply_location_is_last() -> None:
    reply = wire.pack_plain_reply(Code.SUCCESS, length=9, fmt=2, dtype=3, shape=(4, 5), location=1)
    assert struct.unpack("<9i", reply) == (200, 9, 2, 3, 4, 5, 0, 0, 1)


def test_plain_miss_is_lmcache_s_zeros() -> None:
    assert wire.unpack_plain_reply(wire.pack_plain_reply(Code.FAIL)) == wire.PlainReply(
        400, 0, 1, 2, (0, 0, 0, 0), 0
    )


@PROPERTY
@given(
    command=st.sampled_from(list(Command)),
    key=valid_keys,
    length=st.integers(min_value=0, max_value=wire.INT32_MAX),
    fmt=st.integers(min_value=0, max_value=8),
    dtype=st.integers(min_value=0, max_value=8),
    shape=shapes,
)
def test_plain_request_round_trips(
    command: Command, key: bytes, length: int, fmt: int, dtype: int, shape: list[int]
) -> None:
    header = wire.pack_plain_request(command, key, length=length, fmt=fmt, dtype=dtype, shape=shape)
    assert len(header) == 186
    parsed = wire.unpack_plain_request(header)
    assert parsed == wire.PlainRequest(
        int(command), length, fmt, dtype, 0, wire.pad_shape(shape), key
    )
    assert wire.strip_shape(parsed.shape) == (wire.strip_shape(tuple(shape)) if shape else (0,))
    if command == Command.PUT or length == 0:
        wire.check_plain_request(parsed)


@PROPERTY
@given(
    code=st.sampled_from(list(Code)),
    length=int32,
    fmt=int32,
    dtype=int32,
    shape=st.lists(int32, max_size=4),
    location=int32,
)
def test_plain_reply_round_trips(
    code: Code, length: int, fmt: int, dtype: int, shape: list[int], location: int
) -> None:
    reply = wire.pack_plain_reply(
        code, length=length, fmt=fmt, dtype=dtype, shape=shape, location=location
    )
    assert wire.unpack_plain_reply(reply) == wire.PlainReply(
        int(code), length, fmt, dtype, wire.pad_shape(shape), location
    )


def test_pad_shape_rejects_five_dims() -> None:
    with pytest.raises(WireError, match="5 dims"):
        wire.pad_shape((1, 2, 3, 4, 5))


def test_strip_shape_keeps_one_dim() -> None:
    assert wire.strip_shape((0, 0, 0, 0)) == (0,)
    assert wire.strip_shape((7, 0, 3, 0)) == (7, 0, 3)


def test_pack_plain_request_rejects_long_key_and_bad_length() -> None:
    with pytest.raises(WireError, match="151 bytes"):
        wire.pack_plain_request(Command.GET, "k" * 151)
    with pytest.raises(WireError, match="does not fit"):
        wire.pack_plain_request(Command.PUT, "k", length=-1)
    with pytest.raises(WireError, match="does not fit"):
        wire.pack_plain_request(Command.PUT, "k", length=wire.INT32_MAX + 1)


# -- check_plain_request --------------------------------------------------------------------


def _request(**fields: Any) -> wire.PlainRequest:
    base = wire.PlainRequest(1, 8, 1, 2, 0, (8, 0, 0, 0), b"m@1@0@ab@half")
    return base._replace(**fields)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"command": 0}, "unknown command 0"),
        ({"command": 6}, "unknown command 6"),
        ({"command": -1}, "unknown command -1"),
        ({"length": -1}, "negative payload length"),
        ({"command": 2, "length": 4}, "GET carries length 4"),
        ({"command": 5, "length": 1}, "HEALTH carries length 1"),
        ({"fmt": 9}, "unknown memory format 9"),
        ({"fmt": -1}, "unknown memory format -1"),
        ({"dtype": 9}, "unknown dtype code 9"),
        ({"dtype": -3}, "unknown dtype code -3"),
        ({"shape": (1, -2, 0, 0)}, "negative dimension"),
        ({"key": b""}, "empty key"),
        ({"key": b"\xff\xfe"}, "not UTF-8"),
        ({"key": b"a\x00b"}, "control characters"),
        ({"key": b"a\x7fb"}, "control characters"),
        ({"key": b"a b"}, "whitespace"),
        ({"key": "a\u2028b".encode()}, "whitespace or control"),
        ({"command": 2, "length": 0, "key": b"k" * 151}, "exceeds the limit of 150"),
    ],
)
def test_check_plain_request_rejects(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(WireError, match=message):
        wire.check_plain_request(_request(**fields))


def test_check_plain_request_accepts_formats_7_and_8_and_short_shapes() -> None:
    for fmt in (7, 8):
        wire.check_plain_request(_request(fmt=fmt, shape=(3, 0, 0, 0)))


def test_check_plain_request_key_limit_is_configurable() -> None:
    wire.check_plain_request(_request(key=b"k" * 150), max_key_bytes=150)
    with pytest.raises(WireError, match="limit of 10"):
        wire.check_plain_request(_request(key=b"k" * 11), max_key_bytes=10)


def test_health_and_list_need_no_key() -> None:
    wire.check_plain_request(_request(command=Command.HEALTH, length=0, key=b""))
    wire.check_plain_request(_request(command=Command.LIST, length=0, key=b""))


@PROPERTY
@given(header=st.binary(min_size=186, max_size=186))
def test_any_186_bytes_parse_or_raise_wire_error(header: bytes) -> None:
    request = wire.unpack_plain_request(header)
    try:
        wire.check_plain_request(request)
    except WireError:
        return
    assert request.command in (1, 2, 3, 4, 5)
    assert request.length >= 0


@PROPERTY
@given(
    command=st.one_of(int32, st.sampled_from(list(Command))),
    length=int32,
    fmt=int32,
    dtype=int32,
    dims=st.tuples(int32, int32, int32, int32),
    key=st.binary(max_size=150),
)
def test_structured_plain_headers_check_only_with_wire_error(
    command: int, length: int, fmt: int, dtype: int, dims: tuple[int, int, int, int], key: bytes
) -> None:
    header = wire.PLAIN_REQUEST.pack(int(command), length, fmt, dtype, 0, *dims, key)
    request = wire.unpack_plain_request(header)
    try:
        wire.check_plain_request(request, max_key_bytes=64)
    except WireError:
        return
    assert request.command in Command._value2member_map_
    assert request.length >= 0
    if request.command == Command.PUT:
        assert request.fmt in wire.FORMAT_CODES and request.dtype in wire.PLAIN_DTYPE_CODES
        assert min(request.shape) >= 0
    if request.command in (Command.PUT, Command.GET, Command.EXIST):
        assert 0 < len(request.key) <= 64


# -- check_key ------------------------------------------------------------------------------


@PROPERTY
@given(key=st.binary(max_size=200), limit=st.integers(min_value=0, max_value=200))
def test_check_key_raises_only_wire_error(key: bytes, limit: int) -> None:
    try:
        wire.check_key(key, limit)
    except WireError:
        return
    assert 0 < len(key) <= limit
    text = key.decode("utf-8")
    assert text.isprintable() and not any(c.isspace() for c in text)


@PROPERTY
@given(key=valid_keys)
def test_check_key_accepts_printable_utf8(key: bytes) -> None:
    wire.check_key(key, wire.PLAIN_KEY_BYTES)


def test_check_key_accepts_lmcache_key_with_tags() -> None:
    wire.check_key(b"Qwen/Qwen3-8B@1@0@1f2e3d@bfloat16@tag1%v", wire.PLAIN_KEY_BYTES)
    wire.check_key(wire.HELLO_KEY.encode(), wire.PLAIN_KEY_BYTES)


# -- hello ----------------------------------------------------------------------------------


@PROPERTY
@given(
    nonce=st.binary(min_size=32, max_size=32),
    max_key=uint32,
    max_object=uint64,
    auth=st.booleans(),
)
def test_hello_round_trips(nonce: bytes, max_key: int, max_object: int, auth: bool) -> None:
    hello = Hello(nonce, max_key, max_object, auth)
    frame = wire.pack_hello_reply(hello)
    reply = wire.unpack_plain_reply(frame[: wire.PLAIN_REPLY.size])
    assert wire.is_kvplug_hello(reply)
    assert wire.unpack_hello_body(frame[wire.PLAIN_REPLY.size :]) == hello


def test_lmcache_health_reply_is_not_a_hello() -> None:
    assert not wire.is_kvplug_hello(wire.unpack_plain_reply(wire.pack_plain_reply(Code.SUCCESS)))
    assert not wire.is_kvplug_hello(
        wire.unpack_plain_reply(wire.pack_plain_reply(Code.FAIL, shape=(wire.HELLO_MAGIC, 1)))
    )


def test_hello_key_fits_lmcache_s_key_field() -> None:
    header = wire.pack_plain_request(Command.HEALTH, wire.HELLO_KEY)
    assert wire.unpack_plain_request(header).key == wire.HELLO_KEY.encode()
    assert wire.HELLO_KEY.count("@") == 4


def test_auth_proof() -> None:
    nonce = bytes(range(32))
    proof = wire.auth_proof("s3cret", nonce)
    assert len(proof) == 32
    assert wire.proof_matches(b"s3cret", nonce, proof)
    assert not wire.proof_matches("other", nonce, proof)
    assert not wire.proof_matches("s3cret", bytes(32), proof)
    assert b"s3cret" not in proof


# -- extended mode --------------------------------------------------------------------------


def test_ext_sizes() -> None:
    assert wire.EXT_REQUEST.size == 36
    assert wire.EXT_REPLY.size == 32
    # A plain header starts with a command 1..5 as a little-endian int; the magic never does.
    assert struct.unpack("<i", wire.EXT_REQUEST_MAGIC)[0] not in range(1, 6)


@PROPERTY
@given(
    op=st.integers(min_value=0, max_value=0xFFFF),
    request_id=st.integers(min_value=0, max_value=2**40),
    key=st.binary(max_size=300),
    meta=st.binary(max_size=64),
    payload_len=uint64,
    crc=st.one_of(st.none(), uint64),
)
def test_ext_request_round_trips(
    op: int, request_id: int, key: bytes, meta: bytes, payload_len: int, crc: int | None
) -> None:
    frame = wire.pack_ext_request(
        op, request_id=request_id, key=key, meta=meta, payload_len=payload_len, checksum=crc
    )
    fixed = wire.EXT_REQUEST.size
    request = wire.unpack_ext_request(frame[:fixed])
    assert request == wire.ExtRequest(
        op,
        0 if crc is None else wire.FLAG_CHECKSUM,
        request_id & 0xFFFFFFFF,
        len(key),
        len(meta),
        payload_len,
        crc or 0,
    )
    assert frame[fixed : fixed + len(key)] == key
    assert frame[fixed + len(key) :] == meta


@PROPERTY
@given(
    status=st.sampled_from(list(Status)),
    request_id=uint32,
    meta=st.binary(max_size=64),
    payload_len=uint64,
    crc=st.one_of(st.none(), uint64),
)
def test_ext_reply_round_trips(
    status: Status, request_id: int, meta: bytes, payload_len: int, crc: int | None
) -> None:
    frame = wire.pack_ext_reply(
        status, request_id=request_id, meta=meta, payload_len=payload_len, checksum=crc
    )
    reply = wire.unpack_ext_reply(frame[: wire.EXT_REPLY.size])
    assert reply == wire.ExtReply(
        int(status),
        0 if crc is None else wire.FLAG_CHECKSUM,
        request_id,
        len(meta),
        payload_len,
        crc or 0,
    )
    assert frame[wire.EXT_REPLY.size :] == meta


@PROPERTY
@given(header=st.binary(min_size=36, max_size=36))
def test_ext_request_wrong_magic_is_wire_error(header: bytes) -> None:
    try:
        request = wire.unpack_ext_request(header)
    except WireError:
        assert header[:4] != wire.EXT_REQUEST_MAGIC
        return
    assert header[:4] == wire.EXT_REQUEST_MAGIC
    assert request.key_len == struct.unpack_from("<I", header, 12)[0]


def test_ext_reply_wrong_magic_is_wire_error() -> None:
    with pytest.raises(WireError, match="magic"):
        wire.unpack_ext_reply(b"KVPX" + bytes(28))


@PROPERTY
@given(
    fmt=st.integers(min_value=0, max_value=8),
    dtype=st.integers(min_value=0, max_value=0xFFFF),
    shape=st.lists(st.integers(min_value=0, max_value=2**63 - 1), max_size=wire.MAX_RANK),
)
def test_meta_round_trips(fmt: int, dtype: int, shape: list[int]) -> None:
    meta = Meta(fmt, dtype, tuple(shape))
    assert wire.unpack_meta(wire.pack_meta(meta)) == meta


def test_pack_meta_rejects_rank_17() -> None:
    with pytest.raises(WireError, match="more than 16"):
        wire.pack_meta(Meta(0, 0, (1,) * 17))


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "shorter than 6"),
        (b"\x00\x00\x00", "shorter than 6"),
        (wire.META.pack(0, 0, 1), "does not hold rank 1"),
        (wire.META.pack(0, 0, 17) + bytes(17 * 8), "does not hold rank 17"),
        (wire.META.pack(0, 0, 0) + b"x", "does not hold rank 0"),
        (wire.META.pack(9, 0, 0), "unknown memory format 9"),
        (wire.META.pack(0, 0, 1) + wire.DIM.pack(-1), "negative dimension"),
    ],
)
def test_unpack_meta_rejects(data: bytes, message: str) -> None:
    with pytest.raises(WireError, match=message):
        wire.unpack_meta(data)


@PROPERTY
@given(data=st.binary(max_size=200))
def test_unpack_meta_raises_only_wire_error(data: bytes) -> None:
    try:
        meta = wire.unpack_meta(data)
    except WireError:
        return
    assert wire.pack_meta(meta) == data


@PROPERTY
@given(keys=st.lists(valid_keys, max_size=20))
def test_keys_round_trip(keys: list[bytes]) -> None:
    assert wire.unpack_keys(wire.pack_keys(keys), wire.PLAIN_KEY_BYTES) == keys


@PROPERTY
@given(payload=st.binary(max_size=300))
def test_unpack_keys_raises_only_wire_error(payload: bytes) -> None:
    try:
        keys = wire.unpack_keys(payload, 64)
    except WireError:
        return
    assert wire.pack_keys(keys) == payload


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"\x01\x00", "inside a key length"),
        (wire.KEY_COUNT.pack(5) + b"abc", "inside a key"),
        (wire.KEY_COUNT.pack(0), "empty key"),
        (wire.KEY_COUNT.pack(2**32 - 1) + b"a", "inside a key"),
    ],
)
def test_unpack_keys_rejects(payload: bytes, message: str) -> None:
    with pytest.raises(WireError, match=message):
        wire.unpack_keys(payload, 64)


def test_checksum_is_xxh3_64() -> None:
    assert wire.checksum(b"") == 0x2D06800538D394C2
    assert wire.checksum(b"abcd") != wire.checksum(b"abce")
    assert wire.checksum(memoryview(b"abcd")) == wire.checksum(bytearray(b"abcd"))


def test_op_and_status_codes_are_stable() -> None:
    assert [int(op) for op in Op] == list(range(1, 9))
    assert [int(status) for status in Status] == list(range(0, 11))


# -- against LMCache 0.5.6's own packing ----------------------------------------------------

_LMCACHE_PACK = textwrap.dedent(
    """
    import json, sys, torch
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.protocol import (
        ClientCommand, ClientMetaMessage, ServerMetaMessage, ServerReturnCode,
    )

    class Key:
        def __init__(self, text):
            self.text = text
        def to_string(self):
            return self.text

    cases = json.loads(sys.argv[1])
    out = []
    for case in cases:
        dtype = getattr(torch, case["dtype"]) if case["dtype"] else None
        if case["kind"] == "request":
            message = ClientMetaMessage(
                ClientCommand(case["command"]), Key(case["key"]), case["length"],
                MemoryFormat(case["fmt"]), dtype, torch.Size(case["shape"]),
            )
        else:
            message = ServerMetaMessage(
                ServerReturnCode(case["code"]), case["length"], MemoryFormat(case["fmt"]),
                dtype, torch.Size(case["shape"]),
            )
        out.append(message.serialize().hex())
    print(json.dumps(out))
    """
)

# torch dtype name -> the code LMCache packs (float16 is 2: torch.half is torch.float16).
_DTYPES = {None: 0, "float16": 2, "bfloat16": 3, "float32": 4, "float64": 5, "uint8": 6}


def test_plain_headers_match_lmcache_0_5_6_bytes() -> None:
    python = lmcache_python()
    if python is None:
        pytest.skip(LMCACHE_ABSENT)
    cases: list[dict[str, object]] = []
    expected: list[bytes] = []
    for command in (Command.PUT, Command.GET, Command.EXIST, Command.HEALTH):
        for dtype, code in _DTYPES.items():
            shape = [2, 3, 256, 1024] if command == Command.PUT else [0]
            fmt = 1 if dtype else 5
            length = 2 * 3 * 256 * 1024 * 2 if command == Command.PUT else 0
            key = f"Qwen/Qwen3-8B@1@0@{code:x}f00d@{dtype or 'none'}"
            cases.append(
                {
                    "kind": "request",
                    "command": int(command),
                    "key": key,
                    "length": length,
                    "fmt": fmt,
                    "dtype": dtype,
                    "shape": shape,
                }
            )
            expected.append(
                wire.pack_plain_request(
                    command, key, length=length, fmt=fmt, dtype=code, shape=shape
                )
            )
    for reply_code in (Code.SUCCESS, Code.FAIL):
        for dtype, code in _DTYPES.items():
            shape = [7, 5]
            cases.append(
                {
                    "kind": "reply",
                    "code": int(reply_code),
                    "length": 70,
                    "fmt": 2,
                    "dtype": dtype,
                    "shape": shape,
                }
            )
            expected.append(
                wire.pack_plain_reply(reply_code, length=70, fmt=2, dtype=code, shape=shape)
            )
    result = subprocess.run(
        [python, "-c", _LMCACHE_PACK, json.dumps(cases)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    produced = [bytes.fromhex(h) for h in json.loads(result.stdout.strip().splitlines()[-1])]
    assert len(produced) == len(expected)
    for case, ours, theirs in zip(cases, expected, produced, strict=True):
        assert ours == theirs, case
