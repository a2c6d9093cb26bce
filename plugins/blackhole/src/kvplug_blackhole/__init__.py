"""kvplug-blackhole: ``blackhole://``, a backend that accepts every put and always misses.

See :class:`kvplug_blackhole.backend.BlackholeBackend`.
"""

from __future__ import annotations

import importlib.metadata
from typing import TYPE_CHECKING

from kvplug.lazy import lazy_exports

if TYPE_CHECKING:
    from kvplug_blackhole.backend import BlackholeBackend

__version__ = importlib.metadata.version("kvplug-blackhole")


__getattr__ = lazy_exports(
    __name__,
    {
        "kvplug_blackhole.backend": ("BlackholeBackend",),
    },
)


__all__ = ["BlackholeBackend", "__version__"]
