"""Entry point of kvplug itself: declares the ``store://`` scheme, so a whole tiers config
opens, wraps and is contract-tested like any backend (``store:///etc/kvplug.yaml``)."""

from __future__ import annotations

from kvplug.hookspecs import BackendSpec, hookimpl


@hookimpl
def kvplug_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name="store",
            schemes=("store",),
            factory="kvplug.runtime.store:Store",
            description="the tiered Store over a config file (store:///path/config.yaml)",
        )
    ]
