"""kvplug inside SGLang: every kvplug backend or tiers config as SGLang's HiCache L3 storage.

Load it with ``--hicache-storage-backend dynamic`` and the extra config
``{"backend_name": "kvplug", "module_path": "kvplug_sglang", "class_name":
"KvplugHiCacheStorage", "interface_v1": 1, "url": "<a kvplug URL>"}``; see ``docs/sglang.md``.
"""

from kvplug_sglang.keys import PageNamespace, page_hash, page_key_of
from kvplug_sglang.storage import KvplugHiCacheStorage, StorageHealth, backend_url_and_options

__all__ = [
    "KvplugHiCacheStorage",
    "PageNamespace",
    "StorageHealth",
    "backend_url_and_options",
    "page_hash",
    "page_key_of",
]
