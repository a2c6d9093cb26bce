"""kvplug-cpu: the host-memory tier, ``cpu://?max_size=5GiB&eviction=lru``.

See :class:`kvplug_cpu.backend.CpuBackend`. The backend is imported on first use, so the
plugin entry point stays light.
"""

from __future__ import annotations

import importlib.metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvplug_cpu.backend import CpuBackend, CpuOptions

__version__ = importlib.metadata.version("kvplug-cpu")


def __getattr__(name: str) -> Any:
    if name in ("CpuBackend", "CpuOptions"):
        from kvplug_cpu import backend

        return getattr(backend, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CpuBackend", "CpuOptions", "__version__"]
