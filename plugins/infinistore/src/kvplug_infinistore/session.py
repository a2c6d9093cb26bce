"""One connection to an InfiniStore server through InfiniStore's own client
(``infinistore.InfinityConnection``): the client's configuration, the threads its blocking
calls run on, the staging memory registered with it, and the return codes its errors carry."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

from kvplug.errors import BackendTimeout, BackendUnavailable, ConfigError
from kvplug.units import format_size

if TYPE_CHECKING:
    from kvplug.memory import FreeListAllocator
    from kvplug.url import BackendURL
    from kvplug_infinistore.options import InfiniStoreOptions

T = TypeVar("T")
logger = logging.getLogger(__name__)

ConnectionFactory = Callable[[Any], Any]
"""Builds a connection (an object with ``infinistore.InfinityConnection``'s methods) from an
``infinistore.ClientConfig``."""

# InfiniStore's return codes (its protocol.h), as its client puts them into messages.
CODE_INVALID_REQUEST = 400
CODE_KEY_NOT_FOUND = 404
CODE_OUT_OF_MEMORY = 507


def default_connection_factory(config: Any) -> Any:
    """``infinistore.InfinityConnection(config)``: the real client."""
    import infinistore  # type: ignore[import-untyped]

    return infinistore.InfinityConnection(config)


def client_config(options: InfiniStoreOptions, host: str, port: int) -> Any:
    """The ``infinistore.ClientConfig`` for ``options``."""
    import infinistore

    return infinistore.ClientConfig(
        host_addr=host,
        service_port=port,
        connection_type=(
            infinistore.TYPE_RDMA if options.connection_type == "rdma" else infinistore.TYPE_TCP
        ),
        dev_name=options.device,
        ib_port=options.ib_port,
        link_type=options.effective_link_type,
        log_level=options.log_level,
    )


def error_code(error: BaseException) -> int | None:
    """The InfiniStore return code in a client error's message (``ret = 507``), if any."""
    text = str(error)
    marker = "ret = "
    at = text.rfind(marker)
    if at < 0:
        return None
    digits = text[at + len(marker) :].split()[0].rstrip(".,") if text[at + len(marker) :] else ""
    try:
        return int(digits)
    except ValueError:
        return None


class ConnectionLost(BackendUnavailable):
    """A client call failed in a way that leaves the connection unusable."""


class Workers:
    """A few daemon threads that run the client's blocking calls. Not a ThreadPoolExecutor:
    its threads are joined when the interpreter exits, and a call stuck in InfiniStore's
    client (a server that accepted the connection and never answers) would then hang the
    exit of the whole process."""

    def __init__(self, count: int) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        self._count = count
        for number in range(count):
            threading.Thread(
                target=self._work, name=f"kvplug-infinistore-{number}", daemon=True
            ).start()

    def submit(self, job: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        self._jobs.put((job, future))
        return future

    def _work(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = job()
            except BaseException as error:
                future.set_exception(error)
            else:
                future.set_result(result)

    def shutdown(self) -> None:
        """Let the threads end once the jobs queued so far are done."""
        for _ in range(self._count):
            self._jobs.put(None)


class Session:
    """One connection to the server: the client object, the lock that keeps its blocking calls
    one at a time, the threads that run them, and (RDMA) the staging memory registered with
    it. A session that failed is dropped whole; a new one is built on the next operation."""

    def __init__(self, conn: Any, workers: int, staging: FreeListAllocator | None) -> None:
        self.conn = conn
        self.lock = threading.Lock()
        self.executor = Workers(workers)
        self.staging = staging
        self.base = int(staging.buffer.data_ptr()) if staging is not None else 0
        self.dropped = False

    async def call(self, function: Callable[..., T], *args: Any) -> T:
        """``function(*args)`` on one of the session's threads, under its lock."""

        def locked() -> T:
            with self.lock:
                return function(*args)

        return await asyncio.wrap_future(self.executor.submit(locked))

    def drop(self) -> None:
        """Stop using this connection: close it once its running call (if any) returns, and
        let its threads end."""
        if self.dropped:
            return
        self.dropped = True

        def close() -> None:
            with self.lock:
                try:
                    self.conn.close()
                except Exception as error:  # closing a broken connection may fail: harmless
                    logger.debug("closing an InfiniStore connection failed: %s", error)

        try:
            self.executor.submit(close)
        finally:
            self.executor.shutdown()


def server_name(host: str, port: int) -> str:
    """How messages name the server at ``host:port``."""
    return f"the InfiniStore server at {host}:{port}"


async def probe(host: str, port: int, limit: float) -> None:
    """A plain TCP connect to the server's port: fails fast where the client would hang."""
    where = server_name(host, port)
    try:
        async with asyncio.timeout(limit):
            _, writer = await asyncio.open_connection(host, port)
    except TimeoutError:
        raise BackendTimeout(
            f"connecting to {where} took longer than {limit} s (connect_timeout); "
            "the host is down or a firewall drops the packets. Check the host and port, or "
            "raise connect_timeout."
        ) from None
    except OSError as error:
        raise BackendUnavailable(
            f"cannot reach {where}: {error.strerror or error}. Start the server "
            f"(infinistore --service-port {port} ...) or fix the URL's host and port."
        ) from None
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


async def open_session(
    factory: ConnectionFactory, options: InfiniStoreOptions, host: str, port: int, url: BackendURL
) -> Session:
    """A new connection to the server, its staging memory registered (RDMA): the port probed
    first (:func:`probe`), then the client's connect, both within ``connect_timeout``."""
    await probe(host, port, options.connect_timeout)
    where = server_name(host, port)
    try:
        config = client_config(options, host, port)
        conn = factory(config)
    except Exception as error:
        raise ConfigError(
            f"InfiniStore's client refused the configuration for {url}: {error}. Fix "
            "the option it names."
        ) from None
    staging = None
    if options.connection_type == "rdma":
        from kvplug.memory import FreeListAllocator

        staging = FreeListAllocator(options.staging_size, sized_by="infinistore:// staging_size")
    session = Session(conn, options.workers, staging)
    limit = options.connect_timeout
    try:
        async with asyncio.timeout(limit):
            await session.call(conn.connect)
            if staging is not None:
                await session.call(conn.register_mr, session.base, staging.capacity)
    except TimeoutError:
        session.drop()
        raise BackendTimeout(
            f"{where} accepted the connection but did not complete InfiniStore's "
            f"handshake within {limit} s (connect_timeout); is it an InfiniStore server, "
            "and is it overloaded?"
        ) from None
    except Exception as error:
        session.drop()
        raise BackendUnavailable(
            f"connecting to {where} over {options.connection_type.upper()} "
            f"failed: {error}. {connect_fix(options)}"
        ) from None
    except BaseException:
        session.drop()
        raise
    return session


def connect_fix(options: InfiniStoreOptions) -> str:
    """What to check when a connect failed."""
    if options.connection_type == "rdma":
        return (
            f"Check that this host has the RDMA device {options.device!r} with port "
            f"{options.ib_port} active and link layer {options.effective_link_type} "
            "(ibv_devinfo), that the server runs with the same link type, and that "
            f"{format_size(options.staging_size)} of memory can be registered "
            "(ulimit -l); or use connection_type=tcp."
        )
    return "Check that the server is running and reachable from this host."


__all__ = [
    "CODE_INVALID_REQUEST",
    "CODE_KEY_NOT_FOUND",
    "CODE_OUT_OF_MEMORY",
    "ConnectionFactory",
    "ConnectionLost",
    "Session",
    "Workers",
    "client_config",
    "connect_fix",
    "default_connection_factory",
    "error_code",
    "open_session",
    "probe",
    "server_name",
]
