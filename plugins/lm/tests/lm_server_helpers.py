"""Raw-socket clients of the lm server tests: every byte built and parsed through
:mod:`kvplug_lm.wire`, nothing hidden, so a test sees exactly what the server sends."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Sequence

from kvplug_lm import wire
from kvplug_testing.ports import HOST

TIMEOUT = 30.0
"""Seconds a test waits for a reply (generous: the tests run on busy 2-core machines)."""


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes from ``sock``; AssertionError when the peer closes first."""
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(min(n - len(data), 1 << 20))
        if not chunk:
            raise AssertionError(f"connection closed after {len(data)} of {n} bytes")
        data += chunk
    return bytes(data)


def closed_by_peer(sock: socket.socket, timeout: float = TIMEOUT) -> bool:
    """Whether the server closes ``sock`` (reads hit EOF or a reset) within ``timeout``;
    whatever it sends before that is skipped."""
    sock.settimeout(timeout)
    try:
        while sock.recv(1 << 16):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
    return True


def connect(port: int, *, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(TIMEOUT)
    sock.connect((HOST, port))
    return sock


def wait_for(condition: Callable[[], bool], what: str, timeout: float = TIMEOUT) -> None:
    """Poll ``condition`` until true; AssertionError naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


class PlainClient:
    """LMCache 0.5.6's plain protocol over one connection."""

    def __init__(self, port: int, **kwargs: int) -> None:
        self.sock = connect(port, **kwargs)

    def close(self) -> None:
        self.sock.close()

    def put(
        self,
        key: str | bytes,
        payload: bytes,
        *,
        fmt: int = 1,
        dtype: int = 2,
        shape: Sequence[int] = (),
        sync: bool = True,
    ) -> None:
        """A plain PUT (no reply); with ``sync``, followed by a HEALTH round trip so that
        the object is stored when this returns (a connection's requests run in order)."""
        header = wire.pack_plain_request(
            wire.Command.PUT,
            key,
            length=len(payload),
            fmt=fmt,
            dtype=dtype,
            shape=shape or (len(payload) // 2,),
        )
        self.sock.sendall(header + payload)
        if sync:
            assert self.request(wire.Command.HEALTH).code == wire.Code.SUCCESS

    def request(self, command: wire.Command, key: str | bytes = "m@1@0@0@half") -> wire.PlainReply:
        self.sock.sendall(wire.pack_plain_request(command, key))
        return self.reply()

    def reply(self) -> wire.PlainReply:
        return wire.unpack_plain_reply(recv_exact(self.sock, wire.PLAIN_REPLY.size))

    def get(self, key: str | bytes) -> tuple[wire.PlainReply, bytes | None]:
        reply = self.request(wire.Command.GET, key)
        if reply.code != wire.Code.SUCCESS:
            return reply, None
        return reply, recv_exact(self.sock, reply.length)

    def hello(self) -> wire.Hello:
        reply = self.request(wire.Command.HEALTH, wire.HELLO_KEY)
        assert wire.is_kvplug_hello(reply), reply
        return wire.unpack_hello_body(recv_exact(self.sock, reply.length))


class ExtClient(PlainClient):
    """The extended mode over one connection (opened with the hello)."""

    def __init__(self, port: int, **kwargs: int) -> None:
        super().__init__(port, **kwargs)
        self.server_hello = self.hello()
        self._next_id = 0

    def send(
        self,
        op: wire.Op,
        *,
        key: bytes = b"",
        meta: bytes = b"",
        payload: bytes = b"",
        checksum: int | None = None,
    ) -> int:
        """Write one request; its request id."""
        self._next_id += 1
        header = wire.pack_ext_request(
            op,
            request_id=self._next_id,
            key=key,
            meta=meta,
            payload_len=len(payload),
            checksum=checksum,
        )
        self.sock.sendall(header + payload)
        return self._next_id

    def receive(self) -> tuple[wire.ExtReply, bytes, bytes]:
        """One reply: its header, meta and payload."""
        reply = wire.unpack_ext_reply(recv_exact(self.sock, wire.EXT_REPLY.size))
        meta = recv_exact(self.sock, reply.meta_len)
        payload = recv_exact(self.sock, reply.payload_len)
        return reply, meta, payload

    def call(self, op: wire.Op, **kwargs: object) -> tuple[wire.ExtReply, bytes, bytes]:
        request_id = self.send(op, **kwargs)  # type: ignore[arg-type]
        reply = self.receive()
        assert reply[0].request_id == request_id
        return reply

    def put(  # type: ignore[override]
        self,
        key: bytes,
        payload: bytes,
        meta: wire.Meta | None = None,
        *,
        checksum: int | None = None,
    ) -> wire.ExtReply:
        meta = meta or wire.Meta(4, 6, (len(payload),))
        return self.call(
            wire.Op.PUT,
            key=key,
            meta=wire.pack_meta(meta),
            payload=payload,
            checksum=wire.checksum(payload) if checksum is None else checksum,
        )[0]

    def get(self, key: bytes) -> tuple[wire.ExtReply, wire.Meta | None, bytes]:  # type: ignore[override]
        reply, meta, payload = self.call(wire.Op.GET, key=key)
        return reply, (wire.unpack_meta(meta) if meta else None), payload


def key(n: int, model: str = "m") -> bytes:
    """An LMCache 0.5.x key string: ``model@world_size@worker_id@hexhash@dtype``."""
    return f"{model}@1@0@{n:x}@half".encode()


__all__ = [
    "TIMEOUT",
    "ExtClient",
    "PlainClient",
    "closed_by_peer",
    "connect",
    "key",
    "recv_exact",
    "wait_for",
]
