"""kvplug-audit: the ``audit`` wrapper, ``audit::<backend-url>``.

See :class:`kvplug_audit.backend.AuditBackend`.
"""

from __future__ import annotations

import importlib.metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvplug_audit.backend import AuditBackend, AuditOptions

__version__ = importlib.metadata.version("kvplug-audit")


def __getattr__(name: str) -> Any:
    if name in ("AuditBackend", "AuditOptions"):
        from kvplug_audit import backend

        return getattr(backend, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["AuditBackend", "AuditOptions", "__version__"]
