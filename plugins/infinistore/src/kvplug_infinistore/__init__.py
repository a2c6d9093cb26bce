"""kvplug-infinistore: the ``infinistore://host:port`` tier, kvplug objects in an InfiniStore
server through InfiniStore's own client, over RDMA (the default) or its TCP path.

* :class:`kvplug_infinistore.backend.InfiniStoreBackend`: the backend (deadlines, reconnects
  with back-off, registered staging memory, batched RDMA transfers, framed values);
* :class:`kvplug_infinistore.backend.InfiniStoreOptions`: its options.

The backend is imported on first use, so the plugin entry point stays light.
"""

from __future__ import annotations

import importlib.metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvplug_infinistore.backend import InfiniStoreBackend, InfiniStoreOptions

__version__ = importlib.metadata.version("kvplug-infinistore")


def __getattr__(name: str) -> Any:
    if name in ("InfiniStoreBackend", "InfiniStoreOptions"):
        from kvplug_infinistore import backend

        return getattr(backend, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["InfiniStoreBackend", "InfiniStoreOptions", "__version__"]
