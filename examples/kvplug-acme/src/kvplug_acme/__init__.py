"""kvplug-acme: ``acme:///path/to/db.sqlite``, the example third-party kvplug backend.

See :class:`kvplug_acme.backend.AcmeBackend`. The backend module is loaded lazily, so importing
this package (as plugin discovery does) costs nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvplug_acme.backend import AcmeBackend, AcmeOptions

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in ("AcmeBackend", "AcmeOptions"):
        from kvplug_acme import backend

        return getattr(backend, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["AcmeBackend", "AcmeOptions", "__version__"]
