"""Real Redis servers for tests: :class:`RedisServer`, one ``redis-server`` (or
``valkey-server``) started as a subprocess on 127.0.0.1 and a free port, plain, TLS
(certificates generated at start), with a unix socket, a password, ``maxmemory`` and a policy,
or as a replica or cluster node; killed when the test is done, also when it fails, and when the
interpreter exits. :class:`ServerProcess` is the base of every process here (sentinels too).

:class:`RedisServer` implements the contract suite's ``ServerControl`` (``pause``,
``resume``, ``stop``, ``start``), so clause 10 runs against it. The processes are controlled
through redis-py's synchronous client, which speaks to Valkey too.

In a test module::

    import pytest
    from kvplug_testing import RedisServer

    @pytest.fixture(scope="module")
    def redis_server():
        with RedisServer() as server:      # killed at the end, also when a test fails
            yield server

    def test_something(redis_server):
        url = redis_server.url             # redis://127.0.0.1:<port>
"""

from __future__ import annotations

import abc
import contextlib
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

import redis

from kvplug_testing.ports import HOST, free_port
from kvplug_testing.process import ControlledProcess, start_process
from kvplug_testing.tls import (
    TLSFiles,
    make_tls_files,
    tls_client_settings,
    tls_config_lines,
    tls_query,
)


class ServerProcess(ControlledProcess, abc.ABC):
    """One server process with a config file in its own working directory. Subclasses write
    the config (:meth:`config_lines`) and say how to reach the process (:meth:`client`)."""

    def __init__(
        self,
        binary: str,
        *,
        workdir: Path | str | None = None,
        port: int | None = None,
        startup_timeout: float = 10.0,
    ) -> None:
        if shutil.which(binary) is None:
            raise FileNotFoundError(
                f"{binary!r} is not on PATH; install it (bash scripts/setup.sh installs "
                "Debian's redis-server, redis-sentinel and redis-tools)."
            )
        self.binary = binary
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="kvplug-redis-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._fixed_port = port is not None
        self.port = port if port is not None else free_port()
        self.startup_timeout = startup_timeout

    # -- what subclasses say ---------------------------------------------------------------------

    @abc.abstractmethod
    def config_lines(self) -> list[str]:
        """The config file's lines."""

    def write_config(self, path: Path) -> None:
        path.write_text("\n".join(self.config_lines()) + "\n")

    def argv(self, config: Path) -> list[str]:
        return [self.binary, str(config)]

    @abc.abstractmethod
    def client(self, **kwargs: Any) -> redis.Redis:
        """A synchronous redis-py client of this process, for set-up and checks."""

    def ready(self) -> bool:
        """Whether the process answers; called until true or ``startup_timeout``."""
        with self.client(socket_timeout=0.5, socket_connect_timeout=0.5) as client:
            return bool(client.ping())

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the process and return once it answers (ServerControl.start)."""
        if self.running:
            return
        for attempt in range(3):
            config = self.workdir / "server.conf"
            self.write_config(config)
            with self.log_path.open("ab") as log:
                self.launched(start_process(self.argv(config), self.workdir, log))
            if self._wait_ready():
                return
            in_use = "Address already in use" in self.log_tail(5)
            self.stop()
            if not in_use or self._fixed_port or attempt == 2:
                break
            self.port = free_port()  # another process took the port in between
        raise RuntimeError(
            f"{self.binary} on {HOST}:{self.port} did not come up within "
            f"{self.startup_timeout} s; its log ends with:\n{self.log_tail()}"
        )

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if not self.running:
                return False
            with contextlib.suppress(redis.RedisError, OSError):
                if self.ready():
                    return True
            time.sleep(0.05)
        return False

    def close(self) -> None:
        """Kill the process and remove the working directory if this object made it."""
        self.stop()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)


class RedisServer(ServerProcess):
    """One ``redis-server`` (or ``valkey-server``) on 127.0.0.1.

    * ``tls``: TLS only (``port 0``, ``tls-port``), with a CA and certificates generated at
      start in the working directory (:attr:`tls_files`), or those of ``tls_files`` to share
      one CA with other processes; ``tls_auth_clients`` asks for a client certificate too.
    * ``unix_socket``: also listen on ``<workdir>/redis.sock``; :attr:`url` is then
      ``unix://...``.
    * ``maxmemory`` (``"4mb"``) and ``policy`` (``noeviction``, ``allkeys-lru``, ...).
    * ``password``: ``requirepass``.
    * ``replica_of``: replicate another server (waits for the initial sync).
    * ``cluster``: a cluster node (``cluster-enabled yes``, its own bus port).
    * ``extra_config``: further config lines, name to value (``{"proto-max-bulk-len": "1mb"}``).
    """

    scheme = "redis"
    tls_scheme = "rediss"
    unix_scheme = "unix"

    def __init__(
        self,
        *,
        binary: str = "redis-server",
        tls: bool = False,
        tls_auth_clients: bool = False,
        tls_files: TLSFiles | None = None,
        unix_socket: bool = False,
        maxmemory: str | int | None = None,
        policy: str = "noeviction",
        password: str | None = None,
        replica_of: RedisServer | None = None,
        cluster: bool = False,
        cluster_node_timeout_ms: int = 2000,
        extra_config: Mapping[str, str] | None = None,
        workdir: Path | str | None = None,
        port: int | None = None,
        startup_timeout: float = 10.0,
    ) -> None:
        super().__init__(binary, workdir=workdir, port=port, startup_timeout=startup_timeout)
        self.tls = tls
        self.tls_auth_clients = tls_auth_clients
        self.unix_socket = unix_socket
        self.maxmemory = maxmemory
        self.policy = policy
        self.password = password
        self.replica_of = replica_of
        self.cluster = cluster
        self.cluster_node_timeout_ms = cluster_node_timeout_ms
        self.bus_port = free_port() if cluster else None
        self.extra_config = dict(extra_config or {})
        self.tls_files: TLSFiles | None = None
        if tls:
            self.tls_files = tls_files or make_tls_files(self.workdir)

    @property
    def socket_path(self) -> Path:
        return self.workdir / "redis.sock"

    @property
    def address(self) -> tuple[str, int]:
        return HOST, self.port

    def config_lines(self) -> list[str]:
        lines = [
            f"bind {HOST}",
            "daemonize no",
            f"dir {self.workdir}",
            'logfile ""',
            'save ""',
            "appendonly no",
            "repl-diskless-sync yes",
            "repl-diskless-sync-delay 0",
        ]
        if self.tls_files is not None:
            lines += tls_config_lines(
                self.tls_files,
                self.port,
                auth_clients=self.tls_auth_clients,
                replication=self.replica_of is None or self.replica_of.tls,
            )
        else:
            lines.append(f"port {self.port}")
        if self.unix_socket:
            lines += [f"unixsocket {self.socket_path}", "unixsocketperm 700"]
        if self.maxmemory is not None:
            lines += [f"maxmemory {self.maxmemory}", f"maxmemory-policy {self.policy}"]
        if self.password is not None:
            lines += [f'requirepass "{self.password}"', f'masterauth "{self.password}"']
        if self.replica_of is not None:
            lines.append(f"replicaof {HOST} {self.replica_of.port}")
        if self.cluster:
            lines += [
                "cluster-enabled yes",
                "cluster-config-file nodes.conf",
                f"cluster-node-timeout {self.cluster_node_timeout_ms}",
                f"cluster-port {self.bus_port}",
            ]
        lines += [f"{name} {value}" for name, value in self.extra_config.items()]
        return lines

    def client(self, **kwargs: Any) -> redis.Redis:
        settings: dict[str, Any] = {"password": self.password, **kwargs}
        if self.tls_files is not None:
            settings.update(tls_client_settings(self.tls_files))
        return redis.Redis(host=HOST, port=self.port, **settings)

    def ready(self) -> bool:
        with self.client(socket_timeout=0.5, socket_connect_timeout=0.5) as client:
            if not client.ping():
                return False
            if self.replica_of is not None:
                info = client.info("replication")
                return bool(info.get("master_link_status") == "up")
            return True

    @property
    def url(self) -> str:
        """The kvplug URL of this server (with its password, for tests)."""
        auth = f":{quote(self.password, safe='')}@" if self.password is not None else ""
        if self.unix_socket:
            return f"{self.unix_scheme}://{auth}{self.socket_path}"
        if self.tls_files is not None:
            query = tls_query(self.tls_files, client_certificate=self.tls_auth_clients)
            return f"{self.tls_scheme}://{auth}{HOST}:{self.port}?{query}"
        return f"{self.scheme}://{auth}{HOST}:{self.port}"


__all__ = ["RedisServer", "ServerProcess"]
