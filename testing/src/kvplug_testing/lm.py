"""lm:// servers for tests: :class:`LMServerProcess`, one ``kvplug lm-server`` (the default)
or LMCache 0.5.6's ``lmcache_server`` (:meth:`LMServerProcess.lmcache`), started as a
subprocess on 127.0.0.1 and a free port.

It implements the contract suite's ``ServerControl`` (``pause``, ``resume``, ``stop``,
``start``), so clause 10 runs against a real pause and a real restart on the same port.
Readiness is a plain HEALTH request answered 200, which both servers speak.

In a test module::

    import pytest
    from kvplug_testing.lm import LMServerProcess

    @pytest.fixture(scope="module")
    def lm_server():
        with LMServerProcess(["--max-memory", "256MiB"]) as server:
            yield server                   # server.url is lm://127.0.0.1:<port>
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import struct
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from kvplug_testing.ports import HOST, free_port
from kvplug_testing.process import ControlledProcess
from kvplug_testing.tls import TLSFiles, tls_query

# A plain HEALTH request (command 5, zeros, an LMCache key) and the size of its reply, written
# out here so that this module needs neither kvplug_lm nor lmcache.
_HEALTH = struct.pack("<9i150s", 5, 0, 1, 2, 0, 0, 0, 0, 0, b"health@1@0@0@half".ljust(150))
_REPLY_BYTES = 36


def health(
    port: int, host: str = HOST, timeout: float = 0.5, tls: ssl.SSLContext | None = None
) -> bool:
    """Whether an lm:// server on ``host:port`` answers a plain HEALTH with 200 (over TLS with
    the client context ``tls``)."""
    try:
        with contextlib.ExitStack() as stack:
            sock = stack.enter_context(socket.create_connection((host, port), timeout=timeout))
            if tls is not None:
                sock = stack.enter_context(tls.wrap_socket(sock, server_hostname=host))
            sock.sendall(_HEALTH)
            reply = b""
            while len(reply) < _REPLY_BYTES:
                chunk = sock.recv(_REPLY_BYTES - len(reply))
                if not chunk:
                    return False
                reply += chunk
    except OSError:
        return False
    code: int = struct.unpack_from("<i", reply)[0]
    return code == 200


class LMServerProcess(ControlledProcess):
    """One lm:// server process on 127.0.0.1.

    ``args``: extra arguments of ``python -m kvplug_lm.server`` (``--max-memory 64MiB``,
    ``--spill file:///...``); ``python``: the interpreter that runs it (this one by default);
    ``argv``: a whole command line instead, with ``{port}`` and ``{host}`` filled in (how
    :meth:`lmcache` starts LMCache's server); ``tls``: the server speaks TLS with these test
    certificates (:func:`kvplug_testing.tls.make_tls_files`), and with ``client_certificates``
    requires a client certificate their CA signed. Killed on :meth:`close`, also when a test
    fails, and when the interpreter exits.
    """

    def __init__(
        self,
        args: Sequence[str] = (),
        *,
        python: str | None = None,
        argv: Sequence[str] | None = None,
        port: int | None = None,
        startup_timeout: float = 180.0,
        tls: TLSFiles | None = None,
        client_certificates: bool = False,
    ) -> None:
        self.port = port if port is not None else free_port()
        self.host = HOST
        self.tls = tls
        if tls is not None:
            args = [
                *args,
                "--tls-cert-file",
                str(tls.server_cert),
                "--tls-key-file",
                str(tls.server_key),
            ]
            if client_certificates:
                args += ["--tls-ca-cert-file", str(tls.ca_cert)]
        self.startup_timeout = startup_timeout
        self.workdir = Path(tempfile.mkdtemp(prefix="kvplug-lm-"))
        self._argv = (
            list(argv)
            if argv is not None
            else [
                python or sys.executable,
                "-m",
                "kvplug_lm.server",
                "--host",
                "{host}",
                "--port",
                "{port}",
                *args,
            ]
        )

    @classmethod
    def lmcache(cls, python: str, **kwargs: object) -> LMServerProcess:
        """LMCache's own ``lmcache_server`` (``python -m lmcache.v1.server HOST PORT cpu``) run
        by ``python``, the interpreter of a venv with lmcache 0.5.6."""
        argv = [python, "-m", "lmcache.v1.server", "{host}", "{port}", "cpu"]
        return cls(argv=argv, **kwargs)  # type: ignore[arg-type]

    @property
    def url(self) -> str:
        """``lm://host:port``; with TLS ``lms://host:port`` and the options that trust the
        test CA and present the test client certificate."""
        if self.tls is None:
            return f"lm://{self.host}:{self.port}"
        return f"lms://{self.host}:{self.port}?" + tls_query(self.tls, client_certificate=True)

    def _answers(self) -> bool:
        if self.tls is None:
            return health(self.port, self.host)
        context = ssl.create_default_context(cafile=str(self.tls.ca_cert))
        context.load_cert_chain(self.tls.client_cert, self.tls.client_key)
        return health(self.port, self.host, tls=context)

    @property
    def argv(self) -> list[str]:
        return [part.format(host=self.host, port=self.port) for part in self._argv]

    def start(self) -> None:
        """Start the server and return once it answers HEALTH (ServerControl.start); it comes
        back on the same port."""
        if self.running:
            return
        self.launch_until(
            self.argv,
            self._answers,
            self.startup_timeout,
            f"answer on {self.host}:{self.port}",
        )


LMCACHE_ABSENT = (
    "LMCache 0.5.6's venv (.venv-lmcache-0.5.6, or KVPLUG_LMCACHE_PYTHON) is absent; "
    "scripts/setup-engines.sh builds it"
)
"""Why a test that needs LMCache 0.5.6's own ``lmcache_server`` or client is skipped."""


def lmcache_python() -> str | None:
    """The interpreter of the LMCache 0.5.6 venv scripts/setup-engines.sh builds
    (``.venv-lmcache-0.5.6`` at the repository root, or ``KVPLUG_LMCACHE_PYTHON``), or None."""
    import os

    named = os.environ.get("KVPLUG_LMCACHE_PYTHON")
    if named:
        return named if Path(named).exists() else None
    for parent in Path(__file__).resolve().parents:
        candidate = parent / ".venv-lmcache-0.5.6" / "bin" / "python"
        if candidate.exists():
            return str(candidate)
    return None


__all__ = ["LMCACHE_ABSENT", "LMServerProcess", "health", "lmcache_python"]
