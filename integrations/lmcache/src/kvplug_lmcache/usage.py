"""The capacity and usage the LMCache adapter reports for a backend, from kvplug's own
options and counters, seen through wrappers (internal)."""

from __future__ import annotations

from collections.abc import Mapping

from kvplug.backend import Backend
from kvplug.runtime.store import tiers_of


def default_capacity(backend: Backend) -> int:
    """The backend's ``max_size`` (the largest tier's for a Store), else 0 (unknown); seen
    through wrappers (``audit::file://`` has ``file://``'s)."""
    tiers = tiers_of(backend)
    sizes = [getattr(tier.options, "max_size", None) for tier in tiers]
    known = [size for size in sizes if isinstance(size, int)]
    return max(known) if known and len(known) == len(sizes) else 0


def held_by_backend(backend: Backend) -> tuple[int, int] | None:
    """(objects, bytes) the backend holds by its own counters (``keys`` and ``bytes_held`` of
    its ``stats()``, seen through wrappers), all of them, also those another process or an
    earlier run stored; for a Store, its largest tier's (where the adapter's default capacity
    comes from; ties go to the lower tier, which a Store's writes reach last). None when a
    tier does not count them (``redis://``). Call on the IO thread."""
    counted: list[tuple[int, int, int]] = []
    for tier in tiers_of(backend):
        stats = getattr(tier, "stats", None)
        values = stats() if callable(stats) else None
        if not isinstance(values, Mapping):
            return None
        keys, held = values.get("keys"), values.get("bytes_held")
        if not isinstance(keys, int) or not isinstance(held, int):
            return None
        max_size = getattr(tier.options, "max_size", None)
        counted.append((max_size if isinstance(max_size, int) else 0, keys, held))
    if not counted:
        return None
    _, keys, held = max(reversed(counted), key=lambda tier: tier[0])
    return keys, held


__all__ = ["default_capacity", "held_by_backend"]
