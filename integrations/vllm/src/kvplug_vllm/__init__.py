"""kvplug inside vLLM: every kvplug backend or tiers config as a secondary tier of vLLM's
offloading connector (``TieringOffloadingSpec``).

Add ``{"type": "kvplug", "url": "<a kvplug URL>"}`` to ``secondary_tiers`` in
``--kv-transfer-config``'s ``kv_connector_extra_config``; see ``docs/vllm.md``.
"""

from kvplug_vllm.keys import ChunkNamespace, key_dtype, model_identity, offload_key_of
from kvplug_vllm.tier import KvplugTier, TierHealth, backend_url_and_options

__all__ = [
    "ChunkNamespace",
    "KvplugTier",
    "TierHealth",
    "backend_url_and_options",
    "key_dtype",
    "model_identity",
    "offload_key_of",
]
