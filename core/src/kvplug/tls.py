"""TLS for backends and servers: the client options every TLS scheme takes, the contexts built
from them, and :class:`TLSChannel`, TLS over a socket a backend drives itself.

A backend whose URL scheme speaks TLS (``rediss://``, ``lms://``) adds :class:`TLSOptions` to
its options model, so every TLS scheme takes the same five options with the same meaning, and
builds its :class:`ssl.SSLContext` with :func:`client_context`. A PEM file that is missing or
unreadable fails there, naming the option, rather than later as an unreachable server.

A backend that sends and receives with the event loop's ``sock_sendall`` and
``sock_recv_into`` (to read straight into allocator memory) keeps doing so over TLS through
:class:`TLSChannel`: the records go through the same socket calls and are decrypted into the
caller's buffer.

Example::

    >>> from kvplug.options import BackendOptions
    >>> class MyOptions(TLSOptions, BackendOptions):
    ...     pass
    >>> options = MyOptions(ssl_cert_reqs="none")
    >>> client_context(options).verify_mode == ssl.CERT_NONE
    True
    >>> try:
    ...     client_context(MyOptions(ssl_ca_certs="/nonexistent.pem"))
    ... except TLSFilesError as error:
    ...     print(error)
    ssl_ca_certs '/nonexistent.pem' is not a readable file. Give the path of a PEM file.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kvplug.errors import ConfigError

CertReqs = Literal["required", "optional", "none"]

TLS_FILE_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
"""The options that name PEM files."""

RECORD_READ = 64 * 1024
"""Bytes of TLS records one receive takes from the socket at most."""
PEM_FIX = "Give the path of a PEM file."
WRITE_CHUNK = 256 * 1024
"""Bytes of plaintext encrypted before they are sent, so a large payload is never held twice
whole."""


class TLSFilesError(ConfigError):
    """A PEM file of the TLS options is missing, unreadable or not what its option needs:
    ``fact`` says which, ``fix`` what to give instead."""

    def __init__(self, fact: str, fix: str) -> None:
        super().__init__(f"{fact}. {fix}")
        self.fact = fact
        self.fix = fix


class TLSOptions(BaseModel):
    """The client options of every TLS scheme (mix into a backend's options model)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ssl_ca_certs: str | None = Field(
        None, description="TLS: CA bundle (PEM) the server's certificate is checked against"
    )
    ssl_certfile: str | None = Field(
        None, description="TLS: client certificate (PEM), for servers that require one"
    )
    ssl_keyfile: str | None = Field(None, description="TLS: the client certificate's key (PEM)")
    ssl_cert_reqs: CertReqs = Field(
        "required", description="TLS: how the server certificate is checked"
    )
    ssl_check_hostname: bool = Field(True, description="TLS: the certificate must name the host")


def check_tls_files(options: TLSOptions) -> None:
    """Raise :class:`TLSFilesError` naming the first PEM option whose file is not readable."""
    for name in TLS_FILE_OPTIONS:
        path = getattr(options, name)
        if path is not None and not Path(path).is_file():
            raise TLSFilesError(f"{name} {path!r} is not a readable file", PEM_FIX)


def client_context(options: TLSOptions) -> ssl.SSLContext:
    """The :class:`ssl.SSLContext` of a client with ``options``: the server's certificate
    checked against ``ssl_ca_certs`` (the system's CAs without it) as ``ssl_cert_reqs`` and
    ``ssl_check_hostname`` say, and ``ssl_certfile``/``ssl_keyfile`` presented when given."""
    check_tls_files(options)
    verify = {
        "required": ssl.CERT_REQUIRED,
        "optional": ssl.CERT_OPTIONAL,
        "none": ssl.CERT_NONE,
    }[options.ssl_cert_reqs]
    try:
        context = ssl.create_default_context(cafile=options.ssl_ca_certs)
        context.check_hostname = options.ssl_check_hostname and verify != ssl.CERT_NONE
        context.verify_mode = verify
        if options.ssl_certfile is not None:
            context.load_cert_chain(options.ssl_certfile, options.ssl_keyfile)
    except (ssl.SSLError, OSError) as error:
        raise TLSFilesError(
            f"the TLS files could not be loaded ({error})",
            "Give PEM files: ssl_ca_certs a CA bundle, ssl_certfile and ssl_keyfile the "
            "client certificate and its key.",
        ) from None
    return context


def server_context(
    cert_file: str, key_file: str, client_ca_file: str | None = None
) -> ssl.SSLContext:
    """The :class:`ssl.SSLContext` of a server presenting ``cert_file`` (PEM, with its chain)
    and ``key_file``; with ``client_ca_file``, every client must present a certificate signed
    by one of its CAs."""
    for option, path in (
        ("certificate", cert_file),
        ("key", key_file),
        ("client CA", client_ca_file),
    ):
        if path is not None and not Path(path).is_file():
            raise TLSFilesError(f"the TLS {option} file {path!r} is not a readable file", PEM_FIX)
    try:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(cert_file, key_file)
        if client_ca_file is not None:
            context.load_verify_locations(cafile=client_ca_file)
            context.verify_mode = ssl.CERT_REQUIRED
    except (ssl.SSLError, OSError) as error:
        raise TLSFilesError(
            f"the server's TLS files could not be loaded ({error})",
            "Give the server's certificate and its key as PEM files (and the client CA "
            "bundle as PEM).",
        ) from None
    return context


class TLSChannel:
    """TLS over a connected non-blocking socket, driven with the event loop's ``sock_*``
    calls: :meth:`recv_into` and :meth:`sendall` behave as ``loop.sock_recv_into`` and
    ``loop.sock_sendall`` do on a plain socket, with the records encrypted and decrypted in
    between (:class:`ssl.SSLObject` over memory buffers). One reader and one writer at a time.

    :meth:`handshake` first; a failed handshake or a damaged record raises
    :class:`ssl.SSLError` (an :class:`OSError`)."""

    def __init__(
        self,
        sock: socket.socket,
        context: ssl.SSLContext,
        *,
        server_side: bool = False,
        server_hostname: str | None = None,
    ) -> None:
        self.sock = sock
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._tls = context.wrap_bio(
            self._incoming,
            self._outgoing,
            server_side=server_side,
            server_hostname=server_hostname,
        )
        self._records = bytearray(RECORD_READ)

    @property
    def version(self) -> str | None:
        """The TLS version agreed (``"TLSv1.3"``), None before the handshake."""
        return self._tls.version()

    def peer_certificate(self) -> dict[str, object] | None:
        """The peer's certificate as :meth:`ssl.SSLSocket.getpeercert` gives it, if checked."""
        return self._tls.getpeercert()  # type: ignore[return-value]

    async def handshake(self) -> None:
        """Run the TLS handshake; :class:`ConnectionResetError` if the peer leaves midway."""
        while True:
            try:
                self._tls.do_handshake()
            except ssl.SSLWantReadError:
                await self._flush()
                if not await self._fill():
                    raise ConnectionResetError(
                        "the peer closed the connection during the TLS handshake"
                    ) from None
            except ssl.SSLError:
                with contextlib.suppress(OSError):
                    await self._flush()  # the alert that tells the peer why
                raise
            else:
                await self._flush()
                return

    async def sendall(self, data: bytes | bytearray | memoryview) -> None:
        """Encrypt ``data`` and send all of it."""
        view = memoryview(data).cast("B")
        for start in range(0, len(view), WRITE_CHUNK):
            self._tls.write(view[start : start + WRITE_CHUNK])
            await self._flush()

    async def recv_into(self, view: memoryview) -> int:
        """Decrypt at least one byte into ``view`` (waiting for it) and return how many;
        0 once the peer closed the connection."""
        if not len(view):
            return 0
        while True:
            try:
                count: int = self._tls.read(len(view), view)  # type: ignore[assignment]
                return count  # with a buffer, read returns how many bytes it wrote
            except ssl.SSLWantReadError:
                await self._flush()  # what the peer's records asked for (a key update)
                if not await self._fill():
                    return 0
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return 0

    async def _flush(self) -> None:
        data = self._outgoing.read()
        if data:
            await asyncio.get_running_loop().sock_sendall(self.sock, data)

    async def _fill(self) -> bool:
        count = await asyncio.get_running_loop().sock_recv_into(self.sock, self._records)
        if count == 0:
            self._incoming.write_eof()
            return False
        self._incoming.write(memoryview(self._records)[:count])
        return True

    def close(self) -> None:
        """Close the socket (no close_notify: the peer sees the connection end)."""
        self.sock.close()


__all__ = [
    "TLS_FILE_OPTIONS",
    "CertReqs",
    "TLSChannel",
    "TLSFilesError",
    "TLSOptions",
    "check_tls_files",
    "client_context",
    "server_context",
]
