"""kvplug-mooncake: the ``mooncakestore://master-host:port`` tier, a Mooncake Store client on
the store's zero-copy calls (:class:`kvplug_mooncake.backend.MooncakeBackend`), with options in
kvplug's, Mooncake's and LMCache's names (:class:`kvplug_mooncake.options.MooncakeOptions`)."""

from __future__ import annotations

import importlib.metadata
from typing import TYPE_CHECKING

from kvplug.lazy import lazy_exports

if TYPE_CHECKING:
    from kvplug_mooncake.backend import MooncakeBackend
    from kvplug_mooncake.options import MooncakeOptions

__version__ = importlib.metadata.version("kvplug-mooncake")


__getattr__ = lazy_exports(
    __name__,
    {
        "kvplug_mooncake.backend": ("MooncakeBackend",),
        "kvplug_mooncake.options": ("MooncakeOptions",),
    },
)


__all__ = ["MooncakeBackend", "MooncakeOptions", "__version__"]
