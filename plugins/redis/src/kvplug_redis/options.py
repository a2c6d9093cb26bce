"""The options of the Redis schemes, and the groups of them that only some URL forms take.

Options come from the URL's query or from code and config (which win); :class:`RedisOptions`
validates them. The groups below let the backend refuse an option its URL form would ignore
(a TLS file on a plain ``redis://``, a Sentinel option without Sentinel) or must not log (a
password in the query).
"""

from __future__ import annotations

import os

from pydantic import Field, SecretStr, field_validator

from kvplug.options import BytesBackendOptions
from kvplug.tls import TLSOptions
from kvplug.units import parse_size
from kvplug.url import BackendURL


class RedisOptions(BytesBackendOptions, TLSOptions):
    """Options of the Redis schemes (query parameters or keyword options; keywords win); the
    ``ssl_*`` options (:class:`~kvplug.tls.TLSOptions`) are for the TLS schemes only."""

    key_prefix: str = Field(
        "kvplug:",
        description="prepended to every Redis key; one prefix per deployment or tenant",
    )
    ttl: float | None = Field(
        None, gt=0, description="seconds a stored chunk lives (SET ... PX); none by default"
    )
    max_connections: int = Field(
        256,
        ge=1,
        description="operations in flight at most (and connections per server, for the client "
        "library and for direct reads each)",
    )
    db: int | None = Field(
        None, ge=0, description="database number (default: the URL path /N, else 0)"
    )
    username: str | None = Field(None, description="ACL user (wins over the URL and env)")
    password: SecretStr | None = Field(None, description="password (wins over URL and env)")
    max_value_size: int = Field(
        512 << 20,
        description="largest frame a put sends; the server's proto-max-bulk-len, read at the "
        "first put, bounds it too",
    )
    read_from_replicas: bool = Field(
        False, description="Sentinel and Cluster: gets and contains may go to replicas"
    )
    direct_reads: bool = Field(
        True,
        description="read GET replies straight into allocator memory; off: through the client "
        "library (Cluster and read_from_replicas always read through it)",
    )
    direct_writes: bool = Field(
        True,
        description="send SET values from allocator memory on kvplug's own connections; off: "
        "through the client library (Cluster and TLS always write through it)",
    )
    sentinel_username: str | None = Field(None, description="Sentinel: user of the sentinels")
    sentinel_password: SecretStr | None = Field(
        None, description="Sentinel: password of the sentinels (default: REDIS_SENTINEL_PASSWORD)"
    )
    master_check_interval: float = Field(
        1.0,
        gt=0,
        description="Sentinel: seconds between questions to the sentinels about which server "
        "is master (also asked at every +switch-master and after a broken connection)",
    )

    @field_validator("max_value_size", mode="before")
    @classmethod
    def _parse_max_value_size(cls, value: object) -> int:
        return parse_size(value, what="redis max_value_size")


SECRET_OPTIONS = ("password", "sentinel_password")
"""Options that hold secrets: refused in a URL's query, which is logged unmasked."""
SENTINEL_OPTIONS = ("sentinel_username", "sentinel_password", "master_check_interval")
"""Options of the Sentinel schemes only."""


def credentials(
    options: RedisOptions, url: BackendURL, env_prefix: str
) -> tuple[str | None, str | None]:
    """(username, password): the options, else the URL, else the environment
    (``<env_prefix>_USERNAME``, ``<env_prefix>_PASSWORD``)."""
    env = os.environ
    username = options.username or url.username or env.get(f"{env_prefix}_USERNAME") or None
    if options.password is not None:
        password: str | None = options.password.get_secret_value()
    elif url.password is not None:
        password = url.password
    else:
        password = env.get(f"{env_prefix}_PASSWORD") or None
    return username, password


def sentinel_password(options: RedisOptions, env_prefix: str) -> str | None:
    """The sentinels' password: the option, else ``<env_prefix>_SENTINEL_PASSWORD``."""
    if options.sentinel_password is not None:
        return options.sentinel_password.get_secret_value()
    return os.environ.get(f"{env_prefix}_SENTINEL_PASSWORD") or None


__all__ = [
    "SECRET_OPTIONS",
    "SENTINEL_OPTIONS",
    "RedisOptions",
    "credentials",
    "sentinel_password",
]
