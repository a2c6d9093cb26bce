"""What ``kvplug lm-server`` is told: :class:`ServerOptions`, each field one command-line option.

A field's default, help text and kind (a size, seconds, a choice) are stated here once;
:mod:`kvplug_lm.command` builds the ``--option-name`` (and ``KVPLUG_LM_OPTION_NAME``) of each
field from them, so the command line and in-process servers share every default.

Example::

    >>> options = ServerOptions(port=0, max_memory=1 << 20)
    >>> options.plain_allowed, option_help("max_memory").startswith("Bytes of objects")
    (True, True)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from kvplug.units import GiB
from kvplug_lm import wire

DEFAULT_PORT = 65432
"""The port of an ``lm://host`` URL without one, and the server's (LMCache's examples use it)."""
HARD_KEY_LIMIT = 32 * 1024
"""Extended keys longer than this close the connection (they are not even read)."""


def _option(default: Any, text: str, *, size: bool = False, cli: bool = True) -> Any:
    """A field of :class:`ServerOptions`: its default and what its command-line option says.
    ``size``: the option takes sizes such as ``4GiB``; ``cli``: it has an option at all."""
    return field(default=default, metadata={"help": text, "size": size, "cli": cli})


@dataclass(frozen=True)
class ServerOptions:
    """Everything ``kvplug lm-server`` is told (each field is the option of the same name)."""

    host: str = _option("127.0.0.1", "Address to listen on.")
    port: int = _option(DEFAULT_PORT, "0 picks a free port (printed).")
    max_memory: int = _option(
        4 * GiB,
        "Bytes of objects kept in memory, in one buffer; least recently used ones go first.",
        size=True,
    )
    spill: str | None = _option(
        None, "kvplug tier URL evicted objects go to, e.g. file:///var/cache/kvplug-lm."
    )
    max_key_bytes: int = _option(
        1024, f"Longest extended key, at most {HARD_KEY_LIMIT} (plain keys: 150)."
    )
    max_object_bytes: int = _option(
        wire.INT32_MAX,
        "Largest object (plain clients: at most 2GiB - 1 whatever this says).",
        size=True,
    )
    idle_timeout: float = _option(300.0, "Seconds a connection may wait between requests.")
    frame_timeout: float = _option(10.0, "Seconds a started request header may take to arrive.")
    min_rate: int = _option(1 << 20, "Bytes per second a payload must at least move at.", size=True)
    max_connections: int = _option(1024, "Connections over this are accepted and closed at once.")
    secret: bytes | None = field(default=None, repr=False, metadata={"cli": False})
    """The shared secret of the extended mode's AUTH (never printed; the command reads it from
    ``--secret-file`` or ``KVPLUG_LM_SECRET``)."""
    plain: Literal["allow", "deny"] | None = _option(
        None, "Plain LMCache clients (default: allow without a secret, deny with one)."
    )
    metrics_port: int | None = _option(
        None, "Serve Prometheus metrics on 127.0.0.1 at this port (default: off)."
    )
    shutdown_grace: float = _option(
        30.0, "Seconds requests in flight may take to finish on SIGTERM."
    )
    loop: Literal["auto", "asyncio", "uvloop"] = _option("auto", "auto: uvloop when installed.")
    tls_cert_file: str | None = _option(
        None, "The server's TLS certificate (PEM, with its chain): clients connect with lms://."
    )
    tls_key_file: str | None = _option(None, "The key of --tls-cert-file (PEM).")
    tls_ca_cert_file: str | None = _option(
        None, "CA bundle (PEM): every client must present a certificate it signed."
    )

    @property
    def plain_allowed(self) -> bool:
        if self.plain is None:
            return self.secret is None
        return self.plain == "allow"

    def __post_init__(self) -> None:
        if not 1 <= self.max_key_bytes <= HARD_KEY_LIMIT:
            raise ValueError(
                f"max_key_bytes is {self.max_key_bytes}; it must be 1 to {HARD_KEY_LIMIT}."
            )
        for name in ("idle_timeout", "frame_timeout", "shutdown_grace"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive number of seconds.")
        if self.min_rate <= 0 or self.max_connections <= 0 or self.max_object_bytes <= 0:
            raise ValueError("min_rate, max_connections and max_object_bytes must be positive.")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError(
                "TLS needs both tls_cert_file and tls_key_file (the certificate and its key); "
                "give both, or neither for plain TCP."
            )
        if self.tls_ca_cert_file is not None and self.tls_cert_file is None:
            raise ValueError(
                "tls_ca_cert_file checks client certificates over TLS; give tls_cert_file and "
                "tls_key_file too."
            )

    @property
    def tls(self) -> bool:
        return self.tls_cert_file is not None


def option_help(name: str) -> str:
    """The help text of the field ``name``."""
    return str(_fields()[name].metadata["help"])


def command_line_fields() -> list[dataclasses.Field[Any]]:
    """The fields that are command-line options, in order."""
    return [f for f in dataclasses.fields(ServerOptions) if f.metadata.get("cli", True)]


def _fields() -> dict[str, dataclasses.Field[Any]]:
    return {f.name: f for f in dataclasses.fields(ServerOptions)}


__all__ = ["DEFAULT_PORT", "HARD_KEY_LIMIT", "ServerOptions", "command_line_fields", "option_help"]
