"""Entry point of kvplug-disk: declares the ``file://`` scheme. The backend module is imported
only when a ``file://`` URL is opened."""

from __future__ import annotations

from kvplug.hookspecs import BackendSpec, hookimpl


@hookimpl
def kvplug_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name="disk",
            schemes=("file",),
            factory="kvplug_disk.backend:DiskBackend",
            description="local-disk tier: one checksummed file per object, O_DIRECT, size cap "
            "with LRU/LFU/FIFO eviction, pins, sharded over several directories, persistent",
        )
    ]
