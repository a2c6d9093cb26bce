"""Entry point of kvplug-audit: declares the ``audit`` wrapper (``audit::<backend-url>``)."""

from __future__ import annotations

from kvplug.hookspecs import BackendSpec, hookimpl


@hookimpl
def kvplug_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name="audit",
            schemes=("audit",),
            factory="kvplug_audit.backend:AuditBackend",
            description="wrapper: logs every operation, verifies checksums, injects faults",
            kind="wrapper",
        )
    ]
