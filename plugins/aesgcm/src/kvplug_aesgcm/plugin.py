"""Entry point of kvplug-aesgcm: the ``aesgcm`` serde (byte stores) and the ``aesgcm::`` wrapper
(backends that store objects)."""

from __future__ import annotations

from kvplug.hookspecs import BackendSpec, hookimpl
from kvplug.serde import Serde


@hookimpl
def kvplug_serdes() -> list[type[Serde]]:
    from kvplug_aesgcm.serde import AESGCMSerde

    return [AESGCMSerde]


@hookimpl
def kvplug_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name="aesgcm",
            schemes=("aesgcm",),
            factory="kvplug_aesgcm.wrapper:SealingWrapper",
            description="wrapper: seals every object with AES-256-GCM (encryption at rest)",
            kind="wrapper",
        )
    ]
