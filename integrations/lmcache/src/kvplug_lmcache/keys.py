"""LMCache's keys as kvplug :class:`~kvplug.keys.CacheKey`\\ s, both ways, with nothing lost.

In-process LMCache (``CacheEngineKey``) and kvplug write the same string form,
``model@world_size@worker_id@hexhash@dtype[@tag%value...]``, so a store shared with LMCache
0.5.x sees one key under one name: the mapping is field for field.

The MP server's ``ObjectKey(chunk_hash, model_name, kv_rank, object_group_id, cache_salt)``
has no world size, worker or dtype of its own. It maps to::

    model@<world_size>@<worker_id>@<chunk hash hex>@uint8@rank%<kv_rank>@group%<id>[@salt%<salt>]

where world size and worker are unpacked from ``kv_rank`` when it is in the packed form
LMCache's ``ObjectKey.ComputeKVRank`` writes (else ``1`` and ``0``), ``uint8`` says the object
is a byte buffer whose layout LMCache keeps, the whole ``kv_rank`` and group are kept as decimal
tags, and a non-empty salt is the key's tenant (:attr:`kvplug.keys.CacheKey.tenant`, the
``salt`` tag, percent-encoded). Every field is kept whole, so distinct
ObjectKeys never share a stored object.

Example::

    >>> from lmcache.v1.distributed.api import ObjectKey
    >>> key = ObjectKey(bytes.fromhex("00ab"), "llama", ObjectKey.ComputeKVRank(2, 1, 2, 1))
    >>> str(object_key_to_cache_key(key))
    'llama@2@1@00ab@uint8@rank%33620481@group%0'
    >>> cache_key_to_object_key(object_key_to_cache_key(key)) == key
    True
"""

from __future__ import annotations

from typing import Any

from lmcache.utils import STR_DTYPE_TO_TORCH_DTYPE, CacheEngineKey
from lmcache.v1.distributed.api import ObjectKey

from kvplug.keys import TENANT_TAG, CacheKey, InvalidKey, lmcache_dtype_name, tenant_tag_value

OBJECT_DTYPE = "uint8"
"""The dtype name of MP objects' keys: LMCache's ``ObjectKey`` names a byte buffer."""

_TAG_PREFIX = "lmcache.tag."


def _unpacked_rank(kv_rank: int) -> tuple[int, int]:
    world_size, global_rank = (kv_rank >> 24) & 0xFF, (kv_rank >> 16) & 0xFF
    if kv_rank >= 0 and 0 <= global_rank < world_size:
        return world_size, global_rank
    return 1, 0


def object_key_to_cache_key(key: ObjectKey) -> CacheKey:
    """The kvplug key of an MP ``ObjectKey``; :func:`cache_key_to_object_key` inverts it."""
    tags = [("rank", str(key.kv_rank)), ("group", str(key.object_group_id))]
    if key.cache_salt:
        tags.append((TENANT_TAG, tenant_tag_value(key.cache_salt)))
    world_size, worker_id = _unpacked_rank(key.kv_rank)
    return CacheKey(
        key.model_name, world_size, worker_id, bytes(key.chunk_hash), OBJECT_DTYPE, tuple(tags)
    )


def cache_key_to_object_key(key: CacheKey) -> ObjectKey:
    """The ``ObjectKey`` that :func:`object_key_to_cache_key` mapped to ``key``.

    Raises :class:`~kvplug.keys.InvalidKey` for a key that no ``ObjectKey`` maps to (for
    example one listed from a store that LMCache's in-process mode writes to as well).
    """
    tags = dict(key.tags)
    try:
        kv_rank, group = int(tags["rank"]), int(tags["group"])
        chunk_hash = bytes.fromhex(key.chunk_hash_hex)
    except (KeyError, ValueError):
        raise InvalidKey(
            f"key {key} was not written by LMCache's MP server through kvplug: an MP key has "
            "a bytes chunk hash and 'rank' and 'group' tags."
        ) from None
    return ObjectKey(
        chunk_hash=chunk_hash,
        model_name=key.model_name,
        kv_rank=kv_rank,
        object_group_id=group,
        cache_salt=key.tenant,
    )


def engine_key_to_cache_key(key: CacheEngineKey) -> CacheKey:
    """The kvplug key of an in-process ``CacheEngineKey``: the same string form.

    Per-layer keys (LMCache's layerwise mode) have no kvplug form: they raise
    :class:`~kvplug.keys.InvalidKey` naming the fix.
    """
    if hasattr(key, "layer_id"):
        raise InvalidKey(
            f"LMCache passed the per-layer key {key.to_string()!r}: kvplug stores whole chunks. "
            "Turn off use_layerwise in the LMCache config to use kvplug as remote storage."
        )
    tags = tuple((name, str(value)) for name, value in key.tags or ())
    return CacheKey(
        key.model_name,
        key.world_size,
        key.worker_id,
        key.chunk_hash,
        lmcache_dtype_name(key.dtype),
        tags,
    )


def cache_key_to_engine_key(key: CacheKey) -> CacheEngineKey:
    """The ``CacheEngineKey`` whose string form is ``key``'s."""
    request_configs: dict[str, Any] = {_TAG_PREFIX + name: value for name, value in key.tags}
    return CacheEngineKey(
        model_name=key.model_name,
        world_size=key.world_size,
        worker_id=key.worker_id,
        chunk_hash=key.chunk_hash,
        dtype=STR_DTYPE_TO_TORCH_DTYPE[key.dtype],
        request_configs=request_configs or None,
    )


__all__ = [
    "OBJECT_DTYPE",
    "cache_key_to_engine_key",
    "cache_key_to_object_key",
    "engine_key_to_cache_key",
    "object_key_to_cache_key",
]
