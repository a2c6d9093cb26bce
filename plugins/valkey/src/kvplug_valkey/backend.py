"""The Valkey tier: KV-cache chunks as Valkey strings, through valkey-py's asyncio client.

URL forms (options go in the query or in code/config, which win)::

    valkey://[user[:password]@]host[:port][/db]          one server (port 6379 by default)
    valkeys://host:6380?ssl_ca_certs=/etc/ca.pem         the same over TLS
    valkey+sentinel://[user[:password]@]h1:26379,h2:26379/mymaster
                                                         a Sentinel-managed master
    valkeys+sentinel://h1:26379,h2:26379/mymaster?ssl_ca_certs=/etc/ca.pem
                                                         the same, TLS to the sentinels and
                                                         to the servers they name
    valkey+cluster://[user[:password]@]h1:7000,h2:7001   a Valkey Cluster

Valkey speaks Redis' protocol and valkey-py is a fork of redis-py with the same API, so this
backend is :class:`kvplug_redis.RedisBackend` with valkey-py's classes handed in
(:func:`valkey_py`), its own schemes and its own environment variables. Everything else, the
storage layout (one key per chunk holding kvplug's whole frame, written by one ``SET``),
pipelined batches, deadlines, the bound on operations in flight, reconnects, failover,
``CapacityExceeded`` from a full server or for a value over its ``proto-max-bulk-len``, and the
check of the client library's version at creation (:data:`VALKEY_PY_VERSIONS`), is the Redis
tier's: see ``docs/redis.md``.

**Credentials** come from the options, then the URL, then the ``VALKEY_USERNAME`` and
``VALKEY_PASSWORD`` environment variables (Sentinel: ``VALKEY_SENTINEL_PASSWORD``; the
default service name ``VALKEY_SERVICE_NAME``); they are never logged.

A unix socket is reached through kvplug-redis' ``unix://`` (redis-py speaks to Valkey too):
one scheme is served by one plugin.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from kvplug_redis import (
    ClientLibrary,
    ClientVersions,
    Mode,
    RedisBackend,
    load_client_library,
)

VALKEY_PY_VERSIONS = ClientVersions(
    plugin="kvplug-valkey", distribution="valkey", lowest=(6,), below=7
)
"""valkey-py 6.x (the suites pass on 6.0.2, 6.1.1 and 6.2.0); the backend refuses other
versions when it is created, as :data:`kvplug_redis.REDIS_PY_VERSIONS` does for
redis-py."""


def valkey_py() -> ClientLibrary:
    """valkey-py's asyncio client (libvalkey parses replies when it is installed:
    ``pip install "kvplug-valkey[fast]"``)."""
    return load_client_library("valkey-py", "valkey", "Valkey", VALKEY_PY_VERSIONS)


class ValkeyBackend(RedisBackend):
    """A shared, persistent byte store on Valkey: standalone, TLS, Sentinel or Cluster, chosen
    by the URL's scheme, through valkey-py. Options, atomicity, failure behaviour and
    capabilities are those of :class:`~kvplug_redis.RedisBackend`.

    Example (with a valkey-server listening on 127.0.0.1:6379)::

        backend = await kvplug.open_backend("valkey://127.0.0.1:6379", key_prefix="llama:")
    """

    schemes: ClassVar[Mapping[str, Mode]] = {
        "valkey": Mode.STANDALONE,
        "valkeys": Mode.TLS,
        "valkey+sentinel": Mode.SENTINEL,
        "valkeys+sentinel": Mode.SENTINEL,
        "valkey+cluster": Mode.CLUSTER,
    }
    tls_schemes: ClassVar[frozenset[str]] = frozenset({"valkeys", "valkeys+sentinel"})
    env_prefix: ClassVar[str] = "VALKEY"
    """Environment variables: ``VALKEY_USERNAME``, ``VALKEY_PASSWORD``,
    ``VALKEY_SENTINEL_PASSWORD``, ``VALKEY_SERVICE_NAME``."""

    @classmethod
    def client_library(cls) -> ClientLibrary:
        return valkey_py()


__all__ = ["VALKEY_PY_VERSIONS", "ValkeyBackend", "valkey_py"]
