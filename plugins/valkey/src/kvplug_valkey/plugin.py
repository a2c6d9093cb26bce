"""Entry point of kvplug-valkey: declares the Valkey schemes.

Imported at discovery by every process that uses kvplug, so it imports nothing heavy: the
backend module, kvplug-redis and valkey-py are imported only when one of these schemes is
opened.
"""

from __future__ import annotations

from kvplug.hookspecs import BackendSpec, hookimpl


@hookimpl
def kvplug_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name="valkey",
            schemes=("valkey", "valkeys", "valkey+sentinel", "valkeys+sentinel", "valkey+cluster"),
            factory="kvplug_valkey.backend:ValkeyBackend",
            description="Valkey: standalone, TLS, Sentinel or Cluster (valkey-py)",
        )
    ]
