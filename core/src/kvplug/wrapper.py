"""The base of wrappers, backends over another backend: :class:`Wrapper`."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from kvplug.keys import CacheKey
from kvplug.template import Backend
from kvplug.url import BackendURL

if TYPE_CHECKING:
    from kvplug.memory import Allocator, MemoryObj


class Wrapper(Backend):
    """Base of wrappers: a backend over another backend, written before it with ``::``
    (``audit::redis://h:6379``). The registry constructs it with its own URL and
    ``inner=<the wrapped backend>``.

    Every hook forwards to the same public operation of :attr:`inner` (so its batching,
    zero-copy reads and deadlines are kept); a wrapper overrides the hooks it adds behaviour to
    and calls ``self.inner``. Its capabilities and allocator are the inner backend's, its
    ``open`` and ``close`` open and close the inner backend, and it keeps no deadline of its
    own (the inner backend's applies).

    Example::

        >>> import asyncio, kvplug
        >>> from kvplug.backend import Wrapper
        >>> class CountingWrapper(Wrapper):
        ...     async def _get(self, key):
        ...         self.reads = getattr(self, "reads", 0) + 1
        ...         return await self.inner.get(key)
        >>> async def demo() -> int:
        ...     inner = await kvplug.open_backend("cpu://")
        ...     wrapper = CountingWrapper("count://", inner=inner)
        ...     await wrapper.get(kvplug.CacheKey("llama", 1, 0, 7))
        ...     await wrapper.close()
        ...     return wrapper.reads
        >>> asyncio.run(demo())
        1
    """

    def __init__(
        self,
        url: BackendURL | str,
        *,
        inner: Backend,
        allocator: Allocator | None = None,
        **options: Any,
    ) -> None:
        super().__init__(url, allocator=allocator, **options)
        self.inner = inner
        self.capabilities = inner.capabilities

    @property
    def allocator(self) -> Allocator:
        """The inner backend's allocator: objects from ``get`` come from there."""
        return self.inner.allocator

    def deadline(self) -> float | None:
        return None

    def describe(self) -> dict[str, str]:
        return self.inner.describe()

    async def _open(self) -> None:
        await self.inner.open()

    async def _close(self) -> None:
        await self.inner.close()

    async def _get(self, key: CacheKey) -> MemoryObj | None:
        return await self.inner.get(key)

    async def _put(self, key: CacheKey, obj: MemoryObj) -> None:
        await self.inner.put(key, obj)

    async def _contains(self, key: CacheKey) -> bool:
        return await self.inner.contains(key)

    async def _remove(self, key: CacheKey) -> bool:
        return await self.inner.remove(key)

    async def _get_into(self, key: CacheKey, dest: MemoryObj) -> bool:
        return await self.inner.get_into(key, dest)

    async def _batched_get(self, keys: Sequence[CacheKey]) -> list[MemoryObj | None]:
        return await self.inner.batched_get(keys)

    async def _batched_put(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]) -> None:
        await self.inner.batched_put(keys, objs)

    async def _batched_contains(self, keys: Sequence[CacheKey]) -> int:
        return await self.inner.batched_contains(keys)

    async def _batched_exists(self, keys: Sequence[CacheKey]) -> list[bool]:
        return await self.inner.batched_exists(keys)

    async def _batched_get_into(
        self, keys: Sequence[CacheKey], dests: Sequence[MemoryObj]
    ) -> list[bool]:
        return await self.inner.batched_get_into(keys, dests)

    async def _pin(self, key: CacheKey) -> bool:
        return await self.inner.pin(key)

    async def _unpin(self, key: CacheKey) -> bool:
        return await self.inner.unpin(key)

    def _list_keys(self) -> AsyncIterator[CacheKey]:
        return self.inner.list_keys()


__all__ = ["Wrapper"]
