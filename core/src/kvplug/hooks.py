"""The hooks a backend implements (:class:`BackendHooks`), the defaults of those it may leave
out, and which hooks each capability needs. :class:`~kvplug.backend.Backend`'s docstring says
which to implement when."""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, ClassVar

from kvplug.batches import fill_into, gather_all, gather_reads, leading_present, put_each
from kvplug.errors import NotSupported
from kvplug.keys import CacheKey
from kvplug.url import BackendURL

if TYPE_CHECKING:
    from kvplug.memory import MemoryObj


class BackendHooks(abc.ABC):
    """The hooks of :class:`~kvplug.backend.Backend`. They receive checked arguments, run only
    while the backend is open, and may rely on the caller's objects staying alive while they
    are awaited; one that hands an object's memory to work that outlives its own await (a
    thread still running after a deadline cancelled the await, a socket still receiving)
    retains it for that work."""

    url: BackendURL

    _GATES: ClassVar[dict[str, tuple[str, ...]]] = {
        "pin": ("_pin", "_unpin"),
        "remove": ("_remove",),
        "list_keys": ("_list_keys",),
        "native_batching": ("_batched_get", "_batched_put", "_batched_exists"),
    }
    """The hooks each capability needs (``a|b``: either); a class that declares the capability
    and keeps the default of a hook (the one of the class defining ``_GATES``) is refused."""

    if TYPE_CHECKING:

        def translate_error(
            self, operation: str, error: Exception, args: Sequence[object] = ()
        ) -> Exception: ...

    @classmethod
    def missing_hooks(cls, capability: str) -> list[str]:
        """The hooks ``capability`` needs that this class leaves at their defaults (``a|b``:
        neither is implemented); empty when it implements them all."""
        base = next(c for c in cls.__mro__ if "_GATES" in c.__dict__)
        return [
            hook
            for hook in cls._GATES.get(capability, ())
            if all(getattr(cls, h) is getattr(base, h) for h in hook.split("|"))
        ]

    def _unsupported(self, capability: str) -> NotSupported:
        """The error of a hook this backend does not implement: reached only past the
        template's capability gate (a backend that declares ``capability`` is refused at class
        creation unless it implements the hook)."""
        return NotSupported(
            f"{type(self).__name__} ({self.url.scheme}://) does not implement the hooks of "
            f"the {capability!r} capability ({', '.join(self.missing_hooks(capability))})."
        )

    async def _open(self) -> None:
        """Connect or prepare. Default: nothing."""

    async def _close(self) -> None:
        """Release every resource; called once. Default: nothing."""

    @abc.abstractmethod
    async def _get(self, key: CacheKey) -> MemoryObj | None:
        """The object stored under ``key`` (a new reference, the caller's) or ``None``."""

    @abc.abstractmethod
    async def _put(self, key: CacheKey, obj: MemoryObj) -> None:
        """Store ``obj`` under ``key``, atomically. Retain ``obj`` to keep it after this
        returns; the caller's reference is not this hook's to release."""

    @abc.abstractmethod
    async def _contains(self, key: CacheKey) -> bool:
        """Whether ``key`` is stored and readable."""

    async def _remove(self, key: CacheKey) -> bool:
        """Delete ``key``; True if it was there. Required with the ``remove`` capability."""
        raise self._unsupported("remove")

    async def _get_into(self, key: CacheKey, dest: MemoryObj) -> bool:
        """Read ``key`` into ``dest``; the default is :meth:`_get` and one copy."""
        return fill_into([await self._get(key)], [dest], [key])[0]

    async def _batched_get(self, keys: Sequence[CacheKey]) -> list[MemoryObj | None]:
        """``_get`` of each key, concurrently; every object read is released if one fails or
        the call is cancelled."""
        return await gather_reads(self._get(k) for k in keys)

    async def _batched_put(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]) -> None:
        """``_put`` of each pair, concurrently; once all have finished, the first error, which
        tells which keys were stored (``stored``)."""
        await put_each(self, keys, (self._put(k, o) for k, o in zip(keys, objs, strict=True)))

    async def _batched_contains(self, keys: Sequence[CacheKey]) -> int:
        """The count of leading keys present, from :meth:`_batched_exists`."""
        return leading_present(await self._batched_exists(keys))

    async def _batched_exists(self, keys: Sequence[CacheKey]) -> list[bool]:
        """``_contains`` of each key, concurrently, aligned with ``keys``. Override it with one
        round trip (a pipeline, a multi-exists, one pass over an index); ``batched_contains``
        follows from it."""
        return [bool(found) for found in await gather_all(self._contains(k) for k in keys)]

    async def _batched_get_into(
        self, keys: Sequence[CacheKey], dests: Sequence[MemoryObj]
    ) -> list[bool]:
        """The default is one :meth:`_batched_get` and one copy per hit."""
        return fill_into(await self._batched_get(keys), dests, keys)

    async def _pin(self, key: CacheKey) -> bool:
        """Pin ``key``; False if absent. Required with the ``pin`` capability."""
        raise self._unsupported("pin")

    async def _unpin(self, key: CacheKey) -> bool:
        """Release one pin of ``key``; never raises for a key without pins."""
        raise self._unsupported("pin")

    def _list_keys(self) -> AsyncIterator[CacheKey]:
        """Every stored key. Required with the ``list_keys`` capability."""
        raise self._unsupported("list_keys")


__all__ = ["BackendHooks"]
