"""What both LMCache adapters share: opening kvplug from LMCache's config, and the rule for
when LMCache's buffers may be handed to kvplug without a copy."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvplug.backend import Backend
from kvplug.config import Config
from kvplug.errors import CapacityExceeded, ConfigError
from kvplug.memory import MemoryObj
from kvplug.store import Store
from kvplug.sync import SyncClient


def check_target(url: object, config: object, options: object, *, what: str) -> None:
    """Raise :class:`~kvplug.errors.ConfigError` unless exactly one of ``url`` (a kvplug URL)
    and ``config`` (a tiers YAML path) is a non-empty string and ``options`` is a mapping or
    None. ``what`` names where the values came from (``"KvplugL2Adapter adapter_params"``)."""
    if (url is None) == (config is None):
        given = "both url and config" if url is not None else "neither url nor config"
        raise ConfigError(
            f"{what} has {given}: kvplug needs exactly one. Set url to a kvplug URL "
            "(cpu://, file:///dir, redis://host:6379, ...) or config to the path of a kvplug "
            "tiers YAML."
        )
    for name, value in (("url", url), ("config", config)):
        if value is not None and (not isinstance(value, str) or not value):
            raise ConfigError(
                f"{what}: {name} must be a non-empty string, got {type(value).__name__}."
            )
    if options is not None and not isinstance(options, Mapping):
        raise ConfigError(
            f"{what}: options must be a mapping of kvplug option names to values, got "
            f"{type(options).__name__}."
        )


def open_client(
    *,
    url: str | None,
    config: str | None,
    options: Mapping[str, Any] | None,
    what: str,
) -> SyncClient:
    """Open exactly one of ``url`` (any kvplug URL) or ``config`` (a kvplug tiers YAML) on a
    :class:`~kvplug.sync.SyncClient`, with ``options`` as kvplug backend or Store options.

    The values are checked by :func:`check_target`; kvplug's own errors (unknown scheme,
    unreachable server, bad option) pass through unchanged.
    """
    check_target(url, config, options, what=what)
    if config is not None:
        return SyncClient(Config.from_yaml(Path(config)), **dict(options or {}))
    return SyncClient(str(url), **dict(options or {}))


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


def private_copies(backend: Backend, objs: Sequence[MemoryObj], target: str) -> list[MemoryObj]:
    """Copies of ``objs`` (same shape, dtype and format) in ``backend``'s own memory, for a
    backend that :func:`needs_private_copy`. Allocated through the backend where it can make
    room (a Store's budget, a ``cpu://`` tier), else from its allocator; call it on the
    backend's event loop. Raises :class:`~kvplug.errors.CapacityExceeded` naming ``target``
    when no room can be made; nothing stays allocated then."""
    allocate = getattr(backend, "allocate", None)
    if not callable(allocate):
        allocate = backend.allocator.allocate
    copies: list[MemoryObj] = []
    try:
        for obj in objs:
            copy = allocate(obj.shape, obj.dtype, obj.fmt)
            if copy is None:
                raise CapacityExceeded(
                    f"{target} has no memory left for a {obj.nbytes}-byte chunk (every entry "
                    "is pinned or being read); raise its max_size (or buffer_size)."
                )
            copies.append(copy)
            copy.raw.copy_(obj.raw)
    except BaseException:
        for copy in copies:
            copy.release()
        raise
    return copies


__all__ = ["check_target", "needs_private_copy", "open_client", "private_copies"]
