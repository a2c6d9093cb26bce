"""Entry point of kvplug-acme: declares the ``acme://`` scheme.

Imported at discovery by every process that uses kvplug, so it imports nothing heavy: the
backend module (and sqlite3) is imported only when an ``acme://`` URL is opened.
"""

from __future__ import annotations

from kvplug.hookspecs import BackendSpec, hookimpl


@hookimpl
def kvplug_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name="acme",
            schemes=("acme",),
            factory="kvplug_acme.backend:AcmeBackend",
            description="example third-party store: one SQLite file (acme:///path/to/db.sqlite)",
        )
    ]
