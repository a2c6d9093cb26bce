"""Entry point of kvplug-disk: declares ``file://``, ``gds://`` and ``weka://``. A backend
module is imported only when a URL of its scheme is opened, so ``file://`` and
``kvplug plugins`` never load cuFile, and the GDS schemes are discovered on machines without a
GPU."""

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
        ),
        BackendSpec(
            name="gds",
            schemes=("gds",),
            factory="kvplug_disk.gds.backend:GdsBackend",
            description="GPUDirect Storage tier: cuFile moves chunks between GPU memory and "
            "files (file:// layout), shared by instances on one mount, persistent",
        ),
        BackendSpec(
            name="weka",
            schemes=("weka",),
            factory="kvplug_disk.gds.backend:WekaBackend",
            description="GPUDirect Storage tier on a WekaFS mount (checked at open, O_DIRECT)",
        ),
    ]
