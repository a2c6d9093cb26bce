"""What both LMCache adapters share: opening kvplug from LMCache's config, and the rule for
when LMCache's buffers may be handed to kvplug without a copy."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvplug.backend import Backend
from kvplug.config import Config
from kvplug.errors import ConfigError
from kvplug.store import Store
from kvplug.sync import SyncClient


def open_client(
    *,
    url: str | None,
    config: str | None,
    options: Mapping[str, Any] | None,
    what: str,
) -> SyncClient:
    """Open exactly one of ``url`` (any kvplug URL) or ``config`` (a kvplug tiers YAML) on a
    :class:`~kvplug.sync.SyncClient`, with ``options`` as kvplug backend or Store options.

    ``what`` names where the values came from (``"adapter_params"``,
    ``"extra_config remote_storage_plugin.kvplug.*"``) so an error points at the right place.
    kvplug's own errors (unknown scheme, unreachable server, bad option) pass through unchanged.
    """
    if (url is None) == (config is None):
        given = "both url and config" if url is not None else "neither url nor config"
        raise ConfigError(
            f"{what} has {given}: kvplug needs exactly one. Set url to a kvplug URL "
            "(cpu://, file:///dir, redis://host:6379, ...) or config to the path of a kvplug "
            "tiers YAML."
        )
    if options is not None and not isinstance(options, Mapping):
        raise ConfigError(
            f"{what}: options must be a mapping of kvplug option names to values, got "
            f"{type(options).__name__}."
        )
    if config is not None:
        return SyncClient(Config.from_yaml(Path(config)), **dict(options or {}))
    if not isinstance(url, str) or not url:
        raise ConfigError(f"{what}: url must be a non-empty kvplug URL string, got {url!r}.")
    return SyncClient(url, **dict(options or {}))


def needs_private_copy(backend: Backend) -> bool:
    """Whether a put must copy LMCache's buffer into kvplug memory first.

    LMCache reuses its buffers once a store is reported done. A backend that keeps the put
    object itself (a ``cpu://`` tier: ``zero_copy``) or writes it to lower tiers later (a Store
    of several tiers, which writes behind) would then hold memory LMCache has moved on from;
    every other backend is done with the object when its put returns, so it may read LMCache's
    buffer directly.
    """
    if backend.capabilities.zero_copy:
        return True
    return isinstance(backend, Store) and len(backend.tiers) > 1


__all__ = ["needs_private_copy", "open_client"]
