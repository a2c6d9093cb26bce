"""Backends for the contract suite's self-test (``tests/test_contract_suite.py``).

:class:`RefBackend` is a correct in-memory store that declares every capability it honours, so
that every clause of DESIGN.md §4 applies to it. Each other class is a small subclass that
breaks exactly one clause, the way real backends break it. The self-test writes this file into
pytester's run directory, where a conftest registers every class under its :data:`BACKENDS`
scheme and lets the suite pause and stop the simulated server through :data:`SERVER`.

Every backend opened on one URL path (and ``max_size``) talks to one simulated :class:`Store`
kept at class level, so data survives ``close`` and a reopen (``persistent``) and every backend
opened on the URL sees it (``shared_across_processes``, simulated within one process).
"""

from __future__ import annotations

import asyncio
import json
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
    BackendSpec,
    BackendUnavailable,
    BytesBackend,
    CacheKey,
    Capabilities,
    CapacityExceeded,
    MemoryObj,
    NotSupported,
    register_backend,
)
from kvplug.backend import BackendOptions, Buffer, BytesBackendOptions
from kvplug.errors import BackendClosed, CorruptObject
from kvplug.frame import decode_frame, decode_header, encode_frame, encode_header
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
    """A correct store: deadlines, recovery, pins with expiry, LRU eviction, framed values."""

    capabilities: ClassVar[Capabilities] = Capabilities(
        pin=True,
        persistent=True,
        shared_across_processes=True,
        native_batching=True,
        delete=True,
        list=True,
    )
    Options: ClassVar[type[BackendOptions]] = RefOptions
    options: RefOptions
    stores: ClassVar[dict[tuple[str, str, int | None], Store]] = {}
    stores_lock: ClassVar[threading.Lock] = threading.Lock()

    async def open(self) -> None:
        key = (type(self).__name__, self.url.path, self.options.max_size)
        with self.stores_lock:
            self.store = self.stores.setdefault(key, Store(self.options.max_size))
        if self.options.trace_file:
            with Path(self.options.trace_file).open("a") as trace:
                trace.write(json.dumps(self.options.model_dump()) + "\n")

    async def on_server(self, what: str, operation: Callable[[Store], T]) -> T:
        """Run ``operation`` on the server within the deadline (clause 10)."""
        self.ensure_open()
        return await self.with_deadline(self.reach(what, operation), what)

    async def reach(self, what: str, operation: Callable[[Store], T]) -> T:
        while True:
            self.ensure_open()  # an operation in flight ends when the backend closes
            if SERVER.stopped:
                raise BackendUnavailable(f"{what} on {self.url}: the server refused the connection")
            if not SERVER.paused:
                with self.store.lock:
                    return operation(self.store)
            await asyncio.sleep(POLL)

    async def get(self, key: CacheKey) -> MemoryObj | None:
        self.ensure_open()
        name = self.key_string(key)
        return await self.decode(name, await self.get_bytes(name))

    async def decode(self, name: str, data: Buffer | None) -> MemoryObj | None:
        """The object in a stored frame; a damaged frame is a counted miss and is removed."""
        if data is None:
            return None
        try:
            return decode_frame(data, self.allocator)
        except CorruptObject:
            self.corrupt_objects += 1
            await self.remove_bytes(name)
            return None

    async def batched_get(self, keys: Sequence[CacheKey]) -> list[MemoryObj | None]:
        self.ensure_open()
        names = [self.key_string(key) for key in keys]
        values = await self.on_server("batched_get", lambda store: [store.get(n) for n in names])
        results: list[MemoryObj | None] = []
        try:
            for name, value in zip(names, values, strict=True):
                results.append(await self.decode(name, value))
        except BaseException:
            for obj in results:
                if obj is not None:
                    obj.release()
            raise
        return results

    async def batched_put(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]) -> None:
        self.ensure_open()
        if len(keys) != len(objs):
            raise ValueError(f"batched_put got {len(keys)} keys but {len(objs)} objects.")
        for obj in objs:
            obj.retain()
        try:
            frames = [
                (self.key_string(key), b"".join(encode_frame(obj, self.serde)))
                for key, obj in zip(keys, objs, strict=True)
            ]
        finally:
            for obj in objs:
                obj.release()

        def put_all(store: Store) -> None:
            for name, value in frames:
                store.put(name, value)

        await self.on_server("batched_put", put_all)

    async def batched_contains(self, keys: Sequence[CacheKey]) -> int:
        self.ensure_open()
        names = [self.key_string(key) for key in keys]

        def leading(store: Store) -> int:
            return next((n for n, name in enumerate(names) if name not in store.values), len(names))

        return await self.on_server("batched_contains", leading)

    async def get_bytes(self, key: str) -> Buffer | None:
        return await self.on_server("get", lambda store: store.get(key))

    async def put_bytes(self, key: str, parts: Sequence[Buffer]) -> None:
        value = b"".join(parts)
        await self.on_server("put", lambda store: store.put(key, value))

    async def contains_bytes(self, key: str) -> bool:
        return await self.on_server("contains", lambda store: key in store.values)

    async def remove_bytes(self, key: str) -> bool:
        return await self.on_server("remove", lambda store: store.remove(key))

    async def pin(self, key: CacheKey) -> bool:
        ttl = self.options.pin_ttl
        return await self.on_server("pin", lambda store: store.pin(self.key_string(key), ttl))

    async def unpin(self, key: CacheKey) -> bool:
        return await self.on_server("unpin", lambda store: store.unpin(self.key_string(key)))

    def list_keys(self) -> AsyncIterator[CacheKey]:
        self.ensure_open()
        return self._list()

    async def _list(self) -> AsyncIterator[CacheKey]:
        prefix = self.options.key_prefix
        names = await self.on_server("list", lambda store: list(store.values))
        for name in names:
            if name.startswith(prefix):
                yield CacheKey.parse(name[len(prefix) :])

    async def close(self) -> None:
        self.mark_closed()


# -- broken backends, one clause each ------------------------------------------------------------


class GetRaisesOnMiss(RefBackend):
    """Clause 1: a miss raises instead of returning None."""

    async def get_bytes(self, key: str) -> Buffer | None:
        value = await super().get_bytes(key)
        if value is None:
            raise KeyError(key)
        return value


class FlipsABitOnRead(RefBackend):
    """Clause 2: every read returns the object with one bit flipped."""

    async def get(self, key: CacheKey) -> MemoryObj | None:
        obj = await super().get(key)
        if obj is not None:
            obj.raw[obj.nbytes // 3] ^= 0x04
        return obj


class StoresBfloat16AsFloat16(RefBackend):
    """Clause 2: the stored header records bfloat16 objects as float16."""

    async def put(self, key: CacheKey, obj: MemoryObj) -> None:
        self.ensure_open()
        obj.retain()
        try:
            payload = self.serde.encode(obj)
            dtype = torch.float16 if obj.dtype == torch.bfloat16 else obj.dtype
            header = encode_header(obj.shape, dtype, obj.fmt, self.serde.name, payload)
            await self.put_bytes(self.key_string(key), (header, payload))
        finally:
            obj.release()


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


class UncheckedReads(RefBackend):
    """Clause 6: reads skip the payload checksum, so damaged payloads are served as data."""

    async def decode(self, name: str, data: Buffer | None) -> MemoryObj | None:
        if data is None:
            return None
        try:
            return _decode_unchecked(data, self)
        except CorruptObject:
            self.corrupt_objects += 1
            await self.remove_bytes(name)
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


class KeepsDamagedData(RefBackend):
    """Clause 6: damaged data reads as a miss but stays stored and is not counted."""

    async def decode(self, name: str, data: Buffer | None) -> MemoryObj | None:
        try:
            return None if data is None else decode_frame(data, self.allocator)
        except CorruptObject:
            return None


class CountsAllPresentKeys(RefBackend):
    """Clause 4: batched_contains counts every present key, not the leading run."""

    async def batched_contains(self, keys: Sequence[CacheKey]) -> int:
        return sum([await self.contains(key) for key in keys])


class BatchedGetDropsMisses(RefBackend):
    """Clause 4: batched_get returns the hits only, so results shift against the keys."""

    async def batched_get(self, keys: Sequence[CacheKey]) -> list[MemoryObj | None]:
        found = await super().batched_get(keys)
        hits: list[MemoryObj | None] = [obj for obj in found if obj is not None]
        return hits + [None] * (len(keys) - len(hits))


class LeaksPutReference(RefBackend):
    """Clause 5: put retains the object and never releases it."""

    async def put(self, key: CacheKey, obj: MemoryObj) -> None:
        obj.retain()
        await super().put(key, obj)


class PutTakesCallersReference(RefBackend):
    """Clause 5: put releases the caller's reference as if it owned it."""

    async def put(self, key: CacheKey, obj: MemoryObj) -> None:
        await super().put(key, obj)
        obj.release()


class RemoveAlwaysTrue(RefBackend):
    """Clause 7: remove reports True even for a key that was never stored."""

    async def remove(self, key: CacheKey) -> bool:
        await super().remove(key)
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

    async def open(self) -> None:
        await super().open()
        store = self.store

        def least_recently_used(exclude: str) -> str | None:
            return next((key for key in store.values if key != exclude), None)

        store.evictable = least_recently_used  # type: ignore[method-assign]


class UnpinRaisesWhenNotPinned(RefBackend):
    """Clause 8: unpin of a key holding no pin raises."""

    async def unpin(self, key: CacheKey) -> bool:
        if not await super().unpin(key):
            raise KeyError(f"{key} is not pinned")
        return True


class PinsNeverExpire(RefBackend):
    """Clause 8: pin_ttl is accepted but ignored."""

    async def pin(self, key: CacheKey) -> bool:
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


class FullStoreStopsReads(RefBackend):
    """Clause 9: once the store is nearly full, reads fail as if they needed room."""

    async def get_bytes(self, key: str) -> Buffer | None:
        def get(store: Store) -> bytes | None:
            if store.max_size is not None and store.held > store.max_size * 3 // 4:
                raise CapacityExceeded("no room left to read into")
            return store.get(key)

        return await self.on_server("get", get)


class NoDeadline(RefBackend):
    """Clause 10: while the server is paused, operations wait for it forever."""

    async def on_server(self, what: str, operation: Callable[[Store], T]) -> T:
        self.ensure_open()
        return await self.reach(what, operation)


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


class CloseWaitsForever(RefBackend):
    """Clause 11: close waits for the operations in flight to drain, but they never wake it."""

    in_flight = 0

    async def open(self) -> None:
        await super().open()
        self.drained = asyncio.Event()

    async def on_server(self, what: str, operation: Callable[[Store], T]) -> T:
        self.in_flight += 1
        try:
            return await super().on_server(what, operation)
        finally:
            self.in_flight -= 1  # and forgets self.drained.set() when it reaches 0

    async def close(self) -> None:
        if self.mark_closed() and self.in_flight:
            await self.drained.wait()


class WorksAfterClose(RefBackend):
    """Clause 11: close does nothing; the backend keeps working."""

    def ensure_open(self) -> None:
        pass


class SecondCloseRaises(RefBackend):
    """Clause 11: close is not idempotent."""

    async def close(self) -> None:
        if not self.mark_closed():
            raise BackendClosed(f"{self.url} is already closed")


class IgnoresModelName(RefBackend):
    """Clause 12: the store key leaves out the model name, so models share keys."""

    def key_string(self, key: CacheKey) -> str:
        return super().key_string(replace(key, model_name="model"))


class IgnoresWorkerId(RefBackend):
    """Clause 12: the store key leaves out the worker, so tensor-parallel ranks share keys."""

    def key_string(self, key: CacheKey) -> str:
        return super().key_string(replace(key, world_size=1, worker_id=0))


class DeclaresPinButCannot(RefBackend):
    """Clause 13: declares pin, but pin and unpin raise NotSupported."""

    async def pin(self, key: CacheKey) -> bool:
        self.ensure_open()
        raise NotSupported("pinning is not implemented yet")

    async def unpin(self, key: CacheKey) -> bool:
        self.ensure_open()
        raise NotSupported("pinning is not implemented yet")


class UndeclaredDeleteWorks(RefBackend):
    """Clause 13: does not declare delete, yet remove silently deletes."""

    capabilities: ClassVar[Capabilities] = replace(RefBackend.capabilities, delete=False)

    async def remove(self, key: CacheKey) -> bool:
        self.ensure_open()
        return await self.remove_bytes(self.key_string(key))


class ForgetsOnClose(RefBackend):
    """Clause 14: declares persistent, but each open starts from an empty store."""

    async def open(self) -> None:
        await super().open()
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


BROKEN: dict[str, tuple[int, type[RefBackend]]] = {
    "get-raises-on-miss": (1, GetRaisesOnMiss),
    "flips-a-bit-on-read": (2, FlipsABitOnRead),
    "stores-bfloat16-as-float16": (2, StoresBfloat16AsFloat16),
    "tears-overwrites": (3, TearsOverwrites),
    "counts-all-present-keys": (4, CountsAllPresentKeys),
    "batched-get-drops-misses": (4, BatchedGetDropsMisses),
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
    "close-waits-forever": (11, CloseWaitsForever),
    "works-after-close": (11, WorksAfterClose),
    "second-close-raises": (11, SecondCloseRaises),
    "ignores-model-name": (12, IgnoresModelName),
    "ignores-worker-id": (12, IgnoresWorkerId),
    "declares-pin-but-cannot": (13, DeclaresPinButCannot),
    "undeclared-delete-works": (13, UndeclaredDeleteWorks),
    "forgets-on-close": (14, ForgetsOnClose),
    "loses-concurrent-writes": (15, LosesConcurrentWrites),
}
"""Scheme -> (the clause it violates, the class)."""

BACKENDS: dict[str, type[RefBackend]] = {
    "ref": RefBackend,
    **{scheme: cls for scheme, (_, cls) in BROKEN.items()},
}


def register_all(module: str) -> None:
    """Serve every backend of :data:`BACKENDS` from ``module`` (this file's import name)."""
    for scheme, cls in BACKENDS.items():
        register_backend(BackendSpec(scheme, (scheme,), f"{module}:{cls.__name__}"), replace=True)
