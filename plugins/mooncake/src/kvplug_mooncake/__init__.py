"""kvplug-mooncake: the ``mooncakestore://master-host:port`` tier, a Mooncake Store client on
the store's zero-copy calls (:class:`kvplug_mooncake.backend.MooncakeBackend`), with options in
kvplug's, Mooncake's and LMCache's names (:class:`kvplug_mooncake.options.MooncakeOptions`)."""

from __future__ import annotations

import importlib.metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvplug_mooncake.backend import MooncakeBackend
    from kvplug_mooncake.options import MooncakeOptions

__version__ = importlib.metadata.version("kvplug-mooncake")


def __getattr__(name: str) -> Any:
    if name == "MooncakeBackend":
        from kvplug_mooncake import backend

        return backend.MooncakeBackend
    if name == "MooncakeOptions":
        from kvplug_mooncake import options

        return options.MooncakeOptions
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["MooncakeBackend", "MooncakeOptions", "__version__"]
