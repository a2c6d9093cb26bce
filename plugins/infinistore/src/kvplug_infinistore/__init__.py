"""kvplug-infinistore: the ``infinistore://host:port`` tier, kvplug objects in an InfiniStore
server through InfiniStore's own client, over RDMA (the default) or its TCP path.

* :class:`kvplug_infinistore.backend.InfiniStoreBackend`: the backend (deadlines, reconnects
  with back-off, registered staging memory, batched RDMA transfers, framed values);
* :class:`kvplug_infinistore.backend.InfiniStoreOptions`: its options.

The backend is imported on first use, so the plugin entry point stays light.
"""

from __future__ import annotations

import importlib.metadata
from typing import TYPE_CHECKING

from kvplug.lazy import lazy_exports

if TYPE_CHECKING:
    from kvplug_infinistore.backend import InfiniStoreBackend, InfiniStoreOptions

__version__ = importlib.metadata.version("kvplug-infinistore")


__getattr__ = lazy_exports(
    __name__,
    {
        "kvplug_infinistore.backend": ("InfiniStoreBackend", "InfiniStoreOptions"),
    },
)


__all__ = ["InfiniStoreBackend", "InfiniStoreOptions", "__version__"]
