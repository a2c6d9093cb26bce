"""kvplug-lm: the ``lm://`` tier and ``kvplug lm-server``, wire-compatible with LMCache 0.5.6's
``lm://`` connector and ``lmcache_server``.

* :class:`kvplug_lm.backend.LMBackend`: the ``lm://host:port`` client (a connection pool,
  deadlines, reconnects, pipelined batches); against a kvplug server it switches to the
  extended mode (acknowledged and checksummed puts, delete, longer keys, authentication).
* :mod:`kvplug_lm.server`: the server (``kvplug lm-server``, ``python -m kvplug_lm.server``).
* :mod:`kvplug_lm.wire`: the protocol, both modes, byte by byte.

The client and server are imported on first use, so the plugin entry point stays light.
"""

from __future__ import annotations

import importlib.metadata
from typing import TYPE_CHECKING

from kvplug.lazy import lazy_exports

if TYPE_CHECKING:
    from kvplug_lm.backend import LMBackend, LMOptions

__version__ = importlib.metadata.version("kvplug-lm")


__getattr__ = lazy_exports(
    __name__,
    {
        "kvplug_lm.backend": ("LMBackend", "LMOptions"),
    },
)


__all__ = ["LMBackend", "LMOptions", "__version__"]
