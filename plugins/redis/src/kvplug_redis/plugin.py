"""Entry point of kvplug-redis: declares the Redis schemes.

Imported at discovery by every process that uses kvplug, so it imports nothing heavy: the
backend module and redis-py are imported only when one of these schemes is opened.
"""

from __future__ import annotations

from kvplug.hookspecs import BackendSpec, hookimpl


@hookimpl
def kvplug_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name="redis",
            schemes=(
                "redis",
                "rediss",
                "unix",
                "redis+sentinel",
                "redis-sentinel",
                "rediss+sentinel",
                "redis+cluster",
            ),
            factory="kvplug_redis.backend:RedisBackend",
            description="Redis: standalone, TLS, unix socket, Sentinel or Cluster (redis-py)",
        )
    ]
