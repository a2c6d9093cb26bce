"""``aesgcm::<url>``: encryption at rest for backends that store memory objects rather than bytes
(``file://``, ``gds://``, ``lm://``, ``mooncakestore://``, ``cpu://``, a vendor's backend).

A byte store takes the serde (``?serde=aesgcm``); a backend that keeps objects as they are has
no serde, so this wrapper seals each object before it reaches the backend: the backend stores a
flat ``uint8`` object holding a kvplug frame (:mod:`kvplug.frame`) whose payload is the
``aesgcm`` serde's, and every read opens and checks it. Options are the serde's, in the
wrapper's own query::

    aesgcm://?key_file=/etc/kvplug/keys&per_tenant=true::file:///var/lib/kvplug

A value that fails to open (altered, moved under another key, not sealed at all) is a counted
miss and is removed; one sealed with a key this reader does not hold is a counted miss that
stays. Example::

    >>> import asyncio, os, torch, kvplug
    >>> os.environ["EXAMPLE_SEALING_KEYS"] = "1:" + "C" * 43 + "="
    >>> async def demo():
    ...     url = "aesgcm://?key_env=EXAMPLE_SEALING_KEYS::cpu://"
    ...     async with await kvplug.open_backend(url) as backend:
    ...         key = kvplug.CacheKey("llama", 1, 0, 7)
    ...         obj = kvplug.MemoryObj.from_tensor(torch.arange(4.0))
    ...         await backend.put(key, obj)
    ...         stored = await backend.inner.get(key)
    ...         copy = await backend.get(key)
    ...         shapes = stored.shape, copy.tensor.tolist()
    ...         stored.release(), copy.release()
    ...         return shapes
    >>> asyncio.run(demo())
    ((116,), [0.0, 1.0, 2.0, 3.0])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from kvplug.batches import fill_into, release_objects
from kvplug.damage import DamagedValues
from kvplug.errors import CorruptObject
from kvplug.frame import decode_frame, encode_header, header_len, payload_checksum
from kvplug.keys import CacheKey
from kvplug.memory import Allocator, MemoryFormat, MemoryObj
from kvplug.options import BackendOptions
from kvplug.url import BackendURL
from kvplug.wrapper import Wrapper
from kvplug_aesgcm.serde import OVERHEAD, AESGCMOptions, AESGCMSerde


class SealingOptions(BackendOptions, AESGCMOptions):
    """The ``aesgcm::`` wrapper's options: the serde's (``key_file`` or ``key_env``,
    ``key_id``, ``per_tenant``), without a prefix."""


class SealingWrapper(Wrapper):
    """Seals every object with the ``aesgcm`` serde before the inner backend stores it, and
    opens it on every read. See the module's description."""

    Options: ClassVar[type[BackendOptions]] = SealingOptions
    options: SealingOptions

    def __init__(
        self,
        url: BackendURL | str,
        *,
        inner: Any,
        allocator: Allocator | None = None,
        **options: Any,
    ) -> None:
        super().__init__(url, inner=inner, allocator=allocator, **options)
        self.serde = AESGCMSerde(self.options)
        remove = inner.remove if inner.capabilities.remove else None
        self.damaged_values = DamagedValues[CacheKey](self.url, remove=remove)
        """Values that did not open, read as misses: counted, logged, removed unless they are
        only sealed with a key this reader lacks."""

    @property
    def corrupt_objects(self) -> int:
        """:class:`~kvplug.capabilities.CountsCorruptObjects`: values read as misses so far."""
        return self.damaged_values.count

    def _sealed_copy(self, key: CacheKey, obj: MemoryObj) -> MemoryObj:
        head = header_len(len(obj.shape), self.serde.name)
        size = head + obj.nbytes + OVERHEAD
        sealed = self.allocator.allocate((size,), torch.uint8, MemoryFormat.BINARY_BUFFER)
        if sealed is not None and sealed.device.type != "cpu":
            sealed.release()
            sealed = None
        if sealed is None:  # the allocator is full or on the GPU: seal in host memory
            sealed = MemoryObj.from_tensor(torch.empty(size, dtype=torch.uint8))
        try:
            view = sealed.memoryview()
            payload = view[head:]
            self.serde.seal_into(obj, key, payload)
            view[:head] = encode_header(
                obj.shape, obj.dtype, obj.fmt, self.serde.name, payload, payload_checksum(payload)
            )
        except BaseException:
            sealed.release()
            raise
        return sealed

    def _unsealed(self, key: CacheKey, stored: MemoryObj) -> MemoryObj | None:
        host = stored if stored.device.type == "cpu" else MemoryObj.from_tensor(stored.raw.cpu())
        return decode_frame(host.memoryview(), self.allocator, serde=self.serde, key=key)

    async def _unseal_all(
        self, keys: Sequence[CacheKey], found: Sequence[MemoryObj | None]
    ) -> list[MemoryObj | None]:
        """Open each object ``found`` (releasing it as soon as it is opened, so that a batch
        needs room for one opened object more than the inner backend's, not twice as much)."""
        opened: list[MemoryObj | None] = []
        damaged: dict[CacheKey, CorruptObject] = {}
        pending = list(found)
        try:
            for index, key in enumerate(keys):
                stored, pending[index] = pending[index], None
                if stored is None:
                    opened.append(None)
                    continue
                try:
                    opened.append(self._unsealed(key, stored))
                except CorruptObject as error:
                    opened.append(None)
                    damaged[key] = error
                finally:
                    stored.release()
        except BaseException:
            release_objects(opened)
            raise
        finally:
            release_objects(pending)
        await self.damaged_values.drop(damaged)
        return opened

    async def _get(self, key: CacheKey) -> MemoryObj | None:
        return (await self._unseal_all([key], [await self.inner.get(key)]))[0]

    async def _batched_get(self, keys: Sequence[CacheKey]) -> list[MemoryObj | None]:
        return await self._unseal_all(keys, await self.inner.batched_get(keys))

    async def _get_into(self, key: CacheKey, dest: MemoryObj) -> bool:
        return fill_into([await self._get(key)], [dest], [key])[0]

    async def _batched_get_into(
        self, keys: Sequence[CacheKey], dests: Sequence[MemoryObj]
    ) -> list[bool]:
        return fill_into(await self._batched_get(keys), dests, keys)

    async def _put(self, key: CacheKey, obj: MemoryObj) -> None:
        sealed = self._sealed_copy(key, obj)
        try:
            await self.inner.put(key, sealed)
        finally:
            sealed.release()

    async def _batched_put(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]) -> None:
        sealed: list[MemoryObj] = []
        try:
            for key, obj in zip(keys, objs, strict=True):
                sealed.append(self._sealed_copy(key, obj))
            await self.inner.batched_put(keys, sealed)
        finally:
            release_objects(sealed)


__all__ = ["SealingOptions", "SealingWrapper"]
