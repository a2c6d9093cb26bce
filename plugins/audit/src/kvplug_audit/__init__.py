"""kvplug-audit: the ``audit`` wrapper, ``audit::<backend-url>``.

See :class:`kvplug_audit.backend.AuditBackend`.
"""

from __future__ import annotations

import importlib.metadata
from typing import TYPE_CHECKING

from kvplug.lazy import lazy_exports

if TYPE_CHECKING:
    from kvplug_audit.backend import AuditBackend, AuditOptions

__version__ = importlib.metadata.version("kvplug-audit")


__getattr__ = lazy_exports(
    __name__,
    {
        "kvplug_audit.backend": ("AuditBackend", "AuditOptions"),
    },
)


__all__ = ["AuditBackend", "AuditOptions", "__version__"]
