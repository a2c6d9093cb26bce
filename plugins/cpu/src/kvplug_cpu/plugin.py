"""Entry point of kvplug-cpu: declares the ``cpu://`` scheme. The backend module is imported
only when a ``cpu://`` URL is opened."""

from __future__ import annotations

from kvplug.hookspecs import BackendSpec, hookimpl


@hookimpl
def kvplug_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name="cpu",
            schemes=("cpu",),
            factory="kvplug_cpu.backend:CpuBackend",
            description="host-memory tier: size-capped, zero-copy, LRU/LFU/FIFO eviction, pins",
        )
    ]
