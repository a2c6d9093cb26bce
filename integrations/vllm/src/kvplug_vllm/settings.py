"""The tier keys of :class:`~kvplug_vllm.tier.KvplugTier`: each key, its default and its check.

A ``secondary_tiers`` entry names ``url`` or ``config`` and the optional keys of
:data:`KVPLUG_KEYS`; vLLM reads :data:`VLLM_KEYS` itself. :meth:`TierSettings.parse` refuses an
unknown key, a wrong type or a value out of range with a :class:`~kvplug.errors.ConfigError`
that names the key and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm.v1.kv_offload.base import Locality

from kvplug.errors import ConfigError
from kvplug.runtime.engine import (
    QUICK_SWITCH_SECONDS,
    check_keys,
    check_target,
    flag,
    positive_seconds,
)
from kvplug.runtime.store import store_url
from kvplug_vllm.keys import TENANT_PARAM, checked_tenant

_WHAT = "KvplugTier"

DEFAULT_TASK_TIMEOUT = 60.0
"""Seconds one store or load job may take before it finishes failed."""
DEFAULT_LOOKUP_TIMEOUT = 5.0
"""Seconds one batch of lookups may take before its keys answer MISS."""
ON_RESET = ("keep", "forget")

KVPLUG_KEYS = {
    "url": "a kvplug URL, e.g. file:///var/cache/kv or redis://host:6379",
    "config": "path of a kvplug tiers YAML (instead of url)",
    "options": "mapping of kvplug backend or Store options",
    "task_timeout": f"seconds one store or load job may take (default {DEFAULT_TASK_TIMEOUT})",
    "lookup_timeout": f"seconds one batch of lookups may take (default {DEFAULT_LOOKUP_TIMEOUT})",
    "check_on_start": "fail at start when the store does not answer (default true)",
    "model_identity": "a string that identifies the served weights (default: derived)",
    "tenant": (
        f"the tenant of every chunk this tier stores and reads (default: none; each request may "
        f"then name its own in kv_transfer_params[{TENANT_PARAM!r}])"
    ),
    "on_reset": "'keep' (default) or 'forget' what was stored before a cache reset",
    "max_queued_chunks": "chunks of store jobs in flight before new ones are refused",
    "locality": "'LOCAL' or 'REMOTE': where the store is relative to this instance",
    "enable_kv_events": "publish KV events for chunks stored here (default false)",
    "gil_switch_interval": (
        f"seconds: the interpreter's switch interval while a load or lookup is in flight "
        f"(default {QUICK_SWITCH_SECONDS}; null leaves it alone)"
    ),
}
VLLM_KEYS = ("type", "module_path", "backpressure")
"""Tier config keys that vLLM's SecondaryTierFactory reads itself."""


@dataclass(frozen=True)
class TierSettings:
    """A ``secondary_tiers`` entry of kvplug, checked: what :class:`~kvplug_vllm.tier.KvplugTier`
    opens and how it behaves."""

    url: str | None
    config: str | None
    options: Mapping[str, Any] | None
    task_timeout: float
    lookup_timeout: float
    check_on_start: bool
    model_identity: str | None
    tenant: str
    """The deployment's tenant, ``""`` for none (each request may then name its own)."""
    on_reset: str
    max_queued_chunks: int | None
    locality: Locality | None
    enable_kv_events: bool
    gil_switch_interval: float | None

    @classmethod
    def parse(cls, settings: Mapping[str, Any]) -> TierSettings:
        check_keys(
            settings,
            KVPLUG_KEYS,
            what=_WHAT,
            where="its secondary_tiers entry",
            engine="vLLM",
            engine_keys=VLLM_KEYS,
        )
        check_target(
            settings.get("url"), settings.get("config"), settings.get("options"), what=_WHAT
        )
        identity = settings.get("model_identity")
        if identity is not None and (not isinstance(identity, str) or not identity):
            raise ConfigError(
                f"{_WHAT}: model_identity must be a non-empty string (a checkpoint digest, a "
                f"revision), got {identity!r}."
            )
        tenant = settings.get("tenant")
        if tenant is not None:
            tenant = checked_tenant(tenant, f"{_WHAT}: tenant")
        on_reset = settings.get("on_reset", "keep")
        if on_reset not in ON_RESET:
            raise ConfigError(f"{_WHAT}: on_reset must be one of {ON_RESET}, got {on_reset!r}.")
        queued = settings.get("max_queued_chunks")
        if queued is not None and (
            isinstance(queued, bool) or not isinstance(queued, int) or queued < 1
        ):
            raise ConfigError(
                f"{_WHAT}: max_queued_chunks must be a positive integer, got {queued!r}."
            )
        locality = settings.get("locality")
        valid_localities = [member.value for member in Locality]
        if locality is not None and locality not in valid_localities:
            raise ConfigError(
                f"{_WHAT}: locality must be one of {valid_localities}, got {locality!r}."
            )
        return cls(
            url=settings.get("url"),
            config=settings.get("config"),
            options=settings.get("options"),
            task_timeout=positive_seconds(
                settings.get("task_timeout", DEFAULT_TASK_TIMEOUT), name="task_timeout", what=_WHAT
            ),
            lookup_timeout=positive_seconds(
                settings.get("lookup_timeout", DEFAULT_LOOKUP_TIMEOUT),
                name="lookup_timeout",
                what=_WHAT,
            ),
            check_on_start=flag(
                settings.get("check_on_start", True), name="check_on_start", what=_WHAT
            ),
            model_identity=identity,
            tenant=tenant or "",
            on_reset=on_reset,
            max_queued_chunks=queued,
            locality=Locality(locality) if locality is not None else None,
            enable_kv_events=flag(
                settings.get("enable_kv_events", False), name="enable_kv_events", what=_WHAT
            ),
            gil_switch_interval=None
            if (switch := settings.get("gil_switch_interval", QUICK_SWITCH_SECONDS)) is None
            else positive_seconds(switch, name="gil_switch_interval", what=_WHAT),
        )


def backend_url_and_options(tier_config: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """The kvplug URL and options of the backend :class:`KvplugTier` opens for
    ``tier_config`` (its ``secondary_tiers`` entry), checked as at vLLM's start: ``url`` as
    given, or for ``config`` the ``store://`` URL of that tiers YAML (the same Store over the
    same tiers), with ``options``. ``kvplug.open_backend(url, **options)`` opens that backend,
    as the contract suite does in ``integrations/vllm/tests/test_vllm_contract.py``.

    Example::

        >>> backend_url_and_options({"type": "kvplug", "url": "redis://cache:6379"})
        ('redis://cache:6379', {})
        >>> backend_url_and_options({"type": "kvplug", "config": "/etc/kvplug.yaml"})
        ('store:///etc/kvplug.yaml', {})
    """
    settings = TierSettings.parse(tier_config)
    url = settings.url
    if settings.config is not None:
        url = store_url(settings.config)
    return str(url), dict(settings.options or {})
