"""The contract suite's TCP fault proxy (kvplug_contracts.faultproxy): byte-exact forwarding,
each fault against a plain asyncio echo server and a real redis-server, bounded buffering, and
clause 10 of the suite run through ``--kvplug-proxy`` against redis://."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvplug_contracts.faultproxy import FaultProxy, upstream_of
from kvplug_contracts.suite import ServerControl
from kvplug_testing import RedisServer, free_port

T = TypeVar("T")
HOST = "127.0.0.1"
HANG = 0.5
"""Seconds a read waits before the test takes it for a hang (a hang is the expected outcome)."""
PATIENCE = 30.0
"""Seconds a read that must succeed may take, on a busy machine."""


class EchoServer:
    """An asyncio echo server on 127.0.0.1 with its own loop thread, counting what it got."""

    def __init__(self) -> None:
        self.received = 0
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._server = self._call(asyncio.start_server(self._echo, HOST, 0))
        self.address: tuple[str, int] = self._server.sockets[0].getsockname()[:2]

    def _call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(PATIENCE)

    async def _echo(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while data := await reader.read(1 << 16):
                self.received += len(data)
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    def close(self) -> None:
        async def shut_down() -> None:
            self._server.close()
            for writer in list(self._writers):
                writer.transport.abort()
            await asyncio.sleep(0)

        self._call(shut_down())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(PATIENCE)
        self._loop.close()


@pytest.fixture(autouse=True)
def no_complaint_from_asyncio(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """The proxy's loop logs nothing: no failed callback, no write to a closed connection."""
    yield
    records = [*caplog.get_records("setup"), *caplog.get_records("call"), *caplog.records]
    complaints = [r for r in records if r.name == "asyncio" and r.levelno >= logging.WARNING]
    assert not complaints, "\n".join(r.getMessage() for r in complaints)


@pytest.fixture
def echo() -> Iterator[EchoServer]:
    server = EchoServer()
    yield server
    server.close()


@pytest.fixture
def proxy(echo: EchoServer) -> Iterator[FaultProxy]:
    with FaultProxy(echo.address) as fault_proxy:
        yield fault_proxy


def connect(proxy: FaultProxy) -> socket.socket:
    return socket.create_connection(proxy.address, timeout=PATIENCE)


def receive(sock: socket.socket, size: int, timeout: float = PATIENCE) -> bytes:
    """Exactly ``size`` bytes (fewer only at end of stream)."""
    sock.settimeout(timeout)
    buffer = bytearray(size)
    view = memoryview(buffer)
    got = 0
    while got < size:
        count = sock.recv_into(view[got:])
        if not count:
            break
        got += count
    return bytes(buffer[:got])


def echoes(sock: socket.socket, data: bytes) -> bool:
    sock.sendall(data)
    return receive(sock, len(data)) == data


def hangs(sock: socket.socket) -> bool:
    """Whether a read gets nothing for HANG seconds."""
    sock.settimeout(HANG)
    try:
        sock.recv(1)
    except TimeoutError:
        return True
    return False


def is_reset(sock: socket.socket) -> bool:
    """Whether the peer reset the connection (a read raises ECONNRESET)."""
    sock.settimeout(PATIENCE)
    try:
        sock.recv(1)
    except ConnectionResetError:
        return True
    return False


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + PATIENCE
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {PATIENCE} s"
        time.sleep(0.02)


# -- forwarding ------------------------------------------------------------------------------


def test_64_mib_pass_both_ways_byte_exact(proxy: FaultProxy) -> None:
    payload = random.Random(7).randbytes(64 << 20)
    with connect(proxy) as sock:
        sender = threading.Thread(target=sock.sendall, args=(payload,))
        sender.start()
        echoed = receive(sock, len(payload))
        sender.join(PATIENCE)
    assert len(echoed) == len(payload)
    assert hashlib.sha256(echoed).digest() == hashlib.sha256(payload).digest()


def test_end_of_stream_passes_through(proxy: FaultProxy) -> None:
    with connect(proxy) as sock:
        assert echoes(sock, b"last words")
        sock.shutdown(socket.SHUT_WR)
        assert receive(sock, 1) == b""  # the echo server saw the end and closed


def test_many_concurrent_connections_each_get_their_own_bytes(proxy: FaultProxy) -> None:
    async def one(seed: int) -> bool:
        reader, writer = await asyncio.open_connection(*proxy.address)
        payload = random.Random(seed).randbytes(64 << 10)
        writer.write(payload)
        await writer.drain()
        echoed = await reader.readexactly(len(payload))
        writer.close()
        await writer.wait_closed()
        return echoed == payload

    async def all_at_once() -> list[bool]:
        return await asyncio.wait_for(asyncio.gather(*(one(n) for n in range(200))), PATIENCE)

    assert all(asyncio.run(all_at_once()))
    wait_until(lambda: proxy.connections == 0, "every closed connection to be let go")


def test_a_stalled_upstream_stops_the_client_instead_of_filling_memory() -> None:
    limit = 128 << 20  # far above what the kernel's socket buffers hold along the way
    chunk = bytes(1 << 20)
    with (
        socket.create_server((HOST, 0)) as stalled,  # accepts in the kernel, never reads
        FaultProxy(stalled.getsockname()[:2]) as proxy,
        connect(proxy) as sock,
    ):
        sock.setblocking(False)
        sent = 0
        last_progress = time.monotonic()
        while time.monotonic() - last_progress < 1.0:
            try:
                sent += sock.send(chunk)
                last_progress = time.monotonic()
            except BlockingIOError:
                time.sleep(0.05)
            assert sent < limit, f"the proxy took {sent} bytes that the upstream never read"


def test_an_unreachable_upstream_resets_the_client() -> None:
    with FaultProxy((HOST, free_port())) as proxy:
        try:
            sock = connect(proxy)
        except ConnectionResetError:
            return  # the reset came before connect() returned
        with sock:
            assert is_reset(sock)


# -- faults ----------------------------------------------------------------------------------


def test_pause_holds_bytes_and_new_connections_until_resume(proxy: FaultProxy) -> None:
    with connect(proxy) as before:
        assert echoes(before, b"ping")
        proxy.pause()
        assert proxy.paused
        before.sendall(b"held")
        assert hangs(before)
        with connect(proxy) as during:  # accepted, then nothing
            during.sendall(b"new")
            assert hangs(during)
            proxy.resume()
            assert receive(before, 4) == b"held"
            assert receive(during, 3) == b"new"


def test_stop_resets_connections_and_refuses_new_ones_until_start(proxy: FaultProxy) -> None:
    port = proxy.port
    with connect(proxy) as before:
        assert echoes(before, b"ping")
        proxy.stop()
        assert not proxy.listening
        assert is_reset(before)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(proxy.address, timeout=PATIENCE).close()
    proxy.start()
    assert proxy.port == port
    with connect(proxy) as after:
        assert echoes(after, b"back")


def test_stop_ends_a_pause_and_resets_the_connections_it_held(proxy: FaultProxy) -> None:
    proxy.pause()
    with connect(proxy) as held:
        held.sendall(b"waiting")
        assert hangs(held)
        proxy.drop()
        assert is_reset(held)
    proxy.start()
    assert not proxy.paused
    with connect(proxy) as after:
        assert echoes(after, b"fresh")


def test_reset_connections_keeps_listening(proxy: FaultProxy) -> None:
    with connect(proxy) as before:
        assert echoes(before, b"ping")
        proxy.reset_connections()
        assert is_reset(before)
    with connect(proxy) as after:
        assert echoes(after, b"still here")


def test_delay_holds_each_chunk_until_healed(proxy: FaultProxy) -> None:
    proxy.delay(0.3)
    with connect(proxy) as sock:
        started = time.monotonic()
        assert echoes(sock, b"slow")
        assert time.monotonic() - started >= 0.6  # the request and the reply each waited
        proxy.heal()
        assert echoes(sock, b"fast again")
    with pytest.raises(ValueError, match="seconds >= 0"):
        proxy.delay(-1)


def test_blackhole_swallows_everything_and_never_answers(
    proxy: FaultProxy, echo: EchoServer
) -> None:
    with connect(proxy) as before:
        assert echoes(before, b"ping")
        echoed = echo.received
        proxy.blackhole()
        before.sendall(bytes(32 << 20))  # swallowed, so it never blocks on a full buffer
        assert hangs(before)
        with connect(proxy) as during:
            during.sendall(b"hello?")
            assert hangs(during)
        assert echo.received == echoed
        proxy.clear()
        with connect(proxy) as after:
            assert echoes(after, b"healed")
        before.sendall(b"again")  # it lost bytes: it stays a black hole
        assert hangs(before)


def test_damage_reply_flips_one_bit_of_one_byte_the_server_sends_once(
    proxy: FaultProxy,
) -> None:
    payload = bytes(range(256)) * 4
    with connect(proxy) as sock:
        assert echoes(sock, b"before")  # bytes before the arming are not counted
        damaged = proxy.damage_reply(300)
        sock.sendall(payload)
        echoed = receive(sock, len(payload))
        assert damaged.is_set()
        assert [n for n in range(len(payload)) if echoed[n] != payload[n]] == [300]
        assert echoed[300] == payload[300] ^ 0x10
        assert echoes(sock, payload)  # once only


def test_heal_also_listens_again(proxy: FaultProxy) -> None:
    proxy.stop()
    proxy.heal()
    with connect(proxy) as sock:
        assert echoes(sock, b"ping")


# -- the object ------------------------------------------------------------------------------


def test_it_is_the_suites_server_control(proxy: FaultProxy) -> None:
    assert isinstance(proxy, ServerControl)


def test_close_frees_the_port_and_ends_the_thread(echo: EchoServer) -> None:
    threads_before = set(threading.enumerate())
    proxy = FaultProxy(echo.address)
    threads = set(threading.enumerate()) - threads_before
    with connect(proxy) as sock:
        assert echoes(sock, b"ping")
        proxy.close()
        proxy.close()
        assert is_reset(sock)
    assert threads and not any(thread.is_alive() for thread in threads)
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(proxy.address)  # nothing listens there any more
        listener.listen()
    with pytest.raises(RuntimeError, match="closed"):
        proxy.pause()


def test_url_for_points_a_url_at_the_proxy_and_keeps_the_rest() -> None:
    with FaultProxy("cache.internal:6379") as proxy:
        port = proxy.port
        assert (
            proxy.url_for("redis://app:s%40cret@cache.internal:6379/2?timeout=2&db=1")
            == f"redis://app:s%40cret@127.0.0.1:{port}/2?timeout=2&db=1"
        )
        assert (
            proxy.url_for("audit://?fail_rate=0::rediss://cache.internal:6379")
            == f"audit://?fail_rate=0::rediss://127.0.0.1:{port}"
        )
        with pytest.raises(ValueError, match="does not point at this proxy"):
            proxy.url_for("redis://other:6379")
        with pytest.raises(ValueError, match="names none"):
            proxy.url_for("redis://cache.internal/0")
        with pytest.raises(ValueError, match="names 2 hosts"):
            proxy.url_for("redis+cluster://cache.internal:6379,b:1")
        with pytest.raises(ValueError, match="names no host"):
            upstream_of("cpu://")


def test_repr_shows_addresses_and_faults_but_no_secret() -> None:
    url = "redis://app:s3cret-pw@cache.internal:6379/0?token=t0ken"
    with FaultProxy(upstream_of(url)) as proxy:
        proxy.url_for(url)
        proxy.pause()
        shown = repr(proxy)
    assert f"127.0.0.1:{proxy.port} -> cache.internal:6379" in shown and "paused" in shown
    assert "s3cret" not in shown and "t0ken" not in shown


def test_an_upstream_that_is_not_host_port_is_refused() -> None:
    with pytest.raises(ValueError, match="not host:port"):
        FaultProxy("cache.internal")


# -- against a real redis-server -------------------------------------------------------------


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


def redis_client(proxy: FaultProxy) -> redis.Redis:
    """A client that does not retry, so each fault shows at once."""
    return redis.Redis(
        HOST,
        proxy.port,
        socket_timeout=HANG,
        socket_connect_timeout=PATIENCE,
        retry=Retry(NoBackoff(), 0),
    )


@pytest.mark.redis
def test_redis_through_the_proxy_sees_each_fault(redis_server: RedisServer) -> None:
    value = random.Random(3).randbytes(16 << 20)
    with FaultProxy(redis_server.address) as proxy:
        with redis_client(proxy) as client:
            client.set("fault-proxy", value)
            assert client.get("fault-proxy") == value
            proxy.pause()
            with pytest.raises(redis.TimeoutError):
                client.get("fault-proxy")
            proxy.resume()
        with redis_client(proxy) as client:
            assert client.get("fault-proxy") == value
            proxy.stop()
            with pytest.raises(redis.ConnectionError):
                client.get("fault-proxy")
            proxy.start()
            assert client.get("fault-proxy") == value  # redis-py reconnects
            proxy.blackhole()
            with pytest.raises(redis.TimeoutError):
                client.get("fault-proxy")
            proxy.heal()
        with redis_client(proxy) as client:
            assert client.get("fault-proxy") == value


@pytest.mark.redis
@pytest.mark.slow
def test_the_suite_checks_clause_10_through_kvplug_proxy(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    summary = tmp_path / "summary.json"
    command = [
        sys.executable,
        "-m",
        "pytest",
        "--pyargs",
        "kvplug_contracts",
        "-p",
        "no:cacheprovider",
        "-q",
        "-W",
        "ignore::pytest.PytestAssertRewriteWarning",
        "--kvplug-url",
        redis_server.url,
        "--kvplug-proxy",
        "--kvplug-summary-json",
        str(summary),
        "-k",
        "while_paused or while_stopped",
    ]
    env = {k: v for k, v in os.environ.items() if k != "KVPLUG_CONTRACT_URL"}
    done = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    rows = {row["clause"]: row for row in json.loads(summary.read_text())}
    assert rows[10]["passed"] == 2 and rows[10]["n/a"] == 0 and rows[10]["failed"] == 0, output


def test_kvplug_proxy_without_a_host_and_port_is_a_usage_error(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "pytest", "--pyargs", "kvplug_contracts", "-p"]
    command += ["no:cacheprovider", "--kvplug-url", "cpu://", "--kvplug-proxy"]
    env = {k: v for k, v in os.environ.items() if k != "KVPLUG_CONTRACT_URL"}
    done = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == pytest.ExitCode.USAGE_ERROR, done.stdout + done.stderr
    assert "--kvplug-proxy" in done.stderr and "names no host" in done.stderr, done.stderr
