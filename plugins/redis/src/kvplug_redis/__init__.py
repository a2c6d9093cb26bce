"""kvplug-redis: the Redis tier, ``redis://host:6379``, ``rediss://``, ``unix:///path.sock``,
``redis+sentinel://h1:26379,h2:26379/mymaster`` (``rediss+sentinel://`` over TLS) and
``redis+cluster://h1:7000,h2:7001``.

See :class:`RedisBackend`. Its modules, one job each: :mod:`kvplug_redis.backend` (the data
path), :mod:`kvplug_redis.urls` (URL forms), :mod:`kvplug_redis.options`,
:mod:`kvplug_redis.client_library` (the client library seam), :mod:`kvplug_redis.connections`
(the clients of each event loop), :mod:`kvplug_redis.sentinel` (which server is master),
:mod:`kvplug_redis.direct` (reads straight into allocator memory), :mod:`kvplug_redis.pipeline`
(how values go on the wire), :mod:`kvplug_redis.failures` (the library's errors as kvplug's)
and :mod:`kvplug_redis.tls`. Real servers for tests are in the
separate distribution kvplug-testing (:mod:`kvplug_testing`).

The names below are the public API, the one other distributions may use (kvplug-valkey builds
on it): :class:`RedisBackend` to subclass, :class:`ClientLibrary` and :class:`ClientVersions`
to hand it another client library (as :func:`redis_py` does for redis-py),
:func:`load_client_library` to build one from a redis-py-shaped package, :class:`Mode` to map
schemes to, and :class:`RedisOptions`, :class:`Target`,
:class:`UrlForms`, :func:`escape_glob` and :data:`REDIS_PY_VERSIONS`. They are imported on first
use, so the plugin entry point stays light.
"""

from __future__ import annotations

import importlib.metadata
from typing import TYPE_CHECKING

from kvplug.lazy import lazy_exports

if TYPE_CHECKING:
    from kvplug_redis.backend import RedisBackend
    from kvplug_redis.client_library import (
        REDIS_PY_VERSIONS,
        ClientLibrary,
        ClientVersions,
        load_client_library,
        redis_py,
    )
    from kvplug_redis.options import RedisOptions
    from kvplug_redis.urls import Mode, Target, UrlForms, escape_glob

__version__ = importlib.metadata.version("kvplug-redis")


__getattr__ = lazy_exports(
    __name__,
    {
        "kvplug_redis.backend": ("RedisBackend",),
        "kvplug_redis.client_library": (
            "REDIS_PY_VERSIONS",
            "ClientLibrary",
            "ClientVersions",
            "load_client_library",
            "redis_py",
        ),
        "kvplug_redis.options": ("RedisOptions",),
        "kvplug_redis.urls": ("Mode", "Target", "UrlForms", "escape_glob"),
    },
)


__all__ = [
    "REDIS_PY_VERSIONS",
    "ClientLibrary",
    "ClientVersions",
    "Mode",
    "RedisBackend",
    "RedisOptions",
    "Target",
    "UrlForms",
    "__version__",
    "escape_glob",
    "load_client_library",
    "redis_py",
]
