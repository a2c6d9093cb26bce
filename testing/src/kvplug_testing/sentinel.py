"""Sentinel groups for tests: a master, a replica and three sentinels on 127.0.0.1, plain or
all TLS, with :meth:`SentinelGroup.kill_master` for failover tests.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import redis

import kvplug
from kvplug.backend import Backend
from kvplug.errors import BackendTimeout, BackendUnavailable
from kvplug_testing.ports import HOST
from kvplug_testing.redis import RedisServer, ServerProcess
from kvplug_testing.tls import (
    TLSFiles,
    tls_client_settings,
    tls_config_lines,
    tls_query,
)

DOWN_AFTER_MS = 2000
"""The sentinels' ``down-after-milliseconds``. Why not less: at 1000 a sentinel sometimes
starts a second failover of the master it has just promoted, about a second after the switch
(seen in 3 of 20 failovers on a busy machine), while the promoted master is still settling."""


OPEN_ATTEMPTS = 3


async def open_backend_for_failover(url: str, *, timeout: float, **options: Any) -> Backend:
    """``kvplug.open_backend(url, timeout=timeout, **options)``, tried up to
    :data:`OPEN_ATTEMPTS` times while it times out or finds no master. A failover test measures
    a short ``timeout`` on what happens after the open; opening asks every sentinel and then the
    master, with TLS a handshake each, which on a loaded 2-core machine can overrun that
    deadline once without anything being wrong."""
    for _ in range(OPEN_ATTEMPTS - 1):
        with contextlib.suppress(BackendTimeout, BackendUnavailable):
            return await kvplug.open_backend(url, timeout=timeout, **options)
    return await kvplug.open_backend(url, timeout=timeout, **options)


class SentinelProcess(ServerProcess):
    """One sentinel watching ``service`` on ``master``. With ``tls_files`` it listens on TLS
    only and speaks TLS to the servers and to the other sentinels, asking its clients for a
    certificate (``tls-auth-clients yes``)."""

    def __init__(
        self,
        master: RedisServer,
        *,
        binary: str = "redis-sentinel",
        service: str = "mymaster",
        quorum: int = 2,
        down_after_ms: int = DOWN_AFTER_MS,
        failover_timeout_ms: int = 3000,
        tls_files: TLSFiles | None = None,
        startup_timeout: float = 10.0,
    ) -> None:
        super().__init__(binary, startup_timeout=startup_timeout)
        self.master = master
        self.service = service
        self.quorum = quorum
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.tls_files = tls_files

    def config_lines(self) -> list[str]:
        service = self.service
        if self.tls_files is not None:
            listen = tls_config_lines(self.tls_files, self.port, auth_clients=True)
        else:
            listen = [f"port {self.port}"]
        lines = [
            f"bind {HOST}",
            *listen,
            "daemonize no",
            f"dir {self.workdir}",
            'logfile ""',
            f"sentinel monitor {service} {HOST} {self.master.port} {self.quorum}",
            f"sentinel down-after-milliseconds {service} {self.down_after_ms}",
            f"sentinel failover-timeout {service} {self.failover_timeout_ms}",
            f"sentinel parallel-syncs {service} 1",
        ]
        if self.master.password is not None:
            lines.append(f'sentinel auth-pass {service} "{self.master.password}"')
        return lines

    def write_config(self, path: Path) -> None:
        # A sentinel rewrites its config file with what it learnt: write it only once.
        if not path.exists():
            super().write_config(path)

    def client(self, **kwargs: Any) -> redis.Redis:
        if self.tls_files is not None:
            kwargs = {**tls_client_settings(self.tls_files), **kwargs}
        return redis.Redis(host=HOST, port=self.port, **kwargs)


def _wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"waited {timeout} s for {what}")
        time.sleep(0.1)


class SentinelGroup:
    """A Sentinel-managed master: one master, one replica and three sentinels (quorum 2,
    ``down-after-milliseconds`` :data:`DOWN_AFTER_MS`), all on 127.0.0.1. :attr:`url` is
    ``redis+sentinel://127.0.0.1:s1,127.0.0.1:s2,127.0.0.1:s3/mymaster``.

    With ``tls`` every process listens on TLS only and asks for a client certificate, the
    servers replicate and the sentinels talk to the servers and to each other over TLS, all
    with certificates of one CA generated at start (:attr:`tls_files`); :attr:`url` is then
    ``rediss+sentinel://...?ssl_ca_certs=...&ssl_certfile=...&ssl_keyfile=...``, and the
    processes' ``client()`` s speak TLS.

    :meth:`kill_master` kills whichever server the sentinels call master now; they promote
    the replica. Start waits until the replica is in sync and every sentinel knows the
    replica and the two other sentinels, so a failover can happen at once.
    """

    scheme = "redis+sentinel"
    tls_scheme = "rediss+sentinel"
    sentinel_class: type[SentinelProcess] = SentinelProcess
    """The class that runs each sentinel; kvplug-valkey's adds ``--sentinel`` to the argv."""

    def __init__(
        self,
        *,
        binary: str = "redis-server",
        sentinel_binary: str = "redis-sentinel",
        service: str = "mymaster",
        password: str | None = None,
        sentinels: int = 3,
        quorum: int = 2,
        down_after_ms: int = DOWN_AFTER_MS,
        failover_timeout_ms: int = 3000,
        tls: bool = False,
        startup_timeout: float = 20.0,
    ) -> None:
        self.service = service
        self.password = password
        self.startup_timeout = startup_timeout
        self.master = RedisServer(binary=binary, password=password, tls=tls, tls_auth_clients=tls)
        self.tls_files = self.master.tls_files
        """The one CA and certificates of every process (the master's), None without TLS."""
        self.replica = RedisServer(
            binary=binary,
            password=password,
            replica_of=self.master,
            tls=tls,
            tls_auth_clients=tls,
            tls_files=self.tls_files,
        )
        self.sentinels = [
            self.sentinel_class(
                self.master,
                binary=sentinel_binary,
                service=service,
                quorum=quorum,
                down_after_ms=down_after_ms,
                failover_timeout_ms=failover_timeout_ms,
                tls_files=self.tls_files,
            )
            for _ in range(sentinels)
        ]

    @property
    def servers(self) -> list[RedisServer]:
        return [self.master, self.replica]

    @property
    def url(self) -> str:
        auth = f":{quote(self.password, safe='')}@" if self.password is not None else ""
        hosts = ",".join(f"{HOST}:{s.port}" for s in self.sentinels)
        if self.tls_files is not None:
            query = tls_query(self.tls_files, client_certificate=True)
            return f"{self.tls_scheme}://{auth}{hosts}/{self.service}?{query}"
        return f"{self.scheme}://{auth}{hosts}/{self.service}"

    def start(self) -> None:
        try:
            self.master.start()
            self.replica.start()
            for sentinel in self.sentinels:
                sentinel.start()
            self._wait_until_watched()
        except BaseException:
            self.close()
            raise

    def _wait_until_watched(self) -> None:
        others = len(self.sentinels) - 1
        deadline = time.monotonic() + self.startup_timeout
        while True:
            states = []
            for sentinel in self.sentinels:
                with (
                    contextlib.suppress(redis.RedisError, OSError),
                    sentinel.client(socket_timeout=1) as client,
                ):
                    state = client.sentinel_master(self.service)
                    states.append(
                        int(state.get("num-slaves", 0)) >= 1
                        and int(state.get("num-other-sentinels", 0)) >= others
                    )
            if len(states) == len(self.sentinels) and all(states):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the sentinels did not all see the replica and each other within "
                    f"{self.startup_timeout} s; a sentinel log ends with:\n"
                    f"{self.sentinels[0].log_tail()}"
                )
            time.sleep(0.1)

    def named_masters(self) -> list[tuple[str, int] | None]:
        """The master's address as each running sentinel names it (None: it did not answer)."""
        named: list[tuple[str, int] | None] = []
        for sentinel in self.sentinels:
            if not sentinel.running:
                continue
            answer = None
            with (
                contextlib.suppress(redis.RedisError, OSError),
                sentinel.client(socket_timeout=1) as client,
            ):
                host, port = client.sentinel_get_master_addr_by_name(self.service)
                answer = (host.decode() if isinstance(host, bytes) else str(host)), int(port)
            named.append(answer)
        return named

    def master_address(self) -> tuple[str, int]:
        """The master's address, as the first sentinel that answers reports it."""
        for answer in self.named_masters():
            if answer is not None:
                return answer
        raise RuntimeError("no sentinel answers")

    def server_at(self, address: tuple[str, int]) -> RedisServer:
        for server in self.servers:
            if server.address == address:
                return server
        raise LookupError(f"no server of this group listens on {address}")

    def kill_master(self) -> tuple[str, int]:
        """Kill the current master (SIGKILL) and return its address."""
        address = self.master_address()
        self.server_at(address).stop()
        return address

    def pause_master(self) -> tuple[str, int]:
        """Pause the current master (SIGSTOP) and return its address; the sentinels promote
        the replica once ``down-after-milliseconds`` pass. :meth:`resume_all` resumes it."""
        address = self.master_address()
        self.server_at(address).pause()
        return address

    def resume_all(self) -> None:
        """Resume every paused server (SIGCONT)."""
        for server in self.servers:
            if server.paused:
                server.resume()

    def planned_failover(self, timeout: float = 30.0) -> tuple[str, int]:
        """``SENTINEL FAILOVER``: promote the replica while the master stays up; returns the
        old master's address. Retried while a sentinel refuses (``NOGOODSLAVE`` right after
        start, ``INPROG`` during another failover)."""
        address = self.master_address()
        deadline = time.monotonic() + timeout
        while True:
            for sentinel in self.sentinels:
                if not sentinel.running:
                    continue
                with (
                    contextlib.suppress(redis.RedisError, OSError),
                    sentinel.client(socket_timeout=2) as client,
                ):
                    client.execute_command("SENTINEL", "FAILOVER", self.service)
                    return address
            if time.monotonic() > deadline:
                raise RuntimeError(f"no sentinel accepted SENTINEL FAILOVER within {timeout} s")
            time.sleep(0.2)

    def wait_until_all_name(self, address: tuple[str, int], timeout: float = 30.0) -> None:
        """Wait until every running sentinel names ``address`` master."""

        def all_name() -> bool:
            named = self.named_masters()
            return bool(named) and all(answer == address for answer in named)

        _wait_until(all_name, timeout, f"the sentinels to all name {address}")

    def wait_until_replica(self, address: tuple[str, int], timeout: float = 30.0) -> None:
        """Wait until the server at ``address`` reports the replica role (a deposed master
        that still runs is reconfigured by the sentinels about 10 s after the switch)."""
        server = self.server_at(address)

        def is_replica() -> bool:
            with contextlib.suppress(redis.RedisError, OSError), server.client() as client:
                role = client.execute_command("ROLE")[0]
                return (role.decode() if isinstance(role, bytes) else str(role)) == "slave"
            return False

        _wait_until(is_replica, timeout, f"{address} to become a replica")

    def wait_for_failover(self, old: tuple[str, int], timeout: float = 30.0) -> tuple[str, int]:
        """Wait until the sentinels name another master than ``old``; return it."""

        found: list[tuple[str, int]] = []

        def moved() -> bool:
            found[:] = [a for a in self.named_masters() if a is not None and a != old]
            return bool(found)

        _wait_until(moved, timeout, f"a failover away from {old}")
        return found[0]

    def close(self) -> None:
        """Kill every process and remove the working directories."""
        self.resume_all()
        for process in [*self.sentinels, *self.servers]:
            process.close()

    def __enter__(self) -> SentinelGroup:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["DOWN_AFTER_MS", "SentinelGroup", "SentinelProcess"]
