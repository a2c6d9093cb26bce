"""kvplug-blackhole: ``blackhole://``, a backend that accepts every put and always misses.

See :class:`kvplug_blackhole.backend.BlackholeBackend`.
"""

from __future__ import annotations

import importlib.metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvplug_blackhole.backend import BlackholeBackend

__version__ = importlib.metadata.version("kvplug-blackhole")


def __getattr__(name: str) -> Any:
    if name == "BlackholeBackend":
        from kvplug_blackhole import backend

        return backend.BlackholeBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["BlackholeBackend", "__version__"]
