"""Entry point of kvplug-blackhole: declares the ``blackhole://`` scheme."""

from __future__ import annotations

from kvplug.hookspecs import BackendSpec, hookimpl


@hookimpl
def kvplug_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name="blackhole",
            schemes=("blackhole",),
            factory="kvplug_blackhole.backend:BlackholeBackend",
            description="accepts every put, stores nothing, always misses (overhead baseline)",
        )
    ]
