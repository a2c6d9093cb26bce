"""Entry point of kvplug-infinistore: declares the ``infinistore://`` scheme. The backend (and
InfiniStore's client, which sets thread variables of the process when imported) is imported
only when an ``infinistore://`` URL is opened."""

from __future__ import annotations

from kvplug.hookspecs import BackendSpec, hookimpl


@hookimpl
def kvplug_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name="infinistore",
            schemes=("infinistore",),
            factory="kvplug_infinistore.backend:InfiniStoreBackend",
            description="InfiniStore server over RDMA or TCP (InfiniStore's own client)",
        )
    ]
