"""Batched operations built from single ones, and the memory objects they leave behind.

The default batched hooks of :class:`~kvplug.backend.Backend` and
:class:`~kvplug.backend.BytesBackend` run one call per key concurrently with these helpers,
and backends use them too: each raises its error only once every call has finished, and a
read that fails or is cancelled leaves no object allocated.

Example::

    >>> leading_present([True, True, False, True])
    2
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable, Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar, cast

from kvplug.checks import memory_module
from kvplug.errors import BackendError, LayoutMismatch
from kvplug.keys import CacheKey
from kvplug.url import BackendURL

if TYPE_CHECKING:
    from kvplug.memory import MemoryObj

T = TypeVar("T")


class TranslatesErrors(Protocol):
    """A backend, as :func:`put_each` uses it: its URL and its errors' translation."""

    url: BackendURL

    def translate_error(
        self, operation: str, error: Exception, args: Sequence[object] = ()
    ) -> Exception: ...


def release_objects(objs: Iterable[object]) -> None:
    """Release every memory object among ``objs`` (anything else, ``None`` for a miss, is
    skipped)."""
    memory_obj = memory_module().MemoryObj
    for obj in objs:
        if isinstance(obj, memory_obj):
            obj.release()


async def gather_all(operations: Iterable[Awaitable[T]]) -> list[T]:
    """Await ``operations`` concurrently; once every one has finished, raise the first error,
    else return the results in order. Nothing is left running when it raises."""
    results = await asyncio.gather(*operations, return_exceptions=True)
    error = next((r for r in results if isinstance(r, BaseException)), None)
    if error is not None:
        raise error
    return cast(list[T], results)


async def gather_reads(reads: Iterable[Awaitable[MemoryObj | None]]) -> list[MemoryObj | None]:
    """The objects ``reads`` return, awaited concurrently, in order. When one fails, or the
    caller is cancelled, nothing they read stays allocated: the reads still running are
    cancelled and awaited, every object read is released, and the error (or cancellation) is
    raised."""
    tasks = [asyncio.ensure_future(read) for read in reads]
    try:
        results = await asyncio.gather(*tasks, return_exceptions=True)
    except asyncio.CancelledError as first:
        # gather cancelled the reads; some may have finished first, holding an object each.
        last = first
        while not all(task.done() for task in tasks):
            try:
                await asyncio.wait(tasks)
            except asyncio.CancelledError as again:
                last = again
        release_objects(
            task.result() for task in tasks if not task.cancelled() and task.exception() is None
        )
        raise last from None
    error = next((r for r in results if isinstance(r, BaseException)), None)
    objs = [r for r in results if not isinstance(r, BaseException)]
    if error is not None:
        release_objects(objs)
        raise error
    return objs


async def put_each(
    backend: TranslatesErrors, keys: Sequence[object], puts: Iterable[Awaitable[None]]
) -> None:
    """Await ``puts`` (one per key) concurrently; once all have finished, raise the first error
    as a kvplug error (:meth:`~kvplug.backend.Backend.translate_error`) whose ``stored`` tells
    which keys were stored, and whose message says so when some were."""
    results = await asyncio.gather(*puts, return_exceptions=True)
    error = next((r for r in results if isinstance(r, BaseException)), None)
    if error is None:
        return
    if not isinstance(error, Exception):
        raise error
    translated = backend.translate_error("batched_put", error, [keys])
    stored = tuple(not isinstance(r, BaseException) for r in results)
    if isinstance(translated, BackendError) and translated.stored is None and any(stored):
        position = results.index(error)
        message = (
            f"batched_put of {len(keys)} objects into {backend.url}: {sum(stored)} stored and "
            f"{stored.count(False)} not; the stored ones stay stored and readable. The first "
            f"failure, of {keys[position]} (position {position}): {translated}"
        )
        try:
            translated = type(translated)(message)
        except TypeError:  # a plugin's error class with arguments of its own
            translated = BackendError(message)
    if isinstance(translated, BackendError) and translated.stored is None:
        translated.stored = stored
    if translated is error:
        raise error
    raise translated from error


def fill_into(
    found: Sequence[MemoryObj | None], dests: Sequence[MemoryObj], keys: Sequence[CacheKey]
) -> list[bool]:
    """Copy each object of ``found`` into the ``dests`` object at its position (one that
    already is its destination is left as it is), release every object of ``found``, and say
    which destinations now hold their object: the end of a ``get_into`` that read into memory
    of its own. An object of another size than its destination raises
    :class:`~kvplug.errors.LayoutMismatch` naming its key (``keys`` are aligned with
    ``found``)."""
    hits = []
    try:
        for key, got, dest in zip(keys, found, dests, strict=True):
            if got is not None and got.nbytes != dest.nbytes:
                raise LayoutMismatch.between(
                    key, (got.shape, got.dtype, got.nbytes), (dest.shape, dest.dtype, dest.nbytes)
                )
            hits.append(got is not None)
            if got is not None and got is not dest:
                dest.raw.copy_(got.raw)
    finally:
        for got in found:
            if got is not None:
                got.release()
    return hits


def leading_present(found: Sequence[bool]) -> int:
    """How many leading entries of ``found`` are true: ``batched_contains`` from
    ``batched_exists``."""
    return next((i for i, present in enumerate(found) if not present), len(found))


__all__ = [
    "TranslatesErrors",
    "fill_into",
    "gather_all",
    "gather_reads",
    "leading_present",
    "put_each",
    "release_objects",
]
