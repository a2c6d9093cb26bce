"""kvplug-valkey: the Valkey tier, ``valkey://host:6379``, ``valkeys://`` (TLS),
``valkey+sentinel://h1:26379,h2:26379/mymaster`` (``valkeys+sentinel://`` over TLS) and
``valkey+cluster://h1:7000,h2:7001``.

See :class:`kvplug_valkey.backend.ValkeyBackend`: kvplug-redis' backend on valkey-py's client.
Real valkey-server processes for tests are in the separate distribution kvplug-testing
(:mod:`kvplug_testing.valkey`). The backend is imported on first use, so the plugin entry point
stays light.
"""

from __future__ import annotations

import importlib.metadata
from typing import TYPE_CHECKING

from kvplug.lazy import lazy_exports

if TYPE_CHECKING:
    from kvplug_valkey.backend import ValkeyBackend, valkey_py

__version__ = importlib.metadata.version("kvplug-valkey")


__getattr__ = lazy_exports(
    __name__,
    {
        "kvplug_valkey.backend": ("ValkeyBackend", "valkey_py"),
    },
)


__all__ = ["ValkeyBackend", "__version__", "valkey_py"]
