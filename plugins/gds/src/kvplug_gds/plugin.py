"""Entry point of kvplug-gds: declares ``gds://`` and ``weka://``. The backend module (and
cuFile) is imported only when such a URL is opened, so the plugin installs and is discovered
on machines without a GPU."""

from __future__ import annotations

from kvplug.hookspecs import BackendSpec, hookimpl


@hookimpl
def kvplug_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name="gds",
            schemes=("gds",),
            factory="kvplug_gds.backend:GdsBackend",
            description="GPUDirect Storage tier: cuFile moves chunks between GPU memory and "
            "files (file:// layout), shared by instances on one mount, persistent",
        ),
        BackendSpec(
            name="weka",
            schemes=("weka",),
            factory="kvplug_gds.backend:WekaBackend",
            description="GPUDirect Storage tier on a WekaFS mount (checked at open, O_DIRECT)",
        ),
    ]
