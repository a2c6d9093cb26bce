"""The tiered store: what an engine talks to, and itself a :class:`~kvplug.backend.Backend`.

A :class:`Store` holds an ordered list of backends, the tiers (fastest first, as in the
``tiers:`` config), and one host-memory budget. It is a backend like any other: it can be
opened by URL (``store:///etc/kvplug.yaml``), wrapped (``audit::store:///etc/kvplug.yaml``),
checked with ``kvplug contract --config FILE`` and driven by a ``SyncClient``.

**Batched per tier.** ``batched_get`` asks each tier once for the keys still missing, in lookup
order; ``batched_put`` hands the first tier one batched call and every lower tier batched calls
from its write-behind queue; ``batched_exists`` says which keys some tier has (each tier asked
once, for the keys the faster ones lacked) and ``batched_contains`` counts the leading ones.
A hit in a lower tier is written back into the faster tiers, batched too, and off the read
path except into host-memory tiers. ``get_into``/``batched_get_into`` read each tier straight
into the caller's memory, with no budget in between, and promote lower-tier hits in the
background, bounded in bytes.

**One memory budget.** Every object the store hands out or reads lives in one allocator, fixed
at open: the ``allocator`` given, else a buffer of the config's ``buffer_size``, else the cpu
tier's own buffer (its ``max_size``), else 2 GiB. Every tier's ``get`` reads into it. When it is
full, the cpu tier evicts entries that nobody but itself references (never one being read);
a get that still finds no room waits for memory up to its deadline (``timeout``) and then
reports a miss counted as ``memory_short``.

**Write-behind in bytes.** A put stores the object in the first tier before it returns and
queues it for the lower tiers while the objects waiting hold at most ``write_behind_size``
bytes (a quarter of the budget by default; an empty write-behind takes any object). A put is
*accepted* when the first tier took it or it was queued, and every tier that outlives this
process and does not hold the new value yet had its older value removed first; a lower tier
that cannot take it is counted as a dropped put with its reason and has the key's older value
removed, so an older value is never served after a newer one was accepted, not even after a
crash. A put not accepted raises at once, its ``stored`` telling which keys were
(:meth:`Store.offer` says it per key instead). A tier that drops every put it is offered is
warned about, with what to change.

A tier that fails is isolated: its error is counted, the other tiers keep serving, and it is
tried again after an exponential back-off; :meth:`Store.health` tells its state.
:meth:`Store.stats` and :meth:`Store.prometheus_text` show per-tier counters and latency, the
queued bytes, dropped puts by reason and misses by reason.

**Where each rule lives.** :mod:`.facade` holds the :class:`Store` (the backend operations,
opening, closing) over its parts: :mod:`.budget` the memory budget, :mod:`.health` tier health
and dropped puts, :mod:`.tier` what is kept per tier, :mod:`.freshness` the version ledger
(the one place that says which value a tier may serve), :mod:`.write_behind` the queues of the
lower tiers, :mod:`.reads` and :mod:`.writes` the read and write paths, :mod:`.promotion` the
write-back of lower-tier hits (:mod:`.parts` bundles what those three share), :mod:`.stats`
what the store reports, :mod:`.layers` seeing a backend through its wrappers.

Example::

    >>> import asyncio, torch
    >>> from kvplug.runtime.config import Config
    >>> from kvplug.keys import CacheKey
    >>> from kvplug.runtime.store import open_store
    >>> async def main():
    ...     store = await open_store(Config.from_dict({"tiers": ["cpu://?max_size=64MiB"]}))
    ...     key = CacheKey("llama", 1, 0, 7)
    ...     obj = store.allocate((2, 4, 16, 64), torch.float16)
    ...     obj.tensor.fill_(2.0)
    ...     await store.put(key, obj)
    ...     obj.release()
    ...     hit = await store.get(key)
    ...     total = hit.tensor.sum().item()
    ...     hit.release()
    ...     found = await store.batched_contains([key, key.with_hash(8)])
    ...     await store.close()
    ...     return total, found
    >>> asyncio.run(main())
    (16384.0, 1)
"""

from kvplug.runtime.store.budget import MemoryTier
from kvplug.runtime.store.facade import Store, StoreOptions, open_store, store_url
from kvplug.runtime.store.health import (
    ADVICE,
    DROP_REASONS,
    STARVED_AFTER,
    TierHealth,
)
from kvplug.runtime.store.health import stored_keys as stored_keys
from kvplug.runtime.store.layers import layers, store_of, tiers_of
from kvplug.runtime.store.reads import MISS_REASONS

__all__ = [
    "ADVICE",
    "DROP_REASONS",
    "MISS_REASONS",
    "STARVED_AFTER",
    "MemoryTier",
    "Store",
    "StoreOptions",
    "TierHealth",
    "layers",
    "open_store",
    "store_of",
    "store_url",
    "tiers_of",
]
