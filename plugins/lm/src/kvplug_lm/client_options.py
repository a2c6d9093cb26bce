"""The options of the ``lm://host:port`` client: its deadlines, connection pool, mode,
secret, checksums, back-off, key prefix and serde."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kvplug.options import BytesBackendOptions
from kvplug.tls import TLSOptions

Mode = Literal["auto", "plain", "extended"]


class LMOptions(BytesBackendOptions, TLSOptions):
    """Options of ``lm://host:port?name=value&...`` (and ``lms://``, the same over TLS).

    * ``timeout`` (seconds, default 10): the deadline of one operation; past it,
      :class:`~kvplug.errors.BackendTimeout`, and the connection it used is closed.
    * ``connections`` (default 8): the most connections the pool keeps to the server; a
      batch spreads over the idle ones.
    * ``connect_timeout`` (seconds, default 5): the limit of one connect and its hello.
    * ``mode`` (``auto``, ``plain`` or ``extended``; default ``auto``): ``auto`` sends the
      hello and uses the extended mode with a kvplug server, the plain mode with LMCache's;
      ``plain`` never sends it (LMCache's protocol only, also against a kvplug server);
      ``extended`` requires a kvplug server and fails at open against another.
    * ``secret``: the shared secret of a kvplug server started with one (extended mode).
      Only a proof of it travels (HMAC of the server's nonce); it is masked in every log,
      error and repr.
    * ``checksums`` (default true): the extended mode sends xxh3-64 of every payload (the
      server refuses a damaged one) and verifies the checksum of every payload read; a
      mismatch is a miss, counted in ``corrupt_objects``, and the key is deleted.
    * ``reconnect_delay`` (seconds, default 0.05) and ``reconnect_max_delay`` (default 2):
      after a failed connect, operations fail at once for this long (with jitter), doubling
      up to the maximum until the server answers again.
    * ``key_prefix`` (default empty): prepended to every key string on the wire, so several
      users of one server keep apart. In the plain mode it must keep the key LMCache's form
      (no ``@``, no whitespace), or LMCache's server drops the connection.
    * ``serde`` (default ``naive``) and its options, each with the ``serde_`` prefix
      (``?serde=zstd&serde_level=3``; gathered into ``serde_options``), as on every byte
      store: ``naive`` sends each object's own bytes, which LMCache's clients read; any other
      serde sends a kvplug frame, stored as LMCache's opaque bytes (format ``BINARY``) that
      only kvplug reads. Every reader decodes a frame with the serde it names.
    * ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``, ``ssl_cert_reqs`` (default
      ``required``), ``ssl_check_hostname`` (default true): ``lms://`` only, as on
      ``rediss://`` (:class:`kvplug.tls.TLSOptions`): the CA bundle the server's certificate
      is checked against, and the client certificate a server started with
      ``--tls-ca-cert-file`` requires.
    """

    connections: int = Field(8, ge=1, le=1024, description="the most pooled connections")
    connect_timeout: float = Field(5.0, gt=0, description="seconds of one connect and hello")
    mode: Mode = Field("auto", description="auto, plain or extended")
    secret: str | None = Field(None, repr=False, description="shared secret (extended mode)")
    checksums: bool = Field(True, description="xxh3 of every payload (extended mode)")
    reconnect_delay: float = Field(0.05, gt=0, description="first back-off after a failure")
    reconnect_max_delay: float = Field(2.0, gt=0, description="longest back-off")
    key_prefix: str = Field("", description="prepended to every key on the wire")


__all__ = ["LMOptions", "Mode"]
