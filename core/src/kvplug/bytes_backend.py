"""The base of stores that move bytes only: :class:`BytesBackend`."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, cast

from kvplug.batches import fill_into, gather_all, put_each, release_objects
from kvplug.damage import DamagedValues
from kvplug.errors import CorruptObject, LayoutMismatch
from kvplug.keys import CacheKey
from kvplug.option_parsing import DefaultOptions
from kvplug.template import Backend
from kvplug.url import BackendURL

if TYPE_CHECKING:
    from kvplug.frame import FrameReceiver
    from kvplug.memory import Allocator, MemoryObj
    from kvplug.options import BackendOptions, BytesBackendOptions
    from kvplug.serde import Serde

Buffer = bytes | bytearray | memoryview
"""A value of a byte store, or a part of one."""


class BytesBackend(Backend):
    """Base of stores that move bytes only. Implement the four ``*_bytes`` hooks; the core
    frames each object (header, checksums, payload; :mod:`kvplug.frame`), applies the serde,
    allocates what ``get`` returns and turns damaged frames into counted, deleted misses.

    Each object is stored as **one** value holding the whole frame, so data and metadata can
    never disagree, and a value is written in one store operation, so readers never see a mix.

    Optional hooks, for stores that do better than one call per key or than a copy:

    * :meth:`batched_get_bytes`, :meth:`batched_put_bytes`, :meth:`batched_exists_bytes`:
      one round trip for many keys (a pipeline, a multi-get);
    * :meth:`receive_frames`: zero-copy reads. A transport that receives a value in pieces
      (a socket, a file) hands each piece to a :class:`~kvplug.frame.FrameReceiver`, which
      puts the payload straight into the memory the caller gets (``get_into``'s buffer, or the
      object ``get`` returns), verifies it and reports damage.

    Every hook receives the store key (:meth:`key_string`: ``key_prefix`` and LMCache's key
    string), already checked, only while the backend is open and within its deadline.
    """

    Options: ClassVar[type[BackendOptions]] = cast(
        "type[BackendOptions]", DefaultOptions("BytesBackendOptions")
    )
    options: BytesBackendOptions
    _GATES: ClassVar[dict[str, tuple[str, ...]]] = {
        **Backend._GATES,
        "remove": ("remove_bytes",),
        "native_batching": (
            "batched_get_bytes|receive_frames",
            "batched_put_bytes",
            "batched_exists_bytes",
        ),
    }

    def __init__(
        self, url: BackendURL | str, *, allocator: Allocator | None = None, **options: Any
    ) -> None:
        super().__init__(url, allocator=allocator, **options)
        from kvplug.serde import open_serde

        self.serde: Serde = open_serde(self.options.serde, self.options.serde_options)
        # Deleted with remove_bytes also where the store does not declare remove but has it.
        self.damaged_values = DamagedValues[str](
            self.url, remove=None if self.missing_hooks("remove") else self.remove_bytes
        )
        """Damaged values read as misses, counted, logged and deleted (clause 6)."""

    @property
    def corrupt_objects(self) -> int:
        """:class:`CountsCorruptObjects`: damaged values read as misses so far."""
        return self.damaged_values.count

    def key_string(self, key: CacheKey) -> str:
        """The store key for ``key``: the prefix and LMCache's string form."""
        return self.options.key_prefix + key.to_string()

    # -- byte hooks ------------------------------------------------------------------------

    @abc.abstractmethod
    async def get_bytes(self, key: str) -> Buffer | None:
        """The stored value, or ``None`` when absent."""

    @abc.abstractmethod
    async def put_bytes(self, key: str, parts: Sequence[Buffer]) -> None:
        """Store the concatenation of ``parts`` as one value, replacing any old one atomically.
        The parts are valid only until this returns."""

    @abc.abstractmethod
    async def contains_bytes(self, key: str) -> bool:
        """Whether a value is stored under ``key``."""

    async def remove_bytes(self, key: str) -> bool:
        """Delete ``key``'s value; True if it was there. Required with the ``remove``
        capability; without it, damaged values cannot be deleted and are only counted."""
        raise self._unsupported("remove")

    async def batched_get_bytes(self, keys: Sequence[str]) -> list[Buffer | None]:
        """:meth:`get_bytes` of each key, aligned; default: concurrently, one call each."""
        return await gather_all(self.get_bytes(key) for key in keys)

    async def batched_put_bytes(
        self, keys: Sequence[str], values: Sequence[Sequence[Buffer]]
    ) -> None:
        """:meth:`put_bytes` of each pair; default: concurrently, one call each, and the first
        error once all have finished, telling which keys were stored (``stored``)."""
        await put_each(
            self, keys, (self.put_bytes(k, v) for k, v in zip(keys, values, strict=True))
        )

    async def batched_exists_bytes(self, keys: Sequence[str]) -> list[bool]:
        """:meth:`contains_bytes` of each key, aligned; default: concurrently, one call each."""
        return await gather_all(self.contains_bytes(key) for key in keys)

    async def receive_frames(self, keys: Sequence[str], receivers: Sequence[FrameReceiver]) -> None:
        """Read the value of each key into its receiver: for a stored value call
        ``receivers[i].start(length)`` and feed it (see :class:`~kvplug.frame.FrameReceiver`);
        for an absent key leave it untouched. The default is one :meth:`batched_get_bytes` and
        :meth:`~kvplug.frame.FrameReceiver.receive` of each value (one copy of the payload).

        A transport that may still write into a receiver's memory after this returns or
        raises (a socket buffer) must be stopped first: abort it before raising."""
        for value, receiver in zip(await self.batched_get_bytes(keys), receivers, strict=True):
            if value is not None:
                receiver.receive(value)

    # -- the object hooks, on the byte hooks -----------------------------------------------

    async def read_raw(self, key: CacheKey) -> bytes | None:
        """:class:`RawValues`: the stored frame of ``key`` as it is."""
        self.ensure_open()
        try:
            value = await self.get_bytes(self.key_string(key))
        except Exception as error:
            self._hook_failed("read_raw", (key,), error)
        return None if value is None else bytes(value)

    async def write_raw(self, key: CacheKey, data: bytes) -> None:
        """:class:`RawValues`: overwrite the stored value of ``key`` with ``data``."""
        self.ensure_open()
        try:
            await self.put_bytes(self.key_string(key), [data])
        except Exception as error:
            self._hook_failed("write_raw", (key,), error)

    async def _read(
        self, keys: Sequence[CacheKey], dests: Sequence[MemoryObj | None]
    ) -> list[MemoryObj | None]:
        from kvplug.frame import FrameReceiver

        names = [self.key_string(key) for key in keys]
        receivers = [
            FrameReceiver(self.allocator, into=dest, serde=self.serde, key=key)
            for key, dest in zip(keys, dests, strict=True)
        ]
        results: list[MemoryObj | None] = []
        damaged: dict[str, CorruptObject] = {}
        try:
            await self.receive_frames(names, receivers)
            for name, receiver in zip(names, receivers, strict=True):
                try:
                    results.append(receiver.finish())
                except CorruptObject as error:
                    results.append(None)
                    damaged[name] = error
        except BaseException:
            for receiver in receivers:
                receiver.abandon()
            release_objects(results)
            raise
        await self.damaged_values.drop(damaged)
        for key, receiver in zip(keys, receivers, strict=True):
            if receiver.mismatch is not None and receiver.into is not None:
                release_objects(results)
                header, into = receiver.mismatch, receiver.into
                raise LayoutMismatch.between(
                    key,
                    (header.shape, header.dtype, header.payload_len),
                    (into.shape, into.dtype, into.nbytes),
                )
        return results

    async def _get(self, key: CacheKey) -> MemoryObj | None:
        return (await self._read([key], [None]))[0]

    async def _batched_get(self, keys: Sequence[CacheKey]) -> list[MemoryObj | None]:
        return await self._read(keys, [None] * len(keys))

    async def _get_into(self, key: CacheKey, dest: MemoryObj) -> bool:
        return fill_into(await self._read([key], [dest]), [dest], [key])[0]

    async def _batched_get_into(
        self, keys: Sequence[CacheKey], dests: Sequence[MemoryObj]
    ) -> list[bool]:
        return fill_into(await self._read(keys, dests), dests, keys)

    async def _put(self, key: CacheKey, obj: MemoryObj) -> None:
        from kvplug.frame import encode_frame

        await self.put_bytes(self.key_string(key), encode_frame(obj, self.serde, key))

    async def _batched_put(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]) -> None:
        from kvplug.frame import encode_frame

        await self.batched_put_bytes(
            [self.key_string(key) for key in keys],
            [encode_frame(obj, self.serde, key) for key, obj in zip(keys, objs, strict=True)],
        )

    async def _contains(self, key: CacheKey) -> bool:
        return await self.contains_bytes(self.key_string(key))

    async def _batched_exists(self, keys: Sequence[CacheKey]) -> list[bool]:
        return await self.batched_exists_bytes([self.key_string(key) for key in keys])

    async def _remove(self, key: CacheKey) -> bool:
        return await self.remove_bytes(self.key_string(key))


__all__ = ["Buffer", "BytesBackend"]
