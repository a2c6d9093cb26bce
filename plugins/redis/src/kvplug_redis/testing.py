"""Real Redis servers for tests: started as subprocesses on 127.0.0.1 and free ports, stopped
(killed) when the test is done, also when it fails.

* :class:`RedisServer`: one ``redis-server``, plain, TLS (certificates generated at start),
  with a unix socket, a password, ``maxmemory`` and a policy, or as a replica or cluster node.
* :class:`SentinelGroup`: a master, a replica and three sentinels (quorum 2), plain or all
  TLS, with :meth:`SentinelGroup.kill_master` for failover tests.
* :class:`RedisCluster`: three masters with the 16384 slots split between them.

Each is a context manager, and :class:`RedisServer` and :class:`RedisCluster` implement the
contract suite's ``ServerControl`` (``pause``, ``resume``, ``stop``, ``start``), so clause 10
runs against them. Binaries come from ``PATH`` and can be swapped
(``RedisServer(binary="valkey-server")``); the processes are controlled through redis-py's
synchronous client, which speaks to Valkey too. Every process is also killed when the
interpreter exits, and nothing binds to anything but 127.0.0.1.

In a test module::

    import pytest
    from kvplug_redis.testing import RedisServer

    @pytest.fixture(scope="module")
    def redis_server():
        with RedisServer() as server:      # killed at the end, also when a test fails
            yield server

    def test_something(redis_server):
        url = redis_server.url             # redis://127.0.0.1:<port>
"""

from __future__ import annotations

import abc
import atexit
import contextlib
import datetime
import ipaddress
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import quote

import redis

HOST = "127.0.0.1"
"""Every server binds here only."""
SLOTS = 16384

_live: set[subprocess.Popen[bytes]] = set()
_handed_out: set[int] = set()
_lock = threading.Lock()


@atexit.register
def _kill_leftovers() -> None:
    for process in list(_live):
        with contextlib.suppress(OSError):
            process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(5)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now and this process has not handed
    out before (two servers started in a row never get the same one)."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((HOST, 0))
            port: int = probe.getsockname()[1]
        with _lock:
            if port not in _handed_out:
                _handed_out.add(port)
                return port
    raise RuntimeError("no free TCP port found on 127.0.0.1 after 100 tries")


@dataclass(frozen=True)
class TLSFiles:
    """PEM files of a test certificate authority, a server and a client certificate."""

    ca_cert: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_tls_files(directory: Path | str) -> TLSFiles:
    """Generate a CA and, signed by it, a server certificate for 127.0.0.1 and localhost and a
    client certificate, into ``directory`` (needs the ``cryptography`` package)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    directory = Path(directory)
    now = datetime.datetime.now(datetime.timezone.utc)  # noqa: UP017 (3.10 has no datetime.UTC)

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    def write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        path.chmod(0o600)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("kvplug test CA"))
        .issuer_name(name("kvplug test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(common: str, usage: x509.ObjectIdentifier) -> tuple[x509.Certificate, Any]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(name(common))
            .issuer_name(ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(
                x509.SubjectAlternativeName(
                    [
                        x509.IPAddress(ipaddress.ip_address(HOST)),
                        x509.DNSName("localhost"),
                    ]
                ),
                critical=False,
            )
        )
        return builder.sign(ca_key, hashes.SHA256()), key

    server, server_key = leaf("127.0.0.1", ExtendedKeyUsageOID.SERVER_AUTH)
    client, client_key = leaf("kvplug test client", ExtendedKeyUsageOID.CLIENT_AUTH)
    files = TLSFiles(
        ca_cert=directory / "ca.pem",
        server_cert=directory / "server.pem",
        server_key=directory / "server.key",
        client_cert=directory / "client.pem",
        client_key=directory / "client.key",
    )
    files.ca_cert.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files.server_cert.write_bytes(server.public_bytes(serialization.Encoding.PEM))
    files.client_cert.write_bytes(client.public_bytes(serialization.Encoding.PEM))
    write_key(files.server_key, server_key)
    write_key(files.client_key, client_key)
    return files


def tls_config_lines(
    files: TLSFiles, port: int, *, auth_clients: bool, replication: bool = True
) -> list[str]:
    """Config lines for a TLS-only process (server or sentinel) on ``port``. With
    ``replication`` its outgoing connections (a replica to its master, also after a failover
    turns a master into a replica; a sentinel to the servers and to the other sentinels) use
    TLS too, presenting the client certificate, which a peer with ``tls-auth-clients yes``
    accepts (the server certificate is for server use only)."""
    return [
        "port 0",
        f"tls-port {port}",
        f"tls-cert-file {files.server_cert}",
        f"tls-key-file {files.server_key}",
        f"tls-client-cert-file {files.client_cert}",
        f"tls-client-key-file {files.client_key}",
        f"tls-ca-cert-file {files.ca_cert}",
        f"tls-auth-clients {'yes' if auth_clients else 'no'}",
        f"tls-replication {'yes' if replication else 'no'}",
    ]


def tls_client_settings(files: TLSFiles) -> dict[str, Any]:
    """redis-py client arguments for a process set up with ``files`` (client certificate
    included, so it also passes ``tls-auth-clients yes``)."""
    return {
        "ssl": True,
        "ssl_ca_certs": str(files.ca_cert),
        "ssl_certfile": str(files.client_cert),
        "ssl_keyfile": str(files.client_key),
    }


def tls_query(files: TLSFiles, *, client_certificate: bool) -> str:
    """The ``ssl_*`` query of a kvplug URL for a process set up with ``files``."""
    query = f"ssl_ca_certs={files.ca_cert}"
    if client_certificate:
        query += f"&ssl_certfile={files.client_cert}&ssl_keyfile={files.client_key}"
    return query


class ServerProcess(abc.ABC):
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
        self.process: subprocess.Popen[bytes] | None = None
        self.paused = False

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

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def log_path(self) -> Path:
        return self.workdir / "server.log"

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def start(self) -> None:
        """Start the process and return once it answers (ServerControl.start)."""
        if self.running:
            return
        for attempt in range(3):
            config = self.workdir / "server.conf"
            self.write_config(config)
            with self.log_path.open("ab") as log:
                self.process = subprocess.Popen(
                    self.argv(config),
                    cwd=self.workdir,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            _live.add(self.process)
            self.paused = False
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

    def stop(self) -> None:
        """Kill the process (SIGKILL, also when paused); the working directory stays, so
        :meth:`start` brings it back on the same port (ServerControl.stop)."""
        process, self.process = self.process, None
        self.paused = False
        if process is None:
            return
        with contextlib.suppress(OSError):
            process.kill()
        try:
            process.wait(10)
        finally:
            _live.discard(process)

    def pause(self) -> None:
        """SIGSTOP: the process keeps its port and connections but answers nothing."""
        if self.process is not None and self.running:
            self.process.send_signal(signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        """SIGCONT: undo :meth:`pause`."""
        if self.process is not None and self.running:
            self.process.send_signal(signal.SIGCONT)
            self.paused = False

    def close(self) -> None:
        """Kill the process and remove the working directory if this object made it."""
        self.stop()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> ServerProcess:
        try:
            self.start()
        except BaseException:
            self.close()  # a failed start leaves no working directory behind
            raise
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


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

    def __enter__(self) -> RedisServer:
        try:
            self.start()
        except BaseException:
            self.close()  # a failed start leaves no working directory (certificates) behind
            raise
        return self


DOWN_AFTER_MS = 2000
"""The sentinels' ``down-after-milliseconds``. Why not less: at 1000 a sentinel sometimes
starts a second failover of the master it has just promoted, about a second after the switch
(seen in 3 of 20 failovers on a busy machine), while the promoted master is still settling."""


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


class RedisCluster:
    """A Redis Cluster of ``masters`` nodes (3 by default) on 127.0.0.1, the 16384 slots split
    evenly, no replicas. :attr:`url` is ``redis+cluster://127.0.0.1:p1,127.0.0.1:p2,...``.
    ``extra_config`` lines (``{"proto-max-bulk-len": "1mb"}``) go to every node.

    ServerControl acts on every node at once; after :meth:`stop` and :meth:`start` the nodes
    come back on the same ports with their cluster configuration (not their data), and
    :meth:`start` returns once the cluster state is ``ok`` again.
    """

    scheme = "redis+cluster"

    def __init__(
        self,
        *,
        binary: str = "redis-server",
        masters: int = 3,
        password: str | None = None,
        node_timeout_ms: int = 2000,
        extra_config: Mapping[str, str] | None = None,
        startup_timeout: float = 20.0,
    ) -> None:
        if masters < 1:
            raise ValueError("a cluster needs at least one master")
        self.password = password
        self.startup_timeout = startup_timeout
        self.nodes = [
            RedisServer(
                binary=binary,
                password=password,
                cluster=True,
                cluster_node_timeout_ms=node_timeout_ms,
                extra_config=extra_config,
            )
            for _ in range(masters)
        ]
        self._formed = False

    @property
    def url(self) -> str:
        auth = f":{quote(self.password, safe='')}@" if self.password is not None else ""
        return f"{self.scheme}://{auth}" + ",".join(f"{HOST}:{n.port}" for n in self.nodes)

    def start(self) -> None:
        """Start every node; form the cluster the first time; wait for ``cluster_state:ok``."""
        try:
            for node in self.nodes:
                node.start()
            if not self._formed:
                self._form()
                self._formed = True
            self._wait_ok()
        except BaseException:
            if not self._formed:
                self.close()
            raise

    def _form(self) -> None:
        first, *rest = self.nodes
        with first.client() as client:
            for node in rest:
                client.execute_command("CLUSTER", "MEET", HOST, node.port, node.bus_port)
        share, extra = divmod(SLOTS, len(self.nodes))
        start = 0
        for index, node in enumerate(self.nodes):
            end = start + share + (1 if index < extra else 0) - 1
            with node.client() as client:
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", start, end)
            start = end + 1

    def _wait_ok(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while True:
            ok = 0
            for node in self.nodes:
                with (
                    contextlib.suppress(redis.RedisError, OSError),
                    node.client(socket_timeout=1) as client,
                ):
                    info = client.execute_command("CLUSTER", "INFO")
                    text = info.decode() if isinstance(info, bytes) else str(info)
                    fields = dict(line.split(":", 1) for line in text.split() if ":" in line)
                    if (
                        fields.get("cluster_state") == "ok"
                        and fields.get("cluster_known_nodes") == str(len(self.nodes))
                        and fields.get("cluster_slots_ok") == str(SLOTS)
                    ):
                        ok += 1
            if ok == len(self.nodes):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the cluster did not reach cluster_state:ok within {self.startup_timeout} "
                    f"s; a node's log ends with:\n{self.nodes[0].log_tail()}"
                )
            time.sleep(0.1)

    def pause(self) -> None:
        for node in self.nodes:
            node.pause()

    def resume(self) -> None:
        for node in self.nodes:
            node.resume()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def close(self) -> None:
        """Kill every node and remove the working directories."""
        for node in self.nodes:
            node.close()

    def __enter__(self) -> RedisCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = [
    "DOWN_AFTER_MS",
    "HOST",
    "RedisCluster",
    "RedisServer",
    "SentinelGroup",
    "SentinelProcess",
    "ServerProcess",
    "TLSFiles",
    "free_port",
    "make_tls_files",
    "tls_client_settings",
    "tls_config_lines",
    "tls_query",
]
