"""A recording stand-in for InfiniStore's client and server, for tests on machines without an
RDMA device (the InfiniStore server needs one to start).

:class:`RecordingConnection` has the method names and signatures of
``infinistore.InfinityConnection`` (every call is bound against the real class's signature
first) and checks its arguments as the real client takes them: a ``ClientConfig`` that passes
``verify()``, string keys, integer pointers into memory registered with ``register_mr`` (RDMA),
one block size per request. It keeps values in :class:`StandInServer` (a dict) and records
every call.

The server side follows InfiniStore's server: an RDMA write stores ``block_size`` bytes per
key and replaces the key when the transfer ends; an RDMA read fails the whole request with
``InfiniStoreKeyNotFound`` when one key is absent and with code 400 when a value is larger than
the block, and otherwise writes the value's bytes (only those) at the block's address;
``get_match_last_index`` binary-searches as the server does; a write into a full store evicts
the least recently used values first, and answers 507 only when the value cannot fit at all.

:class:`StandInServer` also listens on a loopback port (the backend probes it before
connecting) and can be paused, resumed, stopped and started like a process, for clause 10.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import inspect
import socket
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import infinistore  # type: ignore[import-untyped]
import numpy as np

REAL = infinistore.InfinityConnection


def _bind(name: str, *args: Any, **kwargs: Any) -> None:
    """Fail unless ``args``/``kwargs`` bind to the real ``InfinityConnection.<name>``."""
    signature = inspect.signature(getattr(REAL, name))
    signature.bind(None, *args, **kwargs)


class StandInServer:
    """The stored values, the listening port, and the server's state."""

    def __init__(self, capacity: int = 1 << 34) -> None:
        self.values: OrderedDict[str, bytes] = OrderedDict()
        self.capacity = capacity
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.lock = threading.Lock()
        self.running = threading.Event()
        self.running.set()
        self.stopped = False
        self.epoch = 0
        self._listener: socket.socket | None = None
        self._accepting: threading.Thread | None = None
        self.port = 0
        self._listen()

    # -- the port -----------------------------------------------------------------------------

    def _listen(self) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(128)
        self.port = listener.getsockname()[1]
        self._listener = listener
        # One name per port: a restart's thread replaces the stopped one's (the suite's leak
        # check tells them apart by name).
        self._accepting = threading.Thread(
            target=self._accept,
            args=(listener,),
            name=f"infinistore-standin-{self.port}",
            daemon=True,
        )
        self._accepting.start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            client.close()

    @property
    def url(self) -> str:
        return f"infinistore://127.0.0.1:{self.port}"

    # -- ServerControl ------------------------------------------------------------------------

    def pause(self) -> None:
        self.running.clear()

    def resume(self) -> None:
        self.running.set()

    def stop(self) -> None:
        with self.lock:
            self.stopped = True
            self.epoch += 1
            self.values.clear()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
            self._listener.close()
            self._listener = None
            if self._accepting is not None:
                self._accepting.join(5)
        self.running.set()

    def start(self) -> None:
        if self._listener is None:
            self._listen()
        with self.lock:
            self.stopped = False

    def close(self) -> None:
        self.stop()

    # -- what connections call ----------------------------------------------------------------

    def record(self, name: str, *args: Any) -> None:
        with self.lock:
            self.calls.append((name, args))

    def used(self) -> int:
        return sum(len(value) for value in self.values.values())

    def store(self, taken: dict[str, bytes]) -> None:
        """Store ``taken`` (under the lock), evicting the least recently used values first as
        InfiniStore's server does; 507 when the values cannot fit even in an empty store."""
        incoming = sum(len(value) for value in taken.values())
        if incoming > self.capacity:
            raise Exception("Failed to write to infinistore, ret = 507")
        for key in taken:
            self.values.pop(key, None)
        while self.values and self.used() + incoming > self.capacity:
            self.values.popitem(last=False)
        self.values.update(taken)

    def read(self, key: str) -> bytes | None:
        """The value of ``key`` (under the lock), now the most recently used."""
        value = self.values.get(key)
        if value is not None:
            self.values.move_to_end(key)
        return value

    def connection_factory(self) -> Callable[[Any], RecordingConnection]:
        return lambda config: RecordingConnection(config, self)


class RecordingConnection:
    """``infinistore.InfinityConnection``'s methods over a :class:`StandInServer`."""

    def __init__(self, config: Any, server: StandInServer) -> None:
        assert isinstance(config, infinistore.ClientConfig), type(config)
        config.verify()
        self.config = config
        self.server = server
        self.rdma_connected = False
        self.connected = False
        self.epoch = -1
        self.regions: list[tuple[int, int]] = []

    # -- checks -------------------------------------------------------------------------------

    def _enter(self, name: str, *args: Any) -> None:
        _bind(name, *args)
        self.server.record(name, *args)
        self.server.running.wait()
        if not self.connected:
            raise Exception("not connected")  # the real client's socket is not open
        if self.server.stopped or self.epoch != self.server.epoch:
            raise Exception(f"Failed to {name}: connection reset by peer")

    async def _enter_async(self, name: str, *args: Any) -> None:
        _bind(name, *args)
        self.server.record(name, *args)
        while not self.server.running.is_set():
            await asyncio.sleep(0.005)
        if not self.rdma_connected:
            raise Exception("this function is only valid for connected rdma")
        if self.server.stopped or self.epoch != self.server.epoch:
            raise Exception(f"Failed to {name}, ret = -1")

    def _check_blocks(self, blocks: Any, block_size: Any, ptr: Any) -> None:
        assert isinstance(blocks, list) and blocks, blocks
        for pair in blocks:
            assert isinstance(pair, tuple) and len(pair) == 2, pair
            assert isinstance(pair[0], str) and pair[0], pair
            assert isinstance(pair[1], int) and not isinstance(pair[1], bool) and pair[1] >= 0
        assert isinstance(block_size, int) and 0 < block_size < 1 << 31, block_size
        assert isinstance(ptr, int) and ptr != 0, ptr
        for _, offset in blocks:
            start, end = ptr + offset, ptr + offset + block_size
            assert any(base <= start and end <= base + size for base, size in self.regions), (
                f"block [{start:#x}, {end:#x}) is not in registered memory"
            )

    # -- the client's methods -----------------------------------------------------------------

    def connect(self) -> None:
        _bind("connect")
        self.server.record("connect")
        self.server.running.wait()
        if self.rdma_connected:
            raise Exception("Already connected to remote instance")
        if self.server.stopped:
            raise Exception("Failed to initialize remote connection")
        self.connected = True
        self.epoch = self.server.epoch
        if self.config.connection_type == infinistore.TYPE_RDMA:
            self.rdma_connected = True

    async def connect_async(self) -> None:
        _bind("connect_async")
        await asyncio.to_thread(self.connect)

    def close(self) -> None:
        _bind("close")
        self.server.record("close")
        self.connected = False
        self.rdma_connected = False

    def tcp_write_cache(self, key: str, ptr: int, size: int, **kwargs: Any) -> None:
        self._enter("tcp_write_cache", key, ptr, size)
        assert isinstance(key, str) and isinstance(ptr, int) and isinstance(size, int)
        if key == "":
            raise Exception("key is empty")
        if size == 0:
            raise Exception("size is 0")
        if ptr == 0:
            raise Exception("ptr is 0")
        value = ctypes.string_at(ptr, size)
        with self.server.lock:
            self.server.store({key: value})

    def tcp_read_cache(self, key: str, **kwargs: Any) -> np.ndarray[Any, Any]:
        self._enter("tcp_read_cache", key)
        assert isinstance(key, str)
        with self.server.lock:
            value = self.server.read(key)
        if value is None:
            raise Exception("Failed to get value, return code: 404")
        return np.frombuffer(value, dtype=np.uint8).copy()

    async def rdma_write_cache_async(
        self, blocks: list[tuple[str, int]], block_size: int, ptr: int
    ) -> int:
        await self._enter_async("rdma_write_cache_async", blocks, block_size, ptr)
        self._check_blocks(blocks, block_size, ptr)

        def transfer() -> int:
            taken = {key: ctypes.string_at(ptr + offset, block_size) for key, offset in blocks}
            with self.server.lock:
                self.server.store(taken)
            return 200

        return await asyncio.to_thread(transfer)

    async def rdma_read_cache_async(
        self, blocks: list[tuple[str, int]], block_size: int, ptr: int
    ) -> int:
        await self._enter_async("rdma_read_cache_async", blocks, block_size, ptr)
        self._check_blocks(blocks, block_size, ptr)

        def transfer() -> int:
            with self.server.lock:
                found = [self.server.read(key) for key, _ in blocks]
            if any(value is None for value in found):
                raise infinistore.InfiniStoreKeyNotFound("some keys not found")
            if any(len(value) > block_size for value in found if value is not None):
                raise Exception("Failed to read to infinistore, ret = 400")
            for (_, offset), value in zip(blocks, found, strict=True):
                assert value is not None
                ctypes.memmove(ptr + offset, value, len(value))
            return 200

        return await asyncio.to_thread(transfer)

    def check_exist(self, key: str) -> bool:
        self._enter("check_exist", key)
        assert isinstance(key, str)
        with self.server.lock:
            return key in self.server.values

    def get_match_last_index(self, keys: list[str]) -> int:
        self._enter("get_match_last_index", keys)
        assert isinstance(keys, list) and all(isinstance(key, str) for key in keys)
        left, right = 0, len(keys)
        with self.server.lock:
            while left < right:
                middle = (left + right) // 2
                if keys[middle] in self.server.values:
                    left = middle + 1
                else:
                    right = middle
        if left - 1 < 0:
            raise Exception("can't find a match")
        return left - 1

    def register_mr(self, arg: int, size: int | None = None) -> int:
        self._enter("register_mr", arg, size)
        assert isinstance(arg, int) and isinstance(size, int) and size > 0, (arg, size)
        if not self.rdma_connected:
            raise Exception("this function is only valid for connected rdma")
        self.regions.append((arg, size))
        return 0

    def delete_keys(self, keys: list[str]) -> int:
        self._enter("delete_keys", keys)
        assert isinstance(keys, list) and all(isinstance(key, str) for key in keys)
        with self.server.lock:
            return sum(self.server.values.pop(key, None) is not None for key in keys)


def check_signatures() -> list[str]:
    """Names of the real client's public methods the stand-in lacks (should be none)."""
    wanted = [
        name
        for name, member in inspect.getmembers(REAL)
        if not name.startswith("_") and callable(member)
    ]
    return [name for name in wanted if not hasattr(RecordingConnection, name)]
