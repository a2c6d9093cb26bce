"""Entry point of kvplug-lm: declares the ``lm://`` and ``lms://`` schemes. The client is
imported only when such a URL is opened."""

from __future__ import annotations

from kvplug.hookspecs import BackendSpec, hookimpl


@hookimpl
def kvplug_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name="lm",
            schemes=("lm", "lms"),
            factory="kvplug_lm.backend:LMBackend",
            description="LMCache lm:// server protocol (kvplug lm-server or lmcache_server); "
            "lms:// over TLS (kvplug lm-server)",
        )
    ]
