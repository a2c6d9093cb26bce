"""Mooncake Store for tests: :class:`MooncakeMaster` (Mooncake's own ``mooncake_master``) and
:class:`MooncakeNode` (a Mooncake client process that lends the store memory, as an inference
node does), each a subprocess on 127.0.0.1 and free ports.

Both implement the contract suite's ``ServerControl`` (``pause``, ``resume``, ``stop``,
``start``), so clause 10 runs against a real paused, killed and restarted master.

Mooncake listens beyond loopback whatever it is told: the master's HTTP metadata server and
every client's transfer endpoint bind all interfaces. :func:`isolated_network` says whether
this process runs in a network namespace of its own (scripts/isolated.sh, as scripts/test.sh
runs the Mooncake tests), where nothing outside can reach those ports.

In a test module::

    import pytest
    from kvplug_testing.mooncake import MooncakeMaster, MooncakeNode

    @pytest.fixture(scope="module")
    def mooncake():
        with MooncakeMaster() as master, MooncakeNode(master, "1GiB"):
            yield master              # master.url(global_segment_size=0), master.address
"""

from __future__ import annotations

import collections
import importlib.util
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from kvplug_testing.ports import HOST, free_port
from kvplug_testing.process import ControlledProcess

READY = "kvplug-mooncake-node ready"


def master_binary() -> str | None:
    """``mooncake_master`` of the installed Mooncake wheel (or on PATH), or None."""
    spec = importlib.util.find_spec("mooncake")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(folder) / "mooncake_master"
        if candidate.exists():
            return str(candidate)
    return shutil.which("mooncake_master")


ISOLATED_INTERFACES = frozenset({"lo", "kvplug0", "kvplug1"})
"""The interfaces of the network namespace scripts/isolated.sh makes: loopback and a veth
pair whose ends are both inside it (Mooncake's HTTP-metadata mode needs an address that is not
loopback)."""


def isolated_network() -> bool:
    """Whether this process runs in a network namespace of its own with no way out (only the
    interfaces of :data:`ISOLATED_INTERFACES`, as scripts/isolated.sh makes): then a port
    bound to all interfaces is reachable from inside it only."""
    return {name for _, name in socket.if_nameindex()} <= ISOLATED_INTERFACES


def _accepts(port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=timeout):
            return True
    except OSError:
        return False


class MooncakeMaster(ControlledProcess):
    """One ``mooncake_master`` on 127.0.0.1: its RPC port (:attr:`port`, what
    ``mooncakestore://`` URLs name) and metrics port are bound to loopback; with
    ``http_metadata=True`` it also runs its HTTP metadata server (:attr:`metadata_server`),
    which binds all interfaces.

    ``args`` are more flags (``--default_kv_lease_ttl=...``). ``client_ttl`` (seconds) is how
    long the master keeps the segments of a client it cannot ping; a pause of the master
    longer than that (a test's pause is a few seconds) makes its clients remount.
    """

    def __init__(
        self,
        args: Sequence[str] = (),
        *,
        http_metadata: bool = False,
        client_ttl: int = 30,
        startup_timeout: float = 30.0,
    ) -> None:
        binary = master_binary()
        if binary is None:
            raise RuntimeError(
                "mooncake_master not found: install mooncake-transfer-engine-non-cuda "
                "(scripts/setup.sh does)."
            )
        self.binary = binary
        self.host = HOST
        self.port = free_port()
        self.metrics_port = free_port()
        self.http_port = free_port() if http_metadata else None
        self.client_ttl = client_ttl
        self.args = list(args)
        self.startup_timeout = startup_timeout
        self.workdir = Path(tempfile.mkdtemp(prefix="kvplug-mooncake-"))

    @property
    def address(self) -> str:
        """``127.0.0.1:<rpc port>``: Mooncake's ``master_server_addr``."""
        return f"{self.host}:{self.port}"

    @property
    def metadata_server(self) -> str:
        """The HTTP metadata server's URL, or ``P2PHANDSHAKE`` without one."""
        if self.http_port is None:
            return "P2PHANDSHAKE"
        return f"http://{self.host}:{self.http_port}/metadata"

    def url(self, **options: object) -> str:
        """``mooncakestore://127.0.0.1:<port>`` with this master's metadata setting and
        ``options`` in its query."""
        query = {"metadata_server": self.metadata_server, **options}
        return f"mooncakestore://{self.address}?{urlencode(query)}"

    @property
    def argv(self) -> list[str]:
        argv = [
            self.binary,
            f"--rpc_address={self.host}",
            f"--rpc_port={self.port}",
            f"--metrics_host={self.host}",
            f"--metrics_port={self.metrics_port}",
            f"--client_ttl={self.client_ttl}",
        ]
        if self.http_port is not None:
            argv += [
                "--enable_http_metadata_server=true",
                f"--http_metadata_server_host={self.host}",
                f"--http_metadata_server_port={self.http_port}",
            ]
        return argv + self.args

    def start(self) -> None:
        """Start the master and return once its ports accept connections (ServerControl.start);
        it comes back on the same ports, without the objects it knew."""
        if self.running:
            return
        ports = [self.port] + ([self.http_port] if self.http_port is not None else [])
        self.launch_until(
            self.argv,
            lambda: all(_accepts(port) for port in ports),
            self.startup_timeout,
            f"listen on {self.address}",
        )


class MooncakeNode(ControlledProcess):
    """A Mooncake client process that lends ``segment`` (bytes or ``"1GiB"``) of memory to the
    store of ``master`` and does nothing else, so objects outlive the clients that put them:
    ``python -m kvplug_testing.mooncake MASTER METADATA SEGMENT``."""

    def __init__(
        self, master: MooncakeMaster, segment: int | str, *, startup_timeout: float = 60.0
    ) -> None:
        self.master = master
        self.segment = str(segment)
        self.startup_timeout = startup_timeout
        self.workdir = Path(tempfile.mkdtemp(prefix="kvplug-mooncake-node-"))

    @property
    def argv(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "kvplug_testing.mooncake",
            self.master.address,
            self.master.metadata_server,
            self.segment,
        ]

    def start(self) -> None:
        """Start the node and return once its segment is mounted."""
        if self.running:
            return
        self.log_path.unlink(missing_ok=True)
        self.launch_until(
            self.argv,
            lambda: READY in self.log_path.read_text(errors="replace"),
            self.startup_timeout,
            f"mount its segment in the store of {self.master.address}",
        )


def _serve(master: str, metadata: str, segment: str) -> int:
    """The node process: mount ``segment`` bytes in the store of ``master`` and wait."""
    from mooncake.store import MooncakeDistributedStore

    from kvplug.units import parse_size

    store = MooncakeDistributedStore()
    code = store.setup(
        {
            "local_hostname": HOST,
            "metadata_server": metadata,
            "global_segment_size": parse_size(segment, what="segment"),
            "local_buffer_size": 16 << 20,
            "protocol": "tcp",
            "master_server_addr": master,
        }
    )
    if code != 0:
        print(f"setup returned {code}", flush=True)
        return 1
    print(READY, flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(_serve(*sys.argv[1:4]))


class CountingStore:
    """Mooncake's client with every call made through it counted by name (put in place of a
    backend's client to see what each kvplug operation costs in store calls)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.calls: collections.Counter[str] = collections.Counter()

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.store, name)
        if not callable(attribute):
            return attribute

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return attribute(*args, **kwargs)

        return counted

    def taken(self) -> dict[str, int]:
        """The calls counted since the last look, and a fresh count."""
        calls = dict(self.calls)
        self.calls.clear()
        return calls


__all__ = [
    "ISOLATED_INTERFACES",
    "CountingStore",
    "MooncakeMaster",
    "MooncakeNode",
    "isolated_network",
    "master_binary",
]
