"""Entry point of kvplug-mooncake: declares the ``mooncakestore://`` scheme. Mooncake's client
is imported only when such a URL is opened."""

from __future__ import annotations

from kvplug.hookspecs import BackendSpec, hookimpl


@hookimpl
def kvplug_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name="mooncake",
            schemes=("mooncakestore",),
            factory="kvplug_mooncake.backend:MooncakeBackend",
            description="Mooncake Store (mooncake_master), zero-copy from registered memory",
        )
    ]
