"""SGLang HiCache page keys as kvplug :class:`~kvplug.keys.CacheKey` s, losslessly.

SGLang names an L3 page by a hex string: the SHA-256 of the page's token ids chained over the
pages before it (``sglang.srt.mem_cache.utils.get_hash_str``). kvplug keeps that hash whole, as
bytes, so the key's hash field is the page key itself. Around it, the key carries everything
that makes two pages with the same tokens hold different bytes:

* the model name SGLang keys storage on (``HiCacheStorageConfig.model_name``, which already
  names a host pool's own byte format when it has one; :func:`model_field`), and the KV dtype;
* the shard: ``tp_size``/``tp_rank`` as world size and worker id; for MLA models (the KV is
  replicated on every TP rank) one shared shard, or ``dcp_size``/``dcp_rank`` when decode
  context parallelism splits the pages; pipeline stages (``@pp%rank/size``) and attention
  context-parallel ranks (``@cp%rank/size``) as tags when there are several;
* the host pool's layout (``@layout%page_first``...), because every layout orders a page's
  bytes differently: a page written in one layout is a miss in another, never wrong data;
* which of a page's segments the object holds (``@seg%0/2``: a K and a V region) when the page
  is stored as several objects;
* the deployment's tenant, last, as kvplug's tenant tag (``@salt%<name>``,
  :attr:`kvplug.keys.CacheKey.tenant`), when the storage is given one: the same page of two
  tenants is two objects, and the store can tell whose each is. SGLang folds a request's
  ``extra_key`` and ``cache_salt`` into its page hashes but does not pass them to the storage,
  so the tenant is the deployment's, not the request's.

Data-parallel replicas share pages: their attention shards hold identical bytes for the same
tokens.

Example::

    >>> ns = PageNamespace("Qwen/Qwen3-8B", 2, 1, "bfloat16", layout="page_first", segments=2)
    >>> page = "00" * 31 + "1f"
    >>> [str(key) for key in ns.segment_keys(page)]  # doctest: +NORMALIZE_WHITESPACE
    ['Qwen/Qwen3-8B@2@1@000000000000000000000000000000000000000000000000000000000000001f@bfloat16@layout%page_first@seg%0/2',
     'Qwen/Qwen3-8B@2@1@000000000000000000000000000000000000000000000000000000000000001f@bfloat16@layout%page_first@seg%1/2']
    >>> page_key_of(ns.segment_keys(page)[1]) == page
    True
    >>> theirs = PageNamespace("m", 1, 0, "half", layout="page_first", tenant="team a")
    >>> str(theirs.segment_keys(page)[0]).split("@")[5:]
    ['layout%page_first', 'salt%team%20a']
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from kvplug.keys import TENANT_TAG, CacheKey, InvalidKey, tenant_tag_value

_CANONICAL_HEX = re.compile(r"(?:[0-9a-f]{2})+")
_ESCAPED = re.compile(r"[@%\x00-\x1f]")
TEXT_TAG = "page"
"""Tag that marks a page key that is not lowercase hex: its UTF-8 bytes are the chunk hash."""
UNNAMED_MODEL = "%unnamed"
"""The model field of pages stored without a model name. No name maps to it: :func:`model_field`
escapes every ``%`` of a name as ``%25``."""


def model_field(model_name: str | None) -> str:
    """The key's model field for SGLang's storage model name.

    SGLang's own backends key pages by rank alone when it passes no name; kvplug then uses
    :data:`UNNAMED_MODEL`. A name keeps every character but ``@`` (which separates key fields),
    ``%`` and control characters, which are percent-escaped, so two names never share a field.

    Example::

        >>> model_field("meta-llama/Llama-3.1-8B")
        'meta-llama/Llama-3.1-8B'
        >>> model_field("/models/llama@v2"), model_field(None)
        ('/models/llama%40v2', '%unnamed')
    """
    if not model_name:
        return UNNAMED_MODEL
    return _ESCAPED.sub(lambda match: f"%{ord(match.group()):02X}", model_name)


def page_hash(page_key: str) -> tuple[bytes, tuple[tuple[str, str], ...]]:
    """The chunk hash and extra tags that name SGLang page key ``page_key`` in a CacheKey.

    Lowercase hex of whole bytes (every key SGLang's controller makes) becomes those bytes. Any
    other non-empty string keeps its UTF-8 bytes and gains the tag ``page%text``, so it never
    collides with a hex key of the same bytes.
    """
    if not isinstance(page_key, str) or not page_key:
        raise InvalidKey(f"an SGLang page key must be a non-empty string, got {page_key!r}.")
    if _CANONICAL_HEX.fullmatch(page_key):
        return bytes.fromhex(page_key), ()
    return page_key.encode(), ((TEXT_TAG, "text"),)


def page_key_of(key: CacheKey) -> str:
    """The SGLang page key a CacheKey made by :class:`PageNamespace` stands for."""
    if not isinstance(key.chunk_hash, bytes):
        raise InvalidKey(f"{key} was not made from an SGLang page key (its hash is an int).")
    if (TEXT_TAG, "text") in key.tags:
        return key.chunk_hash.decode()
    return key.chunk_hash.hex()


@dataclass(frozen=True)
class PageNamespace:
    """The key space of one SGLang rank's pages: everything in a key but the page hash.

    Fields:
        model_name: SGLang's storage model name.
        world_size: shards of the KV cache (``tp_size``; for MLA 1 or ``dcp_size``).
        worker_id: this rank's shard.
        dtype: LMCache's name of the KV dtype (:func:`kvplug.keys.lmcache_dtype_name`).
        layout: the host pool's layout name.
        segments: objects per page (1, or 2 for a K and a V region).
        shard_tags: ``(name, "rank/size")`` tags for pipeline and context-parallel ranks.
        tenant: the tenant whose pages these are, ``""`` for none.
    """

    model_name: str
    world_size: int
    worker_id: int
    dtype: str
    layout: str
    segments: int = 1
    shard_tags: tuple[tuple[str, str], ...] = ()
    tenant: str = ""
    _tenant_tags: tuple[tuple[str, str], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.segments < 1:
            raise InvalidKey(f"a page has at least one segment, got {self.segments}.")
        tenant_tags = ((TENANT_TAG, tenant_tag_value(self.tenant)),) if self.tenant else ()
        object.__setattr__(self, "_tenant_tags", tenant_tags)
        CacheKey(self.model_name, self.world_size, self.worker_id, 0, self.dtype, self._tags())

    def _tags(self) -> tuple[tuple[str, str], ...]:
        return (*self.shard_tags, ("layout", self.layout))

    def segment_keys(self, page_key: str) -> list[CacheKey]:
        """The keys of ``page_key``'s segments, in the page's byte order."""
        chunk_hash, text_tags = page_hash(page_key)
        tags = (*self._tags(), *text_tags)
        segments: list[tuple[tuple[str, str], ...]] = (
            [()]
            if self.segments == 1
            else [(("seg", f"{index}/{self.segments}"),) for index in range(self.segments)]
        )
        return [
            CacheKey(
                self.model_name,
                self.world_size,
                self.worker_id,
                chunk_hash,
                self.dtype,
                (*tags, *segment, *self._tenant_tags),
            )
            for segment in segments
        ]

    def owns(self, key: CacheKey) -> bool:
        """Whether ``key`` is one of this namespace's segment keys."""
        if key.namespace != f"{self.model_name}@{self.world_size}@{self.worker_id}":
            return False
        if key.dtype != self.dtype or not isinstance(key.chunk_hash, bytes):
            return False
        try:
            return key in self.segment_keys(page_key_of(key))
        except (InvalidKey, UnicodeDecodeError):
            return False


__all__ = ["TEXT_TAG", "UNNAMED_MODEL", "PageNamespace", "model_field", "page_hash", "page_key_of"]
