"""Backends for the contract suite's self-test (``tests/test_contract_suite.py``).

:class:`RefBackend` is a correct in-memory store that declares every capability it honours, so
that every clause of the contract (docs/concepts.md, "Backends") applies to it. Each other
class is a small subclass that breaks exactly one clause, the way real backends break it. The
self-test writes this file into pytester's run directory, where a conftest registers every
class under its :data:`BACKENDS` scheme and lets the suite pause and stop the simulated server
through :data:`SERVER`.

Every backend opened on one URL path (and ``max_size``) talks to one simulated :class:`Store`
kept at class level, so data survives ``close`` and a reopen (``persistent``) and every backend
opened on the URL sees it (``shared_across_processes``, simulated within one process).
"""

from __future__ import annotations

import abc
import asyncio
import functools
import json
import socket
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import ClassVar, TypeVar

import torch
from pydantic import Field, field_validator

from kvplug import (
    Backend,
    BackendSpec,
    BackendUnavailable,
    BytesBackend,
    CacheKey,
    Capabilities,
    CapacityExceeded,
    FreeListAllocator,
    MemoryObj,
    NotSupported,
    register_backend,
)
from kvplug.backend import BackendOptions, Buffer, BytesBackendOptions
from kvplug.errors import BackendClosed, CorruptObject
from kvplug.frame import decode_frame, decode_header, encode_header
from kvplug.keys import TENANT_TAG
from kvplug.serde import get_serde
from kvplug.units import parse_size

T = TypeVar("T")

POLL = 0.005


class ServerState:
    """The simulated server's health: paused (requests wait) or stopped (refused)."""

    def __init__(self) -> None:
        self.paused = False
        self.stopped = False

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def stop(self) -> None:
        self.stopped = True

    def start(self) -> None:
        self.stopped = False

    def reset(self) -> None:
        self.paused = self.stopped = False


SERVER = ServerState()


class Store:
    """What the simulated server holds for one URL: values in LRU order and pin deadlines."""

    def __init__(self, max_size: int | None) -> None:
        self.lock = threading.Lock()
        self.max_size = max_size
        self.values: OrderedDict[str, bytes] = OrderedDict()
        self.pins: dict[str, list[float]] = {}
        self.held = 0

    def pinned(self, key: str) -> bool:
        now = time.monotonic()
        live = [deadline for deadline in self.pins.get(key, []) if deadline > now]
        if live:
            self.pins[key] = live
        else:
            self.pins.pop(key, None)
        return bool(live)

    def get(self, key: str) -> bytes | None:
        value = self.values.get(key)
        if value is not None:
            self.values.move_to_end(key)
        return value

    def evictable(self, exclude: str) -> str | None:
        return next((k for k in self.values if k != exclude and not self.pinned(k)), None)

    def put(self, key: str, value: bytes) -> None:
        old = len(self.values.get(key, b""))
        if self.max_size is not None:
            if len(value) > self.max_size:
                raise CapacityExceeded(
                    f"a value of {len(value)} bytes is larger than the store ({self.max_size})"
                )
            while self.held - old + len(value) > self.max_size:
                victim = self.evictable(exclude=key)
                if victim is None:
                    raise CapacityExceeded(f"the store of {self.max_size} bytes is full of pins")
                self.remove(victim)
        self.values[key] = value
        self.values.move_to_end(key)
        self.held += len(value) - old

    def remove(self, key: str) -> bool:
        self.pins.pop(key, None)
        value = self.values.pop(key, None)
        if value is None:
            return False
        self.held -= len(value)
        return True

    def pin(self, key: str, ttl: float) -> bool:
        if key not in self.values:
            return False
        self.pins.setdefault(key, []).append(time.monotonic() + ttl)
        return True

    def unpin(self, key: str) -> bool:
        if not self.pinned(key):
            return False
        self.pins[key].pop(0)
        return True


class RefOptions(BytesBackendOptions):
    """Options of the reference backend."""

    timeout: float = Field(1.0, gt=0, description="deadline of one operation, in seconds")
    max_size: int | None = Field(None, description="bytes the store holds; unbounded if unset")
    pin_ttl: float = Field(300.0, gt=0, description="seconds a pin lasts")
    trace_file: str = Field("", description="open() appends its options here as a JSON line")

    @field_validator("max_size", mode="before")
    @classmethod
    def _parse_max_size(cls, value: object) -> int | None:
        return None if value is None else parse_size(value, what="max_size")


class RefBackend(BytesBackend):
    """A correct store: recovery, pins with expiry, LRU eviction, framed values, batched byte
    operations. Its deadlines are the template's."""

    capabilities = Capabilities(
        pin=True,
        persistent=True,
        shared_across_processes=True,
        native_batching=True,
        remove=True,
        list_keys=True,
        releases_on_cancel=True,
    )
    Options: ClassVar[type[BackendOptions]] = RefOptions
    contract_small_options: ClassVar[dict[str, object] | None] = {"max_size": "4MiB"}
    options: RefOptions
    stores: ClassVar[dict[tuple[str, str, int | None], Store]] = {}
    stores_lock: ClassVar[threading.Lock] = threading.Lock()

    async def _open(self) -> None:
        key = (type(self).__name__, self.url.path, self.options.max_size)
        with self.stores_lock:
            self.store = self.stores.setdefault(key, Store(self.options.max_size))
        if self.options.trace_file:
            with Path(self.options.trace_file).open("a") as trace:
                trace.write(json.dumps(self.options.model_dump()) + "\n")

    async def on_server(self, what: str, operation: Callable[[Store], T]) -> T:
        """Run ``operation`` on the simulated server, waiting while it is paused."""
        while True:
            self.ensure_open()  # an operation in flight ends when the backend closes
            if SERVER.stopped:
                raise BackendUnavailable(f"{what} on {self.url}: the server refused the connection")
            if not SERVER.paused:
                with self.store.lock:
                    return operation(self.store)
            await asyncio.sleep(POLL)

    async def get_bytes(self, key: str) -> Buffer | None:
        return await self.on_server("get", lambda store: store.get(key))

    async def put_bytes(self, key: str, parts: Sequence[Buffer]) -> None:
        value = b"".join(parts)
        await self.on_server("put", lambda store: store.put(key, value))

    async def contains_bytes(self, key: str) -> bool:
        return await self.on_server("contains", lambda store: key in store.values)

    async def remove_bytes(self, key: str) -> bool:
        return await self.on_server("remove", lambda store: store.remove(key))

    async def batched_get_bytes(self, keys: Sequence[str]) -> list[Buffer | None]:
        return await self.on_server("batched_get", lambda store: [store.get(k) for k in keys])

    async def batched_put_bytes(
        self, keys: Sequence[str], values: Sequence[Sequence[Buffer]]
    ) -> None:
        joined = [b"".join(parts) for parts in values]

        def put_all(store: Store) -> None:
            for key, value in zip(keys, joined, strict=True):
                store.put(key, value)

        await self.on_server("batched_put", put_all)

    async def batched_exists_bytes(self, keys: Sequence[str]) -> list[bool]:
        return await self.on_server("batched_exists", lambda s: [k in s.values for k in keys])

    async def _pin(self, key: CacheKey) -> bool:
        ttl = self.options.pin_ttl
        return await self.on_server("pin", lambda store: store.pin(self.key_string(key), ttl))

    async def _unpin(self, key: CacheKey) -> bool:
        return await self.on_server("unpin", lambda store: store.unpin(self.key_string(key)))

    async def _list_keys(self) -> AsyncIterator[CacheKey]:
        prefix = self.options.key_prefix
        names = await self.on_server("list", lambda store: list(store.values))
        for name in names:
            if name.startswith(prefix):
                yield CacheKey.parse(name[len(prefix) :])


class ReadsItsOwnWay(RefBackend):
    """Base of the broken readers below: ``get`` (and the batched and ``get_into`` forms
    through it) decodes the stored value with :meth:`decode` instead of the core's receiver,
    as a vendor who overrides the object hooks does."""

    @abc.abstractmethod
    async def decode(self, name: str, data: Buffer | None) -> MemoryObj | None:
        """The object in a stored value, or None."""

    async def _get(self, key: CacheKey) -> MemoryObj | None:
        name = self.key_string(key)
        return await self.decode(name, await self.get_bytes(name))

    async def _batched_get(self, keys: Sequence[CacheKey]) -> list[MemoryObj | None]:
        return [await self._get(key) for key in keys]

    _get_into = Backend._get_into
    _batched_get_into = Backend._batched_get_into


def _bypass_template(cls: type[Backend], name: str, method: Callable[..., object]) -> None:
    """Replace a public operation of ``cls`` after the class exists: what the template refuses
    at class creation, so that the suite is shown to catch the defect even in a backend that
    went around the template."""
    setattr(cls, name, method)


# -- broken backends, one clause each ------------------------------------------------------------


class GetRaisesOnMiss(RefBackend):
    """Clause 1: a miss raises instead of returning None."""

    async def get_bytes(self, key: str) -> Buffer | None:
        value = await super().get_bytes(key)
        if value is None:
            raise KeyError(key)
        return value

    async def batched_get_bytes(self, keys: Sequence[str]) -> list[Buffer | None]:
        return [await self.get_bytes(key) for key in keys]


class FlipsABitOnRead(RefBackend):
    """Clause 2: every read returns the object with one bit flipped."""

    async def _get(self, key: CacheKey) -> MemoryObj | None:
        obj = await super()._get(key)
        if obj is not None:
            obj.raw[obj.nbytes // 3] ^= 0x04
        return obj

    async def _batched_get(self, keys: Sequence[CacheKey]) -> list[MemoryObj | None]:
        return [await self._get(key) for key in keys]

    _get_into = Backend._get_into
    _batched_get_into = Backend._batched_get_into


class StoresBfloat16AsFloat16(RefBackend):
    """Clause 2: the stored header records bfloat16 objects as float16."""

    async def _put(self, key: CacheKey, obj: MemoryObj) -> None:
        payload = self.serde.encode(obj)
        dtype = torch.float16 if obj.dtype == torch.bfloat16 else obj.dtype
        header = encode_header(obj.shape, dtype, obj.fmt, self.serde.name, payload)
        await self.put_bytes(self.key_string(key), (header, payload))

    async def _batched_put(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]) -> None:
        for key, obj in zip(keys, objs, strict=True):
            await self._put(key, obj)


def _decode_unchecked(data: Buffer, backend: BytesBackend) -> MemoryObj | None:
    """Decode a frame trusting its header and skipping the payload checksum."""
    view = memoryview(data).cast("B")
    header = decode_header(view)
    payload = view[header.header_len : header.header_len + header.payload_len]
    if payload.nbytes != header.payload_len:
        payload = memoryview(bytes(payload) + bytes(header.payload_len - payload.nbytes))
    obj = backend.allocator.allocate(header.shape, header.dtype, header.fmt)
    if obj is not None:
        get_serde(header.serde).decode(payload, obj)
    return obj


class UncheckedReads(ReadsItsOwnWay):
    """Clause 6: reads skip the payload checksum, so damaged payloads are served as data."""

    async def decode(self, name: str, data: Buffer | None) -> MemoryObj | None:
        if data is None:
            return None
        try:
            return _decode_unchecked(data, self)
        except CorruptObject as error:
            await self.damaged_values.drop({name: error})
            return None


class TearsOverwrites(UncheckedReads):
    """Clause 3: an overwrite lands in two halves with a pause between, and reads do not check
    the payload checksum, so a concurrent reader sees the new header over a mixed payload."""

    async def put_bytes(self, key: str, parts: Sequence[Buffer]) -> None:
        value = b"".join(parts)
        old = await self.on_server("get", lambda store: store.values.get(key))
        if old is not None and len(old) == len(value):
            half = len(value) // 2
            await self.on_server("put", lambda store: store.put(key, value[:half] + old[half:]))
            await asyncio.sleep(0.002)
        await self.on_server("put", lambda store: store.put(key, value))


class KeepsDamagedData(ReadsItsOwnWay):
    """Clause 6: damaged data reads as a miss but stays stored and is not counted."""

    async def decode(self, name: str, data: Buffer | None) -> MemoryObj | None:
        try:
            return None if data is None else decode_frame(data, self.allocator)
        except CorruptObject:
            return None


class CountsAllPresentKeys(RefBackend):
    """Clause 4: batched_contains counts every present key, not the leading run."""

    async def _batched_contains(self, keys: Sequence[CacheKey]) -> int:
        return sum([await self._contains(key) for key in keys])


class ExistsAnswersInKeyOrder(RefBackend):
    """Clause 4: batched_exists answers in the order of the sorted keys (as a server that
    returns a set would), not in the order asked."""

    async def batched_exists_bytes(self, keys: Sequence[str]) -> list[bool]:
        found = dict(zip(keys, await super().batched_exists_bytes(keys), strict=True))
        return [found[key] for key in sorted(keys)]


class BatchedGetDropsMisses(RefBackend):
    """Clause 4: batched_get returns the hits first, so results shift against the keys."""

    async def _batched_get(self, keys: Sequence[CacheKey]) -> list[MemoryObj | None]:
        found = await super()._batched_get(keys)
        hits: list[MemoryObj | None] = [obj for obj in found if obj is not None]
        return hits + [None] * (len(keys) - len(hits))


class LeaksPutReference(RefBackend):
    """Clause 5: put retains the object and never releases it (so it cannot claim
    ``releases_on_cancel`` either: that clause would fail too, for the same leak)."""

    capabilities = replace(RefBackend.capabilities, releases_on_cancel=False)

    async def _put(self, key: CacheKey, obj: MemoryObj) -> None:
        obj.retain()
        await super()._put(key, obj)

    async def _batched_put(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]) -> None:
        for key, obj in zip(keys, objs, strict=True):
            await self._put(key, obj)


class PutTakesCallersReference(RefBackend):
    """Clause 5: put releases the caller's reference as if it owned it."""

    async def _put(self, key: CacheKey, obj: MemoryObj) -> None:
        await super()._put(key, obj)
        obj.release()

    async def _batched_put(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]) -> None:
        for key, obj in zip(keys, objs, strict=True):
            await self._put(key, obj)


class RemoveAlwaysTrue(RefBackend):
    """Clause 7: remove reports True even for a key that was never stored."""

    async def _remove(self, key: CacheKey) -> bool:
        await super()._remove(key)
        return True


class ContainsRemembersRemoved(RefBackend):
    """Clause 7: contains says True for every key ever put, also after its remove."""

    ever: ClassVar[set[str]] = set()

    async def put_bytes(self, key: str, parts: Sequence[Buffer]) -> None:
        await super().put_bytes(key, parts)
        self.ever.add(key)

    async def contains_bytes(self, key: str) -> bool:
        return key in self.ever or await super().contains_bytes(key)


class EvictsPinnedKeys(RefBackend):
    """Clause 8: eviction picks the least recently used key, pinned or not."""

    async def _open(self) -> None:
        await super()._open()
        store = self.store

        def least_recently_used(exclude: str) -> str | None:
            return next((key for key in store.values if key != exclude), None)

        store.evictable = least_recently_used  # type: ignore[method-assign]


class UnpinRaisesWhenNotPinned(RefBackend):
    """Clause 8: unpin of a key holding no pin raises."""

    async def _unpin(self, key: CacheKey) -> bool:
        if not await super()._unpin(key):
            raise KeyError(f"{key} is not pinned")
        return True


class PinsNeverExpire(RefBackend):
    """Clause 8: pin_ttl is accepted but ignored."""

    async def _pin(self, key: CacheKey) -> bool:
        forever = float(1 << 40)
        return await self.on_server("pin", lambda store: store.pin(self.key_string(key), forever))


class FullStoreRaisesRuntimeError(RefBackend):
    """Clause 9: a full store raises RuntimeError instead of CapacityExceeded or evicting."""

    async def put_bytes(self, key: str, parts: Sequence[Buffer]) -> None:
        value = b"".join(parts)

        def put(store: Store) -> None:
            if store.max_size is not None and store.held + len(value) > store.max_size:
                raise RuntimeError("store full")
            store.put(key, value)

        await self.on_server("put", put)

    async def batched_put_bytes(
        self, keys: Sequence[str], values: Sequence[Sequence[Buffer]]
    ) -> None:
        for key, parts in zip(keys, values, strict=True):
            await self.put_bytes(key, parts)


class FullStoreStopsReads(RefBackend):
    """Clause 9: once the store is nearly full, reads fail as if they needed room."""

    async def get_bytes(self, key: str) -> Buffer | None:
        def get(store: Store) -> bytes | None:
            if store.max_size is not None and store.held > store.max_size * 3 // 4:
                raise CapacityExceeded("no room left to read into")
            return store.get(key)

        return await self.on_server("get", get)

    async def batched_get_bytes(self, keys: Sequence[str]) -> list[Buffer | None]:
        return [await self.get_bytes(key) for key in keys]


class NoDeadline(RefBackend):
    """Clause 10: turns the template's deadline off, so while the server is paused,
    operations wait for it forever."""

    def deadline(self) -> float | None:
        return None


class NoRecoveryAfterRestart(RefBackend):
    """Clause 10: keeps the connection the server reset, so after a restart every operation
    fails with the raw socket error until the backend is reopened."""

    reset = False

    async def on_server(self, what: str, operation: Callable[[Store], T]) -> T:
        if self.reset:
            raise ConnectionResetError(104, "Connection reset by peer")
        try:
            return await super().on_server(what, operation)
        except BackendUnavailable:
            self.reset = True
            raise


class CloseBlocksTheLoop(RefBackend):
    """Clause 11: close joins a worker synchronously, blocking the event loop (and so every
    deadline) for longer than the suite waits."""

    async def _close(self) -> None:
        time.sleep(3.0)


class WorksAfterClose(RefBackend):
    """Clause 11: close does nothing; the backend keeps working."""

    def ensure_open(self) -> None:
        pass


class SecondCloseRaises(RefBackend):
    """Clause 11: close is not idempotent (its close replaced the template's)."""


async def _close_once_then_raise(self: RefBackend) -> None:
    if self._closed:
        raise BackendClosed(f"{self.url} is already closed")
    self._closed = True


_bypass_template(SecondCloseRaises, "close", _close_once_then_raise)


class IgnoresModelName(RefBackend):
    """Clause 12: the store key leaves out the model name, so models share keys."""

    def key_string(self, key: CacheKey) -> str:
        return super().key_string(replace(key, model_name="model"))


class IgnoresWorkerId(RefBackend):
    """Clause 12: the store key leaves out the worker, so tensor-parallel ranks share keys."""

    def key_string(self, key: CacheKey) -> str:
        return super().key_string(replace(key, world_size=1, worker_id=0))


class DropsTheTenant(RefBackend):
    """Clause 16: the store key leaves out the tenant, so tenants share each other's chunks
    (every other tag is kept: clause 12's tests pass)."""

    def key_string(self, key: CacheKey) -> str:
        tags = tuple(tag for tag in key.tags if tag[0] != TENANT_TAG)
        return super().key_string(replace(key, tags=tags))


class DeclaresPinButCannot(RefBackend):
    """Clause 13: declares pin, but pin and unpin raise NotSupported."""

    async def _pin(self, key: CacheKey) -> bool:
        raise NotSupported("pinning is not implemented yet")

    async def _unpin(self, key: CacheKey) -> bool:
        raise NotSupported("pinning is not implemented yet")


class UndeclaredRemoveWorks(RefBackend):
    """Clause 13: does not declare remove, yet remove silently deletes (its remove replaced
    the template's)."""

    capabilities = replace(RefBackend.capabilities, remove=False)


async def _remove_without_capability(self: RefBackend, key: CacheKey) -> bool:
    self.ensure_open()
    return await self.remove_bytes(self.key_string(key))


_bypass_template(UndeclaredRemoveWorks, "remove", _remove_without_capability)


class ForgetsOnClose(RefBackend):
    """Clause 14: declares persistent, but each open starts from an empty store."""

    async def _open(self) -> None:
        await super()._open()
        self.store = Store(self.options.max_size)


class LosesConcurrentWrites(RefBackend):
    """Clause 15: put copies the index, yields, and writes the copy back: concurrent puts
    overwrite each other's keys."""

    async def put_bytes(self, key: str, parts: Sequence[Buffer]) -> None:
        value = b"".join(parts)
        snapshot = await self.on_server("put", lambda store: OrderedDict(store.values))
        await asyncio.sleep(0.001)
        snapshot[key] = value

        def write_back(store: Store) -> None:
            store.values = snapshot
            store.held = sum(len(v) for v in snapshot.values())

        await self.on_server("put", write_back)


# -- issue 15: reporting ---------------------------------------------------------------------


class GetSleeps(RefBackend):
    """Clause 2 (any clause whose test reads): turns the template's deadline off and every get
    waits ten minutes, so only the suite's own per-operation budget stops it."""

    def deadline(self) -> float | None:
        return None

    async def _get(self, key: CacheKey) -> MemoryObj | None:
        await asyncio.sleep(600)
        return await super()._get(key)


class GetBlocksTheLoop(RefBackend):
    """Clause 2 (any clause whose test reads): every get blocks the event loop's thread for ten
    minutes, so no deadline of the loop can stop it."""

    async def _get(self, key: CacheKey) -> MemoryObj | None:
        time.sleep(600)
        return await super()._get(key)


class CloseBlocksForLong(RefBackend):
    """Clause 11: close blocks the event loop's thread for ten minutes (a synchronous join of
    a worker that never ends), far longer than the suite waits."""

    async def _close(self) -> None:
        time.sleep(600)


class NoSmallOptions(RefBackend):
    """A correct store that does not tell the suite how to make it small: the suite finds its
    ``max_size`` option by name."""

    contract_small_options = None


class ArenaOptions(BytesBackendOptions):
    """The reference backend's options with the size limit under a name the suite cannot
    guess."""

    timeout: float = Field(1.0, gt=0, description="deadline of one operation, in seconds")
    arena: int | None = Field(None, description="bytes the store holds; unbounded if unset")
    pin_ttl: float = Field(300.0, gt=0, description="seconds a pin lasts")
    trace_file: str = Field("", description="open() appends its options here as a JSON line")

    @field_validator("arena", mode="before")
    @classmethod
    def _parse_arena(cls, value: object) -> int | None:
        return None if value is None else parse_size(value, what="arena")

    @property
    def max_size(self) -> int | None:
        return self.arena


class SizedByArena(NoSmallOptions):
    """A correct store whose size option the suite cannot find: the capacity and pin-pressure
    tests are not run (unless --kvplug-small-option gives the options)."""

    Options: ClassVar[type[BackendOptions]] = ArenaOptions


class NoPin(RefBackend):
    """A correct store that does not declare pin: clause 8 does not apply to it."""

    capabilities = replace(RefBackend.capabilities, pin=False)


REPORTING: dict[str, type[RefBackend]] = {
    "no-small-options": NoSmallOptions,
    "sized-by-arena": SizedByArena,
    "no-pin": NoPin,
}
"""Scheme -> a correct backend that the suite must report as not run or n/a in some clause."""


# -- issue 15: new checks --------------------------------------------------------------------


class KeepsFirstWrite(RefBackend):
    """Clause 3: a put of a key already stored is ignored (a ``SET NX``), so a hit returns the
    first write instead of the last."""

    async def put_bytes(self, key: str, parts: Sequence[Buffer]) -> None:
        value = b"".join(parts)

        def put_if_new(store: Store) -> None:
            if key not in store.values:
                store.put(key, value)

        await self.on_server("put", put_if_new)

    async def batched_put_bytes(
        self, keys: Sequence[str], values: Sequence[Sequence[Buffer]]
    ) -> None:
        for key, parts in zip(keys, values, strict=True):
            await self.put_bytes(key, parts)


class RemovesInTwoSteps(ReadsItsOwnWay):
    """Clause 15: remove first cuts the value short and deletes it a moment later, and reads
    decode without turning damage into a miss, so a get racing the remove raises."""

    async def decode(self, name: str, data: Buffer | None) -> MemoryObj | None:
        return None if data is None else decode_frame(data, self.allocator)

    async def remove_bytes(self, key: str) -> bool:
        def cut_short(store: Store) -> bool:
            value = store.values.get(key)
            if value is None:
                return False
            store.put(key, value[: len(value) // 2])
            return True

        if not await self.on_server("remove", cut_short):
            return False
        await asyncio.sleep(0.002)
        return await self.on_server("remove", lambda store: store.remove(key))


class FindsThenReads(RefBackend):
    """Clause 15: a read first looks the values up, yields, then takes them, so a remove that
    lands in between makes it raise KeyError (as a file store that opens a path it found a
    moment before raises FileNotFoundError)."""

    async def batched_get_bytes(self, keys: Sequence[str]) -> list[Buffer | None]:
        found = await self.batched_exists_bytes(keys)
        await asyncio.sleep(0)

        def take(store: Store) -> list[Buffer | None]:
            pairs = zip(keys, found, strict=True)
            return [store.values[key] if there else None for key, there in pairs]

        return await self.on_server("get", take)


@functools.cache
def _private_arena() -> FreeListAllocator:
    return FreeListAllocator(64 << 20, pin=False)


class AllocatesElsewhere(ReadsItsOwnWay):
    """Clause 5: get decodes into an arena of its own instead of :attr:`allocator`, so what
    it returns escapes the caller's memory budget (and pinning)."""

    async def decode(self, name: str, data: Buffer | None) -> MemoryObj | None:
        return None if data is None else decode_frame(data, _private_arena())


class BindsTheOpeningLoop(RefBackend):
    """Clause 15: keeps the event loop it was opened on and hands every reply through a future
    of that loop, so from any other loop each operation fails ("attached to a different
    loop")."""

    async def _open(self) -> None:
        await super()._open()
        self.loop = asyncio.get_running_loop()

    async def on_server(self, what: str, operation: Callable[[Store], T]) -> T:
        result = await super().on_server(what, operation)
        reply: asyncio.Future[T] = self.loop.create_future()
        asyncio.get_running_loop().call_soon(reply.set_result, result)
        return await reply


class TruncatesHashTo64Bits(RefBackend):
    """Clause 12: the store key keeps only the low 64 bits of the chunk hash (an int64 column),
    so hashes that differ above bit 63 share one key."""

    def key_string(self, key: CacheKey) -> str:
        chunk = key.chunk_hash
        low = chunk & ((1 << 64) - 1) if isinstance(chunk, int) else chunk[-8:]
        return super().key_string(replace(key, chunk_hash=low))


class ContainsIgnoresKeyPrefix(RefBackend):
    """Clause 12: contains matches the key under any prefix (a ``SCAN *<key>``), so backends
    namespaced by different key_prefix options see each other's keys."""

    async def _contains(self, key: CacheKey) -> bool:
        text = key.to_string()
        return await self.on_server(
            "contains", lambda store: any(name.endswith(text) for name in store.values)
        )


class WritesFilesNamedByTheKey(RefBackend):
    """Clause 12: also writes each value to a file under the URL's path (when it has one),
    named by the store key as it is, so a ``..`` in a model name or tag puts the file outside
    that directory."""

    def file_of(self, name: str) -> Path | None:
        return Path(f"{self.url.path}/{name}") if self.url.path else None

    async def put_bytes(self, key: str, parts: Sequence[Buffer]) -> None:
        await super().put_bytes(key, parts)
        path = self.file_of(key)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"".join(parts))

    def stored_files(self, key: CacheKey) -> list[Path]:
        path = self.file_of(self.key_string(key))
        return [path] if path is not None and path.is_file() else []


# -- issue 34: what a backend leaves running after close ------------------------------------

LEFT_RUNNING: list[Callable[[], object]] = []
"""How to stop what the backends below start and never stop: the self-test's conftest calls
each when its session ends, so that nothing outlives the self-test."""

POLLER_THREAD = "kvplug-selftest-poller"


class LeavesATaskRunning(RefBackend):
    """Clause 11: open starts a heartbeat task on the caller's loop that close never cancels."""

    async def _open(self) -> None:
        await super()._open()
        self.heartbeat = asyncio.ensure_future(self._beat())

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(POLL)


class LeavesAThreadRunning(RefBackend):
    """Clause 11: open starts a poller thread that close never stops (also what a client
    library that keeps a thread by design looks like)."""

    async def _open(self) -> None:
        await super()._open()
        stop = threading.Event()
        thread = threading.Thread(target=stop.wait, name=POLLER_THREAD, daemon=True)
        thread.start()

        def stop_it() -> None:
            stop.set()
            thread.join(5)

        LEFT_RUNNING.append(stop_it)


class LeavesAProcessRunning(RefBackend):
    """Clause 11: open starts a helper process that close never stops."""

    async def _open(self) -> None:
        await super()._open()
        helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])

        def stop_it() -> None:
            helper.kill()
            helper.wait(5)

        LEFT_RUNNING.append(stop_it)


class LeavesAPortListening(RefBackend):
    """Clause 11: open listens on a port (for callbacks from the server) that close never
    closes."""

    async def _open(self) -> None:
        await super()._open()
        listener = socket.create_server(("127.0.0.1", 0))
        LEFT_RUNNING.append(listener.close)


class RefusesAPutThenHangs(RefBackend):
    """Clause 3 (any test that puts from many tasks at once): the third put is refused at once
    and every later one waits for an answer that never comes (no deadline), so a test that
    stops at the first error leaves the waiting tasks behind. Each waiting put writes
    ``waits`` to ``trace_file``, and ``ended`` once it is cancelled."""

    def deadline(self) -> float | None:
        return None

    async def _open(self) -> None:
        await super()._open()
        self.puts = 0
        self.never = asyncio.Event()

    def trace(self, line: str) -> None:
        if self.options.trace_file:
            with Path(self.options.trace_file).open("a") as trace:
                trace.write(line + "\n")

    async def put_bytes(self, key: str, parts: Sequence[Buffer]) -> None:
        self.puts += 1
        if self.puts == 3:
            raise BackendUnavailable(f"put on {self.url}: the server refused this one")
        if self.puts > 3:
            self.trace("waits")
            try:
                await self.never.wait()
            finally:
                self.trace("ended")
        await super().put_bytes(key, parts)


class LetsGoLate(RefBackend):
    """Clause 13 (``releases_on_cancel``, declared): hands the caller's memory to a thread that
    reads it (put) or writes it (get_into) a moment later, whether or not the call was
    cancelled meanwhile, as a file backend whose worker threads outlive a cancellation does."""

    LATE = 0.05

    async def _put(self, key: CacheKey, obj: MemoryObj) -> None:
        obj.retain()
        loop = asyncio.get_running_loop()

        def later() -> None:
            time.sleep(self.LATE)
            try:
                asyncio.run_coroutine_threadsafe(RefBackend._put(self, key, obj), loop).result(5)
            finally:
                obj.release()

        await asyncio.to_thread(later)

    async def _get_into(self, key: CacheKey, dest: MemoryObj) -> bool:
        found = await self._get(key)
        if found is None or found.nbytes != dest.nbytes:
            if found is not None:
                found.release()
            return False
        dest.retain()

        def later() -> None:
            time.sleep(self.LATE)
            try:
                dest.raw.copy_(found.raw)
            finally:
                dest.release()
                found.release()

        await asyncio.to_thread(later)
        return True


LEAVES_RUNNING: dict[str, type[RefBackend]] = {
    "leaves-a-task-running": LeavesATaskRunning,
    "leaves-a-thread-running": LeavesAThreadRunning,
    "leaves-a-process-running": LeavesAProcessRunning,
    "leaves-a-port-listening": LeavesAPortListening,
    "refuses-a-put-then-hangs": RefusesAPutThenHangs,
}
"""Scheme -> a backend that leaves something running, or makes a careless test do so."""


BROKEN: dict[str, tuple[int, type[RefBackend]]] = {
    "get-raises-on-miss": (1, GetRaisesOnMiss),
    "flips-a-bit-on-read": (2, FlipsABitOnRead),
    "stores-bfloat16-as-float16": (2, StoresBfloat16AsFloat16),
    "tears-overwrites": (3, TearsOverwrites),
    "counts-all-present-keys": (4, CountsAllPresentKeys),
    "batched-get-drops-misses": (4, BatchedGetDropsMisses),
    "exists-answers-in-key-order": (4, ExistsAnswersInKeyOrder),
    "leaks-put-reference": (5, LeaksPutReference),
    "put-takes-callers-reference": (5, PutTakesCallersReference),
    "unchecked-reads": (6, UncheckedReads),
    "keeps-damaged-data": (6, KeepsDamagedData),
    "remove-always-true": (7, RemoveAlwaysTrue),
    "contains-remembers-removed": (7, ContainsRemembersRemoved),
    "evicts-pinned-keys": (8, EvictsPinnedKeys),
    "unpin-raises-when-not-pinned": (8, UnpinRaisesWhenNotPinned),
    "pins-never-expire": (8, PinsNeverExpire),
    "full-store-raises-runtime-error": (9, FullStoreRaisesRuntimeError),
    "full-store-stops-reads": (9, FullStoreStopsReads),
    "no-deadline": (10, NoDeadline),
    "no-recovery-after-restart": (10, NoRecoveryAfterRestart),
    "close-blocks-the-loop": (11, CloseBlocksTheLoop),
    "works-after-close": (11, WorksAfterClose),
    "second-close-raises": (11, SecondCloseRaises),
    "ignores-model-name": (12, IgnoresModelName),
    "ignores-worker-id": (12, IgnoresWorkerId),
    "drops-the-tenant": (16, DropsTheTenant),
    "declares-pin-but-cannot": (13, DeclaresPinButCannot),
    "lets-go-late": (13, LetsGoLate),
    "undeclared-remove-works": (13, UndeclaredRemoveWorks),
    "forgets-on-close": (14, ForgetsOnClose),
    "loses-concurrent-writes": (15, LosesConcurrentWrites),
    "get-sleeps": (2, GetSleeps),
    "get-blocks-the-loop": (2, GetBlocksTheLoop),
    "close-blocks-for-long": (11, CloseBlocksForLong),
    "keeps-first-write": (3, KeepsFirstWrite),
    "removes-in-two-steps": (15, RemovesInTwoSteps),
    "finds-then-reads": (15, FindsThenReads),
    "allocates-elsewhere": (5, AllocatesElsewhere),
    "binds-the-opening-loop": (15, BindsTheOpeningLoop),
    "truncates-hash-to-64-bits": (12, TruncatesHashTo64Bits),
    "contains-ignores-key-prefix": (12, ContainsIgnoresKeyPrefix),
    "writes-files-named-by-the-key": (12, WritesFilesNamedByTheKey),
}
"""Scheme -> (the clause it violates, the class)."""

BACKENDS: dict[str, type[RefBackend]] = {
    "ref": RefBackend,
    **{scheme: cls for scheme, (_, cls) in BROKEN.items()},
    **REPORTING,
    **LEAVES_RUNNING,
}


def register_all(module: str) -> None:
    """Serve every backend of :data:`BACKENDS` from ``module`` (this file's import name)."""
    for scheme, cls in BACKENDS.items():
        register_backend(BackendSpec(scheme, (scheme,), f"{module}:{cls.__name__}"), replace=True)
