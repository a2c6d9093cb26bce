"""Entry point of kvplug-lm: declares the ``lm://`` scheme. The client is imported only when
an ``lm://`` URL is opened."""

from __future__ import annotations

from kvplug.hookspecs import BackendSpec, hookimpl


@hookimpl
def kvplug_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name="lm",
            schemes=("lm",),
            factory="kvplug_lm.backend:LMBackend",
            description="LMCache lm:// server protocol (kvplug lm-server or lmcache_server)",
        )
    ]
