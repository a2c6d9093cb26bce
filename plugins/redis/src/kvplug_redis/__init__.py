"""kvplug-redis: the Redis tier, ``redis://host:6379``, ``rediss://``, ``unix:///path.sock``,
``redis+sentinel://h1:26379,h2:26379/mymaster`` (``rediss+sentinel://`` over TLS) and
``redis+cluster://h1:7000,h2:7001``.

See :class:`kvplug_redis.backend.RedisBackend`; :mod:`kvplug_redis.testing` starts real
servers for tests. The backend is imported on first use, so the plugin entry point stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvplug_redis.backend import ClientLibrary, RedisBackend, RedisOptions

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in ("ClientLibrary", "RedisBackend", "RedisOptions"):
        from kvplug_redis import backend

        return getattr(backend, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ClientLibrary", "RedisBackend", "RedisOptions", "__version__"]
