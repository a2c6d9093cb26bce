"""Listing the MP keys a backend holds, a page at a time, for
:meth:`~kvplug_lmcache.l2_adapter.KvplugL2Adapter.list_l2_keys`: every page lists the whole
backend and sorts it by the key's string form, which is also the page's cursor."""

from __future__ import annotations

import bisect

from lmcache.v1.distributed.api import ObjectKey

from kvplug.backend import Backend
from kvplug.errors import KvplugError
from kvplug.keys import CacheKey
from kvplug_lmcache.keys import cache_key_to_object_key

Listed = list[tuple[str, ObjectKey]]
"""Each MP key with its string form, in the order of the string forms."""


def check_page_request(page_size: object, cursor: str | None) -> None:
    """Raise ValueError for a page size that is not a positive integer, or a cursor that is not
    the ``next_page_token`` of a page (the string form of an MP key)."""
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
        raise ValueError(f"page_size must be a positive integer, got {page_size!r}")
    if cursor is not None:
        try:
            cache_key_to_object_key(CacheKey.parse(cursor))
        except (KvplugError, ValueError):
            raise ValueError(
                f"cursor {cursor!r} is not a next_page_token this adapter returned"
            ) from None


async def mp_keys(backend: Backend, model_name: str | None) -> Listed:
    """The MP keys ``backend`` holds (of ``model_name`` only, when given), sorted; keys of other
    engines sharing the store are left out."""
    found = []
    async for cache_key in backend.list_keys():
        try:
            key = cache_key_to_object_key(cache_key)
        except (KvplugError, ValueError):
            continue  # not an MP key (another engine shares the store)
        if model_name is None or key.model_name == model_name:
            found.append((cache_key.to_string(), key))
    return sorted(found, key=lambda item: item[0])


def page_after(items: Listed, cursor: str | None, size: int) -> tuple[Listed, bool]:
    """The ``size`` items after ``cursor`` (from the first with None), and whether more follow."""
    start = 0 if cursor is None else bisect.bisect_right([text for text, _ in items], cursor)
    return items[start : start + size], start + size < len(items)
