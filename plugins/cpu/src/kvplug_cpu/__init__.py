"""kvplug-cpu: the host-memory tier, ``cpu://?max_size=5GiB&eviction=lru``.

See :class:`kvplug_cpu.backend.CpuBackend`. The backend is imported on first use, so the
plugin entry point stays light.
"""

from __future__ import annotations

import importlib.metadata
from typing import TYPE_CHECKING

from kvplug.lazy import lazy_exports

if TYPE_CHECKING:
    from kvplug_cpu.backend import CpuBackend, CpuOptions

__version__ = importlib.metadata.version("kvplug-cpu")


__getattr__ = lazy_exports(
    __name__,
    {
        "kvplug_cpu.backend": ("CpuBackend", "CpuOptions"),
    },
)


__all__ = ["CpuBackend", "CpuOptions", "__version__"]
