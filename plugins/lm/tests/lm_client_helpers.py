"""Test helpers of the lm:// client tests: a TCP proxy that damages one byte of what the
server sends, to provoke a checksum mismatch that no honest server produces."""

from __future__ import annotations

import contextlib
import socket
import threading
from types import TracebackType

from kvplug_testing.ports import HOST


class DamagingProxy:
    """Forwards each accepted connection to ``127.0.0.1:upstream_port``, byte for byte,
    except that after :meth:`damage_at` the byte at that offset of what the server sends next
    (counted from the arming) arrives with one bit flipped."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self._listener = socket.create_server((HOST, 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._target: int | None = None
        self._seen = 0
        self.damaged = threading.Event()
        self._sockets: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"lm://{HOST}:{self.port}"

    def damage_at(self, offset: int) -> None:
        with self._lock:
            self._target, self._seen = offset, 0
            self.damaged.clear()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection((HOST, self.upstream_port))
            self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, from_server: bool) -> None:
        with contextlib.suppress(OSError):
            while True:
                data = bytearray(source.recv(1 << 16))
                if not data:
                    break
                if from_server:
                    self._maybe_damage(data)
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def _maybe_damage(self, data: bytearray) -> None:
        with self._lock:
            if self._target is None:
                return
            position = self._target - self._seen
            self._seen += len(data)
            if 0 <= position < len(data):
                data[position] ^= 0x10
                self._target = None
                self.damaged.set()

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.close()

    def __enter__(self) -> DamagingProxy:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
