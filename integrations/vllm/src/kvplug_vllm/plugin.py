"""kvplug-vllm's ``vllm.general_plugins`` entry point: registers the tier type ``"kvplug"``.

vLLM runs general plugins in every process it starts, possibly several times in one; the
registration is done once and a repeat is a no-op. Another package that already registered
``"kvplug"`` for a different class keeps it, with a warning (``module_path`` still reaches
kvplug's tier: ``{"type": "KvplugTier", "module_path": "kvplug_vllm.tier"}``).
"""

from __future__ import annotations

import logging

logger = logging.getLogger("kvplug.vllm")

TIER_TYPE = "kvplug"
"""The ``type`` of kvplug's tier in ``secondary_tiers``."""


def register() -> None:
    """Register :class:`~kvplug_vllm.tier.KvplugTier` with vLLM's ``SecondaryTierFactory`` as
    ``"kvplug"``, unless it is registered already."""
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    try:
        SecondaryTierFactory.register_tier(TIER_TYPE, "kvplug_vllm.tier", "KvplugTier")
    except ValueError:
        from kvplug_vllm.tier import KvplugTier

        registered = SecondaryTierFactory.get_tier_class({"type": TIER_TYPE})
        if registered is not KvplugTier:
            logger.warning(
                "vLLM's secondary tier type %r is already registered for %s.%s, so kvplug-vllm "
                'did not register its own. Use {"type": "KvplugTier", "module_path": '
                '"kvplug_vllm.tier"} to reach kvplug\'s tier.',
                TIER_TYPE,
                registered.__module__,
                registered.__qualname__,
            )


__all__ = ["TIER_TYPE", "register"]
