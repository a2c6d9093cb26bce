"""Hostile input against a real ``kvplug lm-server`` (in process, on its own loop thread).

Every test ends with the same checks (:func:`assert_unharmed`): a fresh connection's HEALTH
answers, the honest client that runs beside the hostile ones (:class:`Bystander`) got every
byte back, the allocator holds nothing beyond the stored objects (no receive buffer leaked),
and the server logged no error. Hypothesis generates the malformed frames; the named tests
cover each kind of attack of issue 17 item 4.
"""

from __future__ import annotations

import contextlib
import select
import socket
import time
import tracemalloc
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lm_hostile_helpers import (
    HELLO_REPLY_BYTES,
    HELLO_REQUEST,
    Bystander,
    ErrorLog,
    Exchange,
    alive,
    connect,
    exchange,
    hang_up_without_fin,
    hello,
    inflight_bytes,
    lm_key,
    plain_exists,
    plain_get,
    plain_put,
    plain_replies,
    protocol_errors,
    read_until_closed,
    recv_exact,
    wait_until,
)

from kvplug_lm import wire
from kvplug_lm.server import MAX_SMALL_PAYLOAD, LMServer, ServerOptions, run_in_thread
from kvplug_lm.wire import Code, Command, Op, Status
from kvplug_testing.ports import free_port

MAX_KEY_BYTES = 100
MAX_OBJECT_BYTES = 1 << 20
FRAME_TIMEOUT = 1.5
MIN_RATE = 64 << 10

HOSTILE = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def _options(**overrides: object) -> ServerOptions:
    limits: dict[str, object] = {
        "host": "127.0.0.1",
        "port": free_port(),
        "max_memory": 16 << 20,
        "max_key_bytes": MAX_KEY_BYTES,
        "max_object_bytes": MAX_OBJECT_BYTES,
        "idle_timeout": 60.0,
        "frame_timeout": FRAME_TIMEOUT,
        "min_rate": MIN_RATE,
        "max_connections": 64,
    }
    limits.update(overrides)
    return ServerOptions(**limits)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def errors() -> Iterator[ErrorLog]:
    with ErrorLog() as log:
        yield log


@pytest.fixture(scope="module")
def server(errors: ErrorLog) -> Iterator[LMServer]:
    with run_in_thread(_options()) as running:
        yield running


@pytest.fixture(scope="module")
def bystander(server: LMServer) -> Iterator[Bystander]:
    client = Bystander(server.port).start()
    assert wait_until(lambda: client.operations > 0 or bool(client.failures))
    yield client
    client.stop()


@pytest.fixture(scope="module")
def strict(errors: ErrorLog) -> Iterator[LMServer]:
    """Few connections and a short idle timeout."""
    options = _options(max_connections=6, idle_timeout=1.5)
    with run_in_thread(options) as running:
        yield running


def assert_unharmed(server: LMServer, bystander: Bystander | None, errors: ErrorLog) -> None:
    assert alive(server.port), "the server stopped answering HEALTH on a fresh connection"
    if bystander is not None:
        bystander.check()
    with bystander.quiet() if bystander is not None else contextlib.nullcontext():
        assert wait_until(lambda: inflight_bytes(server.stats()) == 0), (
            f"receive buffers leaked: {server.stats()}"
        )
    assert errors.take() == []


def assert_rejected(result: Exchange) -> None:
    """The server hung up, and whatever it said before was a failure, never a success."""
    assert result.closed, f"the server kept the connection open after a bad frame: {result}"
    if result.reply[:4] == wire.EXT_REPLY_MAGIC:
        status = wire.unpack_ext_reply(result.reply[: wire.EXT_REPLY.size]).status
        assert status != Status.OK
    else:
        assert all(reply.code == Code.FAIL for reply in plain_replies(result.reply))


def _plain(
    command: int,
    key: bytes = b"",
    length: int = 0,
    fmt: int = 0,
    dtype: int = 6,
    dims: tuple[int, int, int, int] = (0, 0, 0, 0),
    location: int = 0,
) -> bytes:
    """A plain header packed without any check (pack_plain_request refuses bad fields)."""
    return wire.PLAIN_REQUEST.pack(
        command, length, fmt, dtype, location, *dims, key.ljust(wire.PLAIN_KEY_BYTES)
    )


def _objects(server: LMServer) -> int:
    return int(server.stats()["objects"])


# -- generated frames ---------------------------------------------------------------------

int32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)
uint32 = st.integers(min_value=0, max_value=2**32 - 1)
uint64 = st.integers(min_value=0, max_value=2**64 - 1)
lengths = st.one_of(
    st.integers(min_value=0, max_value=4096),
    st.sampled_from([-1, -(2**31), MAX_OBJECT_BYTES, MAX_OBJECT_BYTES + 1, wire.INT32_MAX]),
    int32,
)
keys = st.one_of(
    st.integers(min_value=0, max_value=50).map(lm_key),
    st.binary(max_size=wire.PLAIN_KEY_BYTES),
    st.text(max_size=60).map(str.encode).filter(lambda k: len(k) <= wire.PLAIN_KEY_BYTES),
)


@st.composite
def plain_frames(draw: st.DrawFn) -> bytes:
    command = draw(st.one_of(st.integers(min_value=0, max_value=6), int32))
    length = draw(lengths)
    header = wire.PLAIN_REQUEST.pack(
        command,
        length,
        draw(st.one_of(st.integers(min_value=-1, max_value=9), int32)),
        draw(st.one_of(st.integers(min_value=-1, max_value=9), int32)),
        draw(st.one_of(st.just(0), int32)),
        *draw(st.tuples(int32, int32, int32, int32)),
        draw(keys),
    )
    body = draw(st.binary(max_size=4096))
    frame = header + body
    cut = draw(st.one_of(st.none(), st.integers(min_value=0, max_value=len(frame))))
    return frame if cut is None else frame[:cut]


@st.composite
def ext_frames(draw: st.DrawFn) -> bytes:
    magic = draw(st.one_of(st.just(wire.EXT_REQUEST_MAGIC), st.binary(min_size=4, max_size=4)))
    key = draw(keys)
    meta = draw(
        st.one_of(
            st.builds(
                lambda fmt, dtype, shape: (
                    wire.META.pack(fmt, dtype, len(shape))
                    + b"".join(wire.DIM.pack(d) for d in shape)
                ),
                st.integers(min_value=0, max_value=0xFFFF),
                st.integers(min_value=0, max_value=0xFFFF),
                st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), max_size=20),
            ),
            st.binary(max_size=64),
        )
    )
    body = draw(st.binary(max_size=4096))
    header = wire.EXT_REQUEST.pack(
        magic,
        draw(st.integers(min_value=0, max_value=0xFFFF)),
        draw(st.integers(min_value=0, max_value=0xFFFF)),
        draw(uint32),
        draw(st.one_of(st.just(len(key)), uint32)),
        draw(st.one_of(st.just(len(meta)), uint32)),
        draw(st.one_of(st.just(len(body)), st.integers(min_value=0, max_value=8192), uint64)),
        draw(uint64),
    )
    frame: bytes = header + key + meta + body
    cut = draw(st.one_of(st.none(), st.integers(min_value=0, max_value=len(frame))))
    return HELLO_REQUEST + (frame if cut is None else frame[:cut])


def _check_closed(result: Exchange) -> None:
    assert result.closed, (
        f"the server kept a connection open after the client's EOF: {len(result.reply)} bytes back"
    )


@HOSTILE
@given(frame=plain_frames())
def test_generated_plain_frames(
    server: LMServer, bystander: Bystander, errors: ErrorLog, frame: bytes
) -> None:
    result = exchange(server.port, frame)
    _check_closed(result)
    for reply in plain_replies(result.reply):
        assert reply.code in (Code.SUCCESS, Code.FAIL)
    assert_unharmed(server, bystander, errors)


@HOSTILE
@given(frame=ext_frames())
def test_generated_extended_frames(
    server: LMServer, bystander: Bystander, errors: ErrorLog, frame: bytes
) -> None:
    result = exchange(server.port, frame)
    _check_closed(result)
    assert len(result.reply) >= HELLO_REPLY_BYTES, "no reply to the hello"
    assert wire.is_kvplug_hello(wire.unpack_plain_reply(result.reply[: wire.PLAIN_REPLY.size]))
    assert_unharmed(server, bystander, errors)


@HOSTILE
@given(
    prefix=st.sampled_from([b"", HELLO_REQUEST]),
    noise=st.binary(min_size=1, max_size=1024),
)
def test_random_bytes(
    server: LMServer, bystander: Bystander, errors: ErrorLog, prefix: bytes, noise: bytes
) -> None:
    result = exchange(server.port, prefix + noise)
    _check_closed(result)
    assert_unharmed(server, bystander, errors)


# -- named attacks --------------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 4, 35, 36, 100, 185])
def test_truncated_header_then_eof(
    server: LMServer, bystander: Bystander, errors: ErrorLog, size: int
) -> None:
    result = exchange(server.port, _plain(Command.GET, lm_key(1))[:size])
    assert result.closed and result.reply == b""
    assert_unharmed(server, bystander, errors)


def test_truncated_header_held_open_is_dropped(
    server: LMServer, bystander: Bystander, errors: ErrorLog
) -> None:
    with connect(server.port) as sock:
        sock.sendall(_plain(Command.GET, lm_key(1))[:100])
        result = read_until_closed(sock, timeout=FRAME_TIMEOUT + 30)
    assert result.closed and result.reply == b""
    assert_unharmed(server, bystander, errors)


@pytest.mark.parametrize("length", [MAX_OBJECT_BYTES + 1, wire.INT32_MAX, -1, -(2**31)], ids=str)
def test_put_with_oversized_or_negative_length(
    server: LMServer, bystander: Bystander, errors: ErrorLog, length: int
) -> None:
    key = lm_key(0x0BAD)
    rejected = protocol_errors(server.stats())
    frame = _plain(Command.PUT, key, length=length, dims=(max(length, 0), 0, 0, 0))
    result = exchange(server.port, frame + b"\0" * 4096)
    assert_rejected(result)
    assert protocol_errors(server.stats()) > rejected
    assert not plain_exists(server.port, key)
    assert_unharmed(server, bystander, errors)


def test_oversized_put_header_held_open_is_dropped(
    server: LMServer, bystander: Bystander, errors: ErrorLog
) -> None:
    """A 2 GiB PUT header and silence: dropped once it falls behind --min-rate, not after
    length / min_rate seconds (9 hours here) of discarding."""
    with connect(server.port) as sock:
        sock.sendall(_plain(Command.PUT, lm_key(0x0BAE), wire.INT32_MAX, dims=(1, 0, 0, 0)))
        result = read_until_closed(sock, timeout=3 * FRAME_TIMEOUT + 5)
    assert result.closed
    assert_unharmed(server, bystander, errors)


@pytest.mark.parametrize("command", [Command.GET, Command.EXIST, Command.HEALTH])
def test_request_without_payload_carrying_a_length(
    server: LMServer, bystander: Bystander, errors: ErrorLog, command: Command
) -> None:
    result = exchange(server.port, _plain(command, lm_key(1), length=16) + bytes(16))
    assert_rejected(result)
    assert_unharmed(server, bystander, errors)


@pytest.mark.parametrize("command", [0, 6, 99, -1, wire.INT32_MAX, -(2**31)], ids=str)
def test_unknown_plain_command(
    server: LMServer, bystander: Bystander, errors: ErrorLog, command: int
) -> None:
    result = exchange(server.port, _plain(command, lm_key(1)), half_close=False)
    assert_rejected(result)
    assert_unharmed(server, bystander, errors)


@pytest.mark.parametrize("op", [0, 9, 99, 0xFFFF], ids=str)
def test_unknown_extended_op(
    server: LMServer, bystander: Bystander, errors: ErrorLog, op: int
) -> None:
    with connect(server.port) as sock:
        hello(sock)
        sock.sendall(wire.pack_ext_request(op, request_id=5, key=lm_key(1)))
        reply = wire.unpack_ext_reply(recv_exact(sock, wire.EXT_REPLY.size))
        assert reply.request_id == 5
        assert reply.status in (Status.BAD_REQUEST, Status.UNSUPPORTED)
    assert_unharmed(server, bystander, errors)


@pytest.mark.parametrize(
    ("fmt", "dtype"), [(9, 6), (-1, 6), (wire.INT32_MAX, 6), (0, 9), (0, -1), (0, 1 << 20)]
)
def test_plain_put_with_bad_format_or_dtype(
    server: LMServer, bystander: Bystander, errors: ErrorLog, fmt: int, dtype: int
) -> None:
    key = lm_key(0xF0 + abs(fmt % 7) + abs(dtype % 5))
    payload = bytes(range(256)) * 4
    with bystander.quiet():
        before = _objects(server)
        frame = _plain(Command.PUT, key, len(payload), fmt, dtype, (len(payload), 0, 0, 0))
        result = exchange(server.port, frame + payload, half_close=False)
        assert_rejected(result)
        assert _objects(server) == before
    assert not plain_exists(server.port, key)
    assert_unharmed(server, bystander, errors)


def test_extended_put_with_bad_meta(
    server: LMServer, bystander: Bystander, errors: ErrorLog
) -> None:
    key = lm_key(0xBADE7A)
    payload = b"x" * 64
    bad_metas = [
        wire.META.pack(9, 0, 1) + wire.DIM.pack(64),  # unknown format
        wire.META.pack(0, 0, 1) + wire.DIM.pack(-64),  # negative dim
        wire.META.pack(0, 0, 3) + wire.DIM.pack(64),  # rank 3, one dim
        b"\x01",
    ]
    for meta in bad_metas:
        with connect(server.port) as sock:
            hello(sock)
            sock.sendall(
                wire.pack_ext_request(
                    Op.PUT,
                    request_id=1,
                    key=key,
                    meta=meta,
                    payload_len=len(payload),
                    checksum=wire.checksum(payload),
                )
                + payload
            )
            result = read_until_closed(sock, timeout=30)
        assert result.reply, f"no reply to a PUT with meta {meta.hex()}"
        status = wire.unpack_ext_reply(result.reply[: wire.EXT_REPLY.size]).status
        assert status == Status.BAD_REQUEST, meta.hex()
        assert not plain_exists(server.port, key)
    assert_unharmed(server, bystander, errors)


def test_extended_put_with_wrong_checksum_stores_nothing(
    server: LMServer, bystander: Bystander, errors: ErrorLog
) -> None:
    key = lm_key(0xC5C5)
    payload = b"y" * 1000
    with connect(server.port) as sock:
        hello(sock)
        sock.sendall(
            wire.pack_ext_request(
                Op.PUT,
                request_id=3,
                key=key,
                meta=wire.pack_meta(wire.Meta(0, 0, (1000,))),
                payload_len=len(payload),
                checksum=wire.checksum(payload) ^ 1,
            )
            + payload
        )
        reply = wire.unpack_ext_reply(recv_exact(sock, wire.EXT_REPLY.size))
    assert reply.status == Status.BAD_CHECKSUM
    assert not plain_exists(server.port, key)
    assert_unharmed(server, bystander, errors)


@pytest.mark.parametrize(
    "key",
    [
        b"",
        b"\xff\xfe@1@0@aa@half",
        b"model\x01@1@0@aa@half",
        b"model\x7f@1@0@aa@half",
        b"mo del@1@0@aa@half",
        b"\0" * wire.PLAIN_KEY_BYTES,
    ],
    ids=["empty", "not-utf8", "control", "del", "space", "nuls"],
)
@pytest.mark.parametrize("command", [Command.PUT, Command.GET, Command.EXIST])
def test_malformed_plain_key(
    server: LMServer, bystander: Bystander, errors: ErrorLog, key: bytes, command: Command
) -> None:
    payload = b"p" * 128 if command == Command.PUT else b""
    frame = _plain(command, key, len(payload), 0, 6, (len(payload), 0, 0, 0)) + payload
    with bystander.quiet():
        before = _objects(server)
        result = exchange(server.port, frame, half_close=False)
        assert_rejected(result)
        assert _objects(server) == before
    assert_unharmed(server, bystander, errors)


def test_extended_key_longer_than_the_server_allows(
    server: LMServer, bystander: Bystander, errors: ErrorLog
) -> None:
    with connect(server.port) as sock:
        limits = hello(sock)
        key = b"k" * (limits.max_key_bytes + 1)
        sock.sendall(wire.pack_ext_request(Op.GET, request_id=9, key=key))
        sock.shutdown(socket.SHUT_WR)
        result = read_until_closed(sock, timeout=30)
    reply = wire.unpack_ext_reply(result.reply[: wire.EXT_REPLY.size])
    assert reply.status in (Status.TOO_LARGE, Status.BAD_REQUEST)
    with connect(server.port) as sock:
        hello(sock)
        sock.sendall(
            wire.EXT_REQUEST.pack(wire.EXT_REQUEST_MAGIC, Op.GET, 0, 1, 2**32 - 1, 0, 0, 0)
        )
        result = read_until_closed(sock, timeout=30)
    assert_rejected(result)
    assert_unharmed(server, bystander, errors)


def test_extended_lengths_beyond_limits(
    server: LMServer, bystander: Bystander, errors: ErrorLog
) -> None:
    for meta_len, payload_len in [(2**32 - 1, 0), (14, 2**64 - 1), (14, MAX_OBJECT_BYTES + 1)]:
        with connect(server.port) as sock:
            hello(sock)
            sock.sendall(
                wire.EXT_REQUEST.pack(
                    wire.EXT_REQUEST_MAGIC, Op.PUT, 0, 1, 4, meta_len, payload_len, 0
                )
                + b"k@1@"
                + wire.pack_meta(wire.Meta(0, 0, (1,)))
            )
            sock.shutdown(socket.SHUT_WR)
            result = read_until_closed(sock, timeout=30)
        assert_rejected(result)
    assert_unharmed(server, bystander, errors)


def _trickle(sock: socket.socket, data: bytes, step: int, pause: float) -> int:
    """Send ``data`` ``step`` bytes at a time; how many bytes went before the server hung
    up (len(data) if it never did)."""
    sent = 0
    while sent < len(data):
        try:
            sock.sendall(data[sent : sent + step])
        except (BrokenPipeError, ConnectionResetError):
            return sent
        sent += step
        readable, _, _ = select.select([sock], [], [], pause)
        if readable:
            try:
                if sock.recv(1 << 16) == b"":
                    return sent
            except ConnectionResetError:
                return sent
    return len(data)


def test_slow_loris_header_is_dropped(
    server: LMServer, bystander: Bystander, errors: ErrorLog
) -> None:
    header = _plain(Command.GET, lm_key(2))
    with connect(server.port, timeout=60) as sock:
        sent = _trickle(sock, header, step=1, pause=FRAME_TIMEOUT / 10)
    assert sent < len(header), "a header trickled over 10 frame timeouts was never dropped"
    assert_unharmed(server, bystander, errors)


def test_payload_below_min_rate_is_dropped_and_freed(
    server: LMServer, bystander: Bystander, errors: ErrorLog
) -> None:
    key = lm_key(0x510)
    size = 256 << 10
    with connect(server.port, timeout=120) as sock:
        sock.sendall(_plain(Command.PUT, key, size, 0, 6, (size, 0, 0, 0)))
        # 1 KiB per 0.1 s is about 10 KiB/s, a sixth of the 64 KiB/s minimum: the whole
        # payload would take 25 s.
        sent = _trickle(sock, b"s" * size, step=1 << 10, pause=0.1)
    assert sent < size, "a payload sent at a sixth of --min-rate was never dropped"
    assert not plain_exists(server.port, key)
    assert_unharmed(server, bystander, errors)


def test_stalled_payload_is_dropped_within_a_few_frame_timeouts(
    server: LMServer, bystander: Bystander, errors: ErrorLog
) -> None:
    """A payload that stops arriving loses its preallocated buffer once it falls behind
    --min-rate, not at a deadline of length / min_rate computed up front."""
    size = MAX_OBJECT_BYTES  # 16 s at the 64 KiB/s minimum
    with connect(server.port) as sock:
        sock.sendall(_plain(Command.PUT, lm_key(0x57A1), size, 0, 6, (size, 0, 0, 0)))
        sock.sendall(b"z" * 1024)
        result = read_until_closed(sock, timeout=3 * FRAME_TIMEOUT + 5)
    assert result.closed
    assert_unharmed(server, bystander, errors)


def test_declared_exists_many_payload_does_not_allocate_outside_the_cap(
    strict: LMServer, errors: ErrorLog
) -> None:
    """A declared EXISTS_MANY length reserves no memory outside --max-memory before its bytes
    arrive (traced in process: the server runs on a thread here)."""
    declared = MAX_SMALL_PAYLOAD
    sockets: list[socket.socket] = []
    tracemalloc.start()
    try:
        refused_before = strict.stats()["protocol_errors"].get("bad_length", 0)
        baseline = tracemalloc.get_traced_memory()[0]
        for _ in range(4):
            sock = connect(strict.port)
            sockets.append(sock)
            hello(sock)
            sock.sendall(wire.pack_ext_request(Op.EXISTS_MANY, request_id=1, payload_len=declared))
        wait_until(lambda: tracemalloc.get_traced_memory()[0] - baseline > 2 * declared, timeout=2)
        grown = tracemalloc.get_traced_memory()[0] - baseline
        assert strict.stats()["protocol_errors"].get("bad_length", 0) == refused_before
    finally:
        tracemalloc.stop()
        for sock in sockets:
            sock.close()
    assert grown < declared, f"4 unsent EXISTS_MANY payloads of {declared} bytes took {grown}"
    assert_unharmed(strict, None, errors)


@pytest.mark.parametrize("how", ["fin", "reset"])
def test_client_vanishing_mid_payload(
    server: LMServer, bystander: Bystander, errors: ErrorLog, how: str
) -> None:
    key = lm_key(0xDEAD)
    size = MAX_OBJECT_BYTES // 2
    with bystander.quiet():
        before = _objects(server)
        sock = connect(server.port)
        sock.sendall(_plain(Command.PUT, key, size, 0, 6, (size, 0, 0, 0)))
        sock.sendall(b"v" * (size // 3))
        if how == "reset":
            hang_up_without_fin(sock)
        else:
            sock.close()
        assert wait_until(lambda: inflight_bytes(server.stats()) == 0), server.stats()
        assert _objects(server) == before
    assert not plain_exists(server.port, key)
    assert_unharmed(server, bystander, errors)


def test_extended_client_vanishing_mid_payload(
    server: LMServer, bystander: Bystander, errors: ErrorLog
) -> None:
    key = lm_key(0xDEAE)
    size = MAX_OBJECT_BYTES // 2
    sock = connect(server.port)
    hello(sock)
    sock.sendall(
        wire.pack_ext_request(
            Op.PUT,
            request_id=1,
            key=key,
            meta=wire.pack_meta(wire.Meta(0, 0, (size,))),
            payload_len=size,
        )
        + b"w" * (size // 4)
    )
    hang_up_without_fin(sock)
    assert not plain_exists(server.port, key)
    assert_unharmed(server, bystander, errors)


def test_connection_flood_beyond_max_connections(strict: LMServer, errors: ErrorLog) -> None:
    victim = connect(strict.port, timeout=30)
    plain_put(victim, lm_key(0xF1), b"before the flood" * 100)
    assert plain_get(victim, lm_key(0xF1)) == b"before the flood" * 100
    flood: list[socket.socket] = []
    try:
        for _ in range(24):
            try:
                flood.append(connect(strict.port, timeout=5))
            except OSError:
                continue
        health_request = _plain(Command.HEALTH, b"health@1@0@0@half")
        for sock in flood:
            try:
                sock.sendall(health_request)
            except OSError:
                continue
        answered = 0
        deadline = time.monotonic() + 15
        for sock in flood:
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                reply = recv_exact(sock, wire.PLAIN_REPLY.size)
            except OSError:
                continue
            answered += wire.unpack_plain_reply(reply).code == Code.SUCCESS
        # Six connections at most, the victim holds one.
        assert answered <= 5, f"{answered} flood connections were served beside the victim"
        payload = bytes(range(256)) * 300
        plain_put(victim, lm_key(0xF2), payload)
        assert plain_get(victim, lm_key(0xF2)) == payload
    finally:
        for sock in flood:
            sock.close()
        victim.close()
    assert_unharmed(strict, None, errors)


def test_idle_connection_is_closed(strict: LMServer, errors: ErrorLog) -> None:
    with connect(strict.port, timeout=60) as sock:
        sock.sendall(_plain(Command.HEALTH, b"health@1@0@0@half"))
        assert wire.unpack_plain_reply(recv_exact(sock, wire.PLAIN_REPLY.size)).code == 200
        result = read_until_closed(sock, timeout=60)
    assert result.closed and result.reply == b""
    assert_unharmed(strict, None, errors)


def test_busy_connection_outlives_the_idle_timeout(strict: LMServer, errors: ErrorLog) -> None:
    with connect(strict.port, timeout=60) as sock:
        started = time.monotonic()
        while time.monotonic() - started < 4.0:  # over twice the 1.5 s idle timeout
            sock.sendall(_plain(Command.EXIST, lm_key(7)))
            assert wire.unpack_plain_reply(recv_exact(sock, wire.PLAIN_REPLY.size)).code in (
                200,
                400,
            )
            time.sleep(0.2)
    assert_unharmed(strict, None, errors)


def test_health_answers_on_connections_next_to_hostile_ones(
    server: LMServer, bystander: Bystander, errors: ErrorLog
) -> None:
    """Half-sent frames held open on many connections do not slow the others down."""
    hostile = [connect(server.port) for _ in range(10)]
    try:
        for sock in hostile:
            sock.sendall(_plain(Command.PUT, lm_key(3), 4096, 0, 6, (4096, 0, 0, 0))[:50])
        assert alive(server.port)
        bystander.check()
    finally:
        for sock in hostile:
            sock.close()
    assert_unharmed(server, bystander, errors)
