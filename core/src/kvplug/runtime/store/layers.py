"""Seeing a backend through its wrappers (``audit::...``): its layers, the Store among them, and
the tiers that hold the bytes."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvplug.backend import Backend

if TYPE_CHECKING:
    from kvplug.runtime.store.facade import Store


def layers(backend: Backend) -> list[Backend]:
    """``backend`` and the backends it wraps (``audit::...``), outermost first."""
    chain = [backend]
    while isinstance(inner := getattr(chain[-1], "inner", None), Backend):
        chain.append(inner)
    return chain


def store_of(backend: Backend) -> Store | None:
    """The :class:`~kvplug.runtime.store.Store` that ``backend`` is or wraps
    (``audit::store://...``), or None."""
    from kvplug.runtime.store.facade import Store  # the facade is built on this module

    return next((layer for layer in layers(backend) if isinstance(layer, Store)), None)


def tiers_of(backend: Backend) -> list[Backend]:
    """The backends that hold the bytes, seen through wrappers: each tier of the
    :class:`~kvplug.runtime.store.Store` that ``backend`` is or wraps, else ``backend``, each
    as the innermost backend it wraps.

    Example::

        >>> import asyncio, kvplug
        >>> from kvplug.runtime.store import Store
        >>> async def demo() -> list[list[str]]:
        ...     audited = await kvplug.open_backend("audit::blackhole://")
        ...     store = Store(tiers=[await kvplug.open_backend("cpu://?max_size=8MiB"), audited])
        ...     schemes = [[tier.url.scheme for tier in tiers_of(b)] for b in (store, audited)]
        ...     await store.close()
        ...     return schemes
        >>> asyncio.run(demo())
        [['cpu', 'blackhole'], ['blackhole']]
    """
    store = store_of(backend)
    return [layers(tier)[-1] for tier in (store.tiers if store is not None else [backend])]
