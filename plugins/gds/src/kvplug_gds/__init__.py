"""kvplug-gds: the GPUDirect Storage tier, ``gds:///dir`` and ``weka:///dir``.

See :class:`kvplug_gds.backend.GdsBackend`. The backend, and through it cuFile, is imported on
first use, so the package imports on machines without a GPU or without libcufile.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvplug_gds.backend import GdsBackend, GdsOptions, GdsUnavailable, WekaBackend

__version__ = "0.1.0"

_LAZY = ("GdsBackend", "GdsOptions", "GdsUnavailable", "WekaBackend")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from kvplug_gds import backend

        return getattr(backend, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["GdsBackend", "GdsOptions", "GdsUnavailable", "WekaBackend", "__version__"]
