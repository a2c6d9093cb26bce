"""Any kvplug backend as an L2 adapter of LMCache's multi-process (MP) server.

LMCache loads it through its ``plugin`` L2 adapter type::

    lmcache server --l1-size-gb 20 --eviction-policy LRU --l2-adapter '{
        "type": "plugin",
        "module_path": "kvplug_lmcache.l2_adapter",
        "class_name": "KvplugL2Adapter",
        "adapter_params": {"url": "redis://cache-1:6379", "options": {"timeout": 5}}
    }'

``adapter_params`` (see :class:`KvplugL2AdapterConfig`): exactly one of ``url`` (any kvplug
URL: ``cpu://?max_size=8GiB``, ``file:///var/cache/kv``, ``redis://host:6379``,
``store:///etc/kvplug.yaml``, ...) or ``config`` (the path of a kvplug tiers YAML), and
optionally ``options`` (kvplug backend or Store options), ``capacity``, ``task_timeout``,
``lock_ttl``, ``check_on_start`` and ``pin_locked``.

How LMCache's calls map onto kvplug (one batched kvplug call per task, on the
:class:`~kvplug.runtime.sync.SyncClient`'s IO thread, which is the adapter's own IO thread), through
:class:`kvplug.runtime.engine.EngineIO`:

* **store**: one ``batched_put`` of LMCache's L1 buffers (wrapped with
  :meth:`kvplug.MemoryObj.from_tensor`, no copy). A backend that lets go of a buffer at once
  when a put is cancelled and keeps no reference after it (``releases_on_cancel``, not a
  ``cpu://`` tier, not a Store of several tiers, seen through wrappers such as ``audit::``) is
  lent the buffer itself; every other backend gets a copy taken when the task starts, so what
  is stored is what LMCache handed over, whatever LMCache writes into its buffer later.
* **lookup and lock**: per-key presence, gathered concurrently in one coroutine; each lookup
  that finds a key takes one lock on it (two lookups, two locks).
* **load**: one ``batched_get_into``, straight into LMCache's buffers on a backend that stops
  writing there at once when a read is cancelled (``releases_on_cancel``); every other backend
  reads into kvplug's own memory (outside any store's budget, so a full budget is never a
  miss), copied into LMCache's buffers only while the task is live. A stored object whose
  size differs from the buffer is a failed load for that key; nothing is written.
* **unlock**: gives back exactly the locks taken; a key never locked is ignored; never raises.
  A lock also ends by itself after ``lock_ttl`` seconds (300 by default), so a lookup whose
  result LMCache never collected (a request aborted meanwhile) does not hold its keys forever.

**The engine boundary.** LMCache's MP L1 frees a buffer as soon as the store or load task
that used it is reported done, successful or not, and hands it to other data. So a task is
reported only once no part of kvplug can read or write LMCache's buffers any more, and within
``task_timeout``: a task past it is reported failed, and nothing kvplug still does afterwards
(a late disk write or read, a write-behind to a lower tier, a late network reply) touches
those buffers. A store reported failed may still land later, but only ever with the bytes
LMCache handed over; a load reported failed leaves nothing in LMCache's buffers that LMCache
may use.

Locked keys stay readable: on a backend that can pin (the ``cpu://`` tier) a locked key is
pinned, so the backend does not evict it, until its last lock goes (or the backend's
``pin_ttl`` passes, 300 s by default). On every backend, :meth:`KvplugL2Adapter.delete` (LMCache's
L2 eviction) skips locked keys. A backend that cannot pin may still drop a locked key by its
own means (its size cap, Redis ``maxmemory``, another process); the load then reports that key
as failed, which LMCache handles as a miss.

A backend that is down makes lookups and loads miss and stores fail (LMCache keeps the data
in L1 and logs the failure); every task ends within ``task_timeout`` seconds, and the adapter
works again as soon as kvplug's backend does (kvplug backends recover without a reopen).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import threading
from collections.abc import Awaitable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.api import KeyEntry, KeyListPage, ObjectKey
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
from lmcache.v1.platform import create_event_notifier

from kvplug.backend import Backend
from kvplug.errors import (
    BackendClosed,
    BackendUnavailable,
    KvplugError,
    LayoutMismatch,
)
from kvplug.eviction import PinTable
from kvplug.keys import CacheKey
from kvplug.memory import MemoryFormat, MemoryObj
from kvplug.runtime.engine import (
    CallHealth,
    EngineIO,
    open_client,
    probe,
    within_deadline,
)
from kvplug.runtime.store import store_of, stored_keys
from kvplug.runtime.sync import SyncClient
from kvplug.secrets import mask_data, mask_text
from kvplug.stats import summarize
from kvplug_lmcache.adapter_config import (
    DEFAULT_LOCK_TTL,
    DEFAULT_TASK_TIMEOUT,
    KvplugL2AdapterConfig,
    backend_url_and_options,
)
from kvplug_lmcache.key_listing import check_page_request, mp_keys, page_after
from kvplug_lmcache.keys import object_key_to_cache_key
from kvplug_lmcache.lmcache_memory import MemoryTags, byte_view, memory_tags
from kvplug_lmcache.usage import default_capacity, held_by_backend

logger = logging.getLogger("kvplug.lmcache")
T = TypeVar("T")
Outcome = tuple[Any, BaseException | None]
"""What a task coroutine returns: its result for LMCache, and why it failed (None: it did
not)."""

MAX_UNCLAIMED = 100_000
"""Results of tasks LMCache never asked for kept at most (the oldest go first)."""

_KINDS = ("stores", "lookups", "loads")
"""The kinds of task LMCache submits; each has a ``failed_<kind>`` counter."""
_FAILURES = (*(f"failed_{kind}" for kind in _KINDS), "failed_deletes")


class KvplugL2Adapter(L2AdapterInterface):  # type: ignore[misc]  # lmcache is untyped
    """LMCache's MP L2 adapter interface over any kvplug backend or tiered Store.

    LMCache builds it from the ``plugin`` adapter JSON (see the module documentation); the
    config may also be a plain ``adapter_params`` dict. Construction opens the backend on a
    private IO thread and fails with kvplug's own error when the URL, the options or the
    scheme are wrong, or (with ``check_on_start``) when the backend does not answer.

    Thread-safe: LMCache's store and prefetch controller threads call it at once; every
    task runs on the IO thread and signals its own event fd when done.

    Example (what LMCache's controllers do, by hand)::

        >>> import select
        >>> import torch
        >>> from lmcache.v1.distributed.api import ObjectKey
        >>> from lmcache.v1.memory_management import (
        ...     MemoryFormat, MemoryObjMetadata, TensorMemoryObj)
        >>> def l1_object(data):
        ...     meta = MemoryObjMetadata(
        ...         shape=data.shape, dtype=data.dtype, address=data.data_ptr(),
        ...         phy_size=data.numel() * data.element_size(), ref_count=1,
        ...         fmt=MemoryFormat.KV_2LTD)
        ...     return TensorMemoryObj(data, meta, parent_allocator=None)
        >>> def wait(fd):
        ...     poller = select.poll()
        ...     poller.register(fd, select.POLLIN)
        ...     return bool(poller.poll(60_000))
        >>> adapter = KvplugL2Adapter({"url": "cpu://?max_size=64MiB"})
        >>> key = ObjectKey(chunk_hash=b"\\x01\\x02", model_name="llama", kv_rank=0)
        >>> stored = l1_object(torch.arange(64, dtype=torch.float16))
        >>> task = adapter.submit_store_task([key], [stored])
        >>> wait(adapter.get_store_event_fd())
        True
        >>> adapter.pop_completed_store_tasks()[task].is_successful()
        True
        >>> task = adapter.submit_lookup_and_lock_task([key], {})
        >>> wait(adapter.get_lookup_and_lock_event_fd())
        True
        >>> adapter.query_lookup_and_lock_result(task).test(0)
        True
        >>> loaded = l1_object(torch.zeros(64, dtype=torch.float16))
        >>> task = adapter.submit_load_task([key], [loaded])
        >>> wait(adapter.get_load_event_fd())
        True
        >>> adapter.query_load_result(task).test(0), torch.equal(loaded.tensor, stored.tensor)
        (True, True)
        >>> adapter.submit_unlock([key])
        >>> adapter.close()
    """

    config_class_name = "KvplugL2AdapterConfig"

    def __init__(
        self,
        config: KvplugL2AdapterConfig | Mapping[str, Any],
        l1_memory_desc: Any = None,
    ) -> None:
        if not isinstance(config, KvplugL2AdapterConfig):
            config = KvplugL2AdapterConfig.from_dict(dict(config))
        self._config = config
        self._timeout = config.task_timeout
        client = open_client(
            url=config.url,
            config=config.config,
            options=config.options,
            what="KvplugL2Adapter adapter_params",
        )
        try:
            backend = client.backend
            capacity = config.capacity
            if capacity is None:
                capacity = default_capacity(backend)
            super().__init__(max_capacity_bytes=capacity)
            if config.check_on_start:
                self._check_reachable(client)
        except BaseException:
            client.close()
            raise
        self._client = client
        self._backend: Backend = backend
        what = f"KvplugL2Adapter on {config.target()}"
        self._io = EngineIO(backend, timeout=config.task_timeout, what=what)
        self._pins = config.pin_locked and backend.capabilities.pin
        # Reading a host-memory tier costs nothing, so a touch reads (its LRU sees the use).
        self._touches = backend.capabilities.zero_copy and store_of(backend) is None
        self._tags = memory_tags(backend, shared=False) if MemoryTags is not None else None

        self._state = threading.Lock()
        """Guards everything report_status shows, so that one snapshot is consistent: task
        outcomes (result filed, counted, health) land together, under it."""
        self._closed = False
        self._task_ids = itertools.count()
        self._done: dict[str, dict[int, Any]] = {kind: {} for kind in _KINDS}
        """Results of finished tasks LMCache has not collected yet, by kind."""
        self._finished = dict.fromkeys(_KINDS, 0)
        self._submitted = 0
        self._in_flight = 0
        self._health = CallHealth(what, _FAILURES, logger)
        """Updated only under :attr:`_state`."""
        self._size_mismatches = 0
        self._sizes: dict[ObjectKey, int] = {}
        """Bytes of each key this adapter stored (LMCache's usage accounting)."""
        self._bytes = 0
        """The sum of :attr:`_sizes`."""
        self._stamps: dict[ObjectKey, int] = {}
        """The :attr:`_stores_done` count when each key of :attr:`_sizes` was stored."""
        self._stores_done = 0
        self._locks: PinTable[ObjectKey] = PinTable()
        """The locks of each key, each ending at unlock or after lock_ttl; IO thread only."""
        self._pinned: set[ObjectKey] = set()
        """Keys this adapter holds one backend pin on; IO thread only."""
        self._lock_guard = asyncio.Lock()
        self._store_fd = create_event_notifier()
        self._lookup_fd = create_event_notifier()
        self._load_fd = create_event_notifier()
        logger.info(
            "KvplugL2Adapter on %s (%s): %s, capacity %d bytes",
            config.target(),
            type(backend).__name__,
            "puts lend LMCache's buffers" if self._io.lends_stores else "puts copy at submit",
            capacity,
        )

    # -- start-up -----------------------------------------------------------------------------

    def _check_reachable(self, client: SyncClient) -> None:
        try:
            probe(client, self._timeout)
        except (BackendUnavailable, TimeoutError) as error:
            detail = str(error) or f"no answer within task_timeout={self._timeout} s"
            raise BackendUnavailable(
                f"KvplugL2Adapter cannot reach {self._config.target()}: {detail} Start the store "
                "(or fix the URL), or set adapter_params.check_on_start to false to start LMCache "
                "anyway (loads then miss and stores fail until the store answers)."
            ) from None

    # -- event fds ----------------------------------------------------------------------------

    def get_store_event_fd(self) -> int:
        return int(self._store_fd.fileno())

    def get_lookup_and_lock_event_fd(self) -> int:
        return int(self._lookup_fd.fileno())

    def get_load_event_fd(self) -> int:
        return int(self._load_fd.fileno())

    # -- task plumbing ------------------------------------------------------------------------

    def _submit(
        self, work: Coroutine[Any, Any, Outcome], kind: str, notifier: Any, failed: Any
    ) -> int:
        """Run ``work`` on the IO thread. When it ends, its result (``failed`` if it raised)
        is filed under a new task id for LMCache to collect, and the task is counted with its
        error, if any, all in one step under :attr:`_state`; then ``notifier`` is signalled."""
        with self._state:
            if self._closed:
                work.close()
                raise BackendClosed("this KvplugL2Adapter is closed; LMCache must not use it.")
            task_id = next(self._task_ids)
            self._submitted += 1
            self._in_flight += 1

        def finish(future: concurrent.futures.Future[Outcome]) -> None:
            error: BaseException | None
            try:
                result, error = future.result()
            except BaseException as bug:  # a bug or a cancelled loop: never leave it pending
                logger.error("KvplugL2Adapter task %d ended with %r", task_id, bug)
                result, error = failed, bug
            with self._state:
                self._in_flight -= 1
                self._finished[kind] += 1
                if error is None:
                    self._health.succeeded()
                else:
                    self._health.failed(f"failed_{kind}", error)
                results = self._done[kind]
                results[task_id] = result
                if len(results) > MAX_UNCLAIMED:  # tasks of requests LMCache gave up on
                    del results[next(iter(results))]
                closed = self._closed
            if not closed:
                with contextlib.suppress(OSError, ValueError):
                    notifier.notify()

        try:
            future = self._client.run(work)
        except BaseException:
            with self._state:
                self._submitted -= 1
                self._in_flight -= 1
            raise
        future.add_done_callback(finish)
        return task_id

    def _collect(self, kind: str, task_id: int) -> Any:
        with self._state:
            return self._done[kind].pop(task_id, None)

    def _failed(self, counter: str, error: BaseException) -> None:
        """Count a failure outside a task (a delete)."""
        with self._state:
            self._health.failed(counter, error)

    async def _within_deadline(self, work: Awaitable[T], what: str) -> T:
        return await within_deadline(work, self._timeout, f"{what} on {self._config.target()}")

    def _forget(self, keys: Sequence[ObjectKey], seen_at: int | None = None) -> None:
        """Keys this adapter stored that the backend no longer has (its own eviction, a
        delete). With ``seen_at`` (a :attr:`_stores_done` count taken before the backend was
        asked), keys stored again since then are kept."""
        with self._state:
            gone = [
                (key, self._sizes.pop(key))
                for key in keys
                if key in self._sizes and (seen_at is None or self._stamps[key] <= seen_at)
            ]
            for key, size in gone:
                del self._stamps[key]
                self._bytes -= size
        if gone:
            self._notify_keys_deleted([k for k, _ in gone], [size for _, size in gone])

    # -- store --------------------------------------------------------------------------------

    def submit_store_task(self, keys: list[ObjectKey], objects: list[Any]) -> int:
        return self._submit(
            self._store(list(keys), list(objects)),
            "stores",
            self._store_fd,
            L2StoreResult(False, 0),
        )

    def pop_completed_store_tasks(self) -> dict[int, Any]:
        with self._state:
            done, self._done["stores"] = self._done["stores"], {}
        return done

    async def _store(self, keys: list[ObjectKey], objects: list[Any]) -> Outcome:
        if len(keys) != len(objects):
            error = KvplugError(f"a store task got {len(keys)} keys but {len(objects)} objects")
            return L2StoreResult(False, 0), error
        if not keys:
            return L2StoreResult(True, 0), None
        sizes: list[int] = []
        try:
            cache_keys = [object_key_to_cache_key(key) for key in keys]
            sources = [
                MemoryObj.from_tensor(byte_view(obj), MemoryFormat.BINARY_BUFFER) for obj in objects
            ]
            sizes = [source.nbytes for source in sources]
            await self._io.store(cache_keys, sources)
        except Exception as error:
            # A Store that refused some keys says which it did store: LMCache's usage and
            # eviction know those (LMCache keeps the whole task's keys in L1 meanwhile).
            stored = stored_keys(error, len(keys)) if sizes else None
            if stored is not None and any(stored):
                kept = [i for i, ok in enumerate(stored) if ok]
                self._account_stored([keys[i] for i in kept], [sizes[i] for i in kept])
            return L2StoreResult(False, 0), error
        self._account_stored(keys, sizes)
        return L2StoreResult(True, sum(sizes)), None

    def _account_stored(self, keys: list[ObjectKey], sizes: list[int]) -> None:
        new: dict[ObjectKey, int] = {}
        replaced: dict[ObjectKey, int] = {}
        same: list[ObjectKey] = []
        with self._state:
            self._stores_done += 1
            for key, size in zip(keys, sizes, strict=True):
                self._stamps[key] = self._stores_done
                old = self._sizes.get(key)
                if old is None:
                    new[key] = size
                elif old != size:
                    replaced[key] = old
                    new[key] = size
                else:
                    same.append(key)
                self._sizes[key] = size
                self._bytes += size - (old or 0)
        if replaced:
            self._notify_keys_deleted(list(replaced), list(replaced.values()))
        if new:
            self._notify_keys_stored(list(new), list(new.values()))
        if same:
            self._notify_keys_accessed(same)

    # -- lookup and lock ----------------------------------------------------------------------

    def submit_lookup_and_lock_task(
        self, keys: list[ObjectKey], group_layout_descs: dict[int, Any]
    ) -> int:
        return self._submit(
            self._lookup_and_lock(list(keys)), "lookups", self._lookup_fd, Bitmap(len(keys))
        )

    def query_lookup_and_lock_result(self, task_id: int) -> Any:
        return self._collect("lookups", task_id)

    async def _lookup_and_lock(self, keys: list[ObjectKey]) -> Outcome:
        found = Bitmap(len(keys))
        seen_at = self._stores_done
        try:
            cache_keys = [object_key_to_cache_key(key) for key in keys]
            present = await self._within_deadline(
                self._backend.batched_exists(cache_keys), "a lookup"
            )
        except Exception as error:
            return found, error
        failure: Exception | None = None
        async with self._lock_guard:
            for index, (key, cache_key, here) in enumerate(
                zip(keys, cache_keys, present, strict=True)
            ):
                if not here:
                    continue
                try:
                    if await self._lock(key, cache_key):
                        found.set(index)
                except Exception as error:
                    failure = failure or error
        if failure is None:
            self._forget(
                [key for key, here in zip(keys, present, strict=True) if not here], seen_at
            )
        return found, failure

    async def _lock(self, key: ObjectKey, cache_key: CacheKey) -> bool:
        """Take one lock on ``key``; the first lock pins it where the backend can pin.
        False when the key went away before it could be pinned; raises when the pin
        failed."""
        if self._pins and not self._locks.is_pinned(key):
            if key in self._pinned:  # its locks expired: renew the pin
                await self._unpin(key)
            if not await self._within_deadline(self._backend.pin(cache_key), "a pin"):
                return False
            self._pinned.add(key)
        self._locks.pin(key, self._config.lock_ttl)
        return True

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        keys = list(keys)
        with contextlib.suppress(KvplugError, RuntimeError):  # closed: nothing is locked
            self._client.run(self._unlock(keys))

    async def _unlock(self, keys: list[ObjectKey]) -> None:
        async with self._lock_guard:
            for key in keys:
                if not self._locks.unpin(key):
                    continue  # never locked, or its lock expired
                if key in self._pinned and not self._locks.is_pinned(key):
                    await self._unpin(key)

    async def _unpin(self, key: ObjectKey) -> None:
        self._pinned.discard(key)
        try:
            await self._within_deadline(self._backend.unpin(object_key_to_cache_key(key)), "unpin")
        except Exception as error:  # the pin still expires after the backend's pin_ttl
            logger.warning(
                "KvplugL2Adapter: unpinning %s failed (%s); the pin expires by itself.",
                key,
                mask_text(str(error)),
            )

    # -- load ---------------------------------------------------------------------------------

    def submit_load_task(self, keys: list[ObjectKey], objects: list[Any]) -> int:
        return self._submit(
            self._load(list(keys), list(objects)), "loads", self._load_fd, Bitmap(len(keys))
        )

    def query_load_result(self, task_id: int) -> Any:
        return self._collect("loads", task_id)

    async def _load(self, keys: list[ObjectKey], objects: list[Any]) -> Outcome:
        loaded = Bitmap(len(keys))
        if len(keys) != len(objects):
            return loaded, KvplugError(
                f"a load task got {len(keys)} keys but {len(objects)} buffers"
            )
        seen_at = self._stores_done
        try:
            cache_keys = [object_key_to_cache_key(key) for key in keys]
            dests = [
                MemoryObj.from_tensor(byte_view(buffer), MemoryFormat.BINARY_BUFFER)
                for buffer in objects
            ]
            try:
                found: list[bool | None] = list(await self._io.load(cache_keys, dests))
            except LayoutMismatch:
                found = await self._load_each(keys, cache_keys, dests)
        except Exception as error:
            return loaded, error
        hits: list[ObjectKey] = []
        missing: list[ObjectKey] = []
        for index, (key, hit) in enumerate(zip(keys, found, strict=True)):
            if hit:
                loaded.set(index)
                hits.append(key)
            elif hit is not None:
                missing.append(key)
        self._forget(missing, seen_at)
        if hits:
            self._notify_keys_accessed(hits)
        return loaded, None

    async def _load_each(
        self, keys: list[ObjectKey], cache_keys: list[CacheKey], dests: list[MemoryObj]
    ) -> list[bool | None]:
        """The keys of a load that met an object of another size than LMCache's buffer, one
        at a time: the hits, False for a miss, and None for each key stored in another
        layout, which is counted and logged (LMCache reports its load failed)."""
        found: list[bool | None] = []
        for key, cache_key, dest in zip(keys, cache_keys, dests, strict=True):
            try:
                found.extend(await self._io.load([cache_key], [dest]))
            except LayoutMismatch as mismatch:
                self._size_mismatch(key, mismatch)
                found.append(None)
        return found

    def _size_mismatch(self, key: ObjectKey, mismatch: LayoutMismatch) -> None:
        with self._state:
            self._size_mismatches += 1
        logger.warning(
            "KvplugL2Adapter: the load of %s from %s fails: %s",
            key,
            self._config.target(),
            mismatch,
        )

    # -- touch, delete, list --------------------------------------------------------------------

    def submit_touch(self, keys: list[ObjectKey]) -> None:
        """Mark ``keys`` used for LMCache's L2 eviction and, on a host-memory tier (reading
        costs nothing there), for the tier's own LRU as well."""
        keys = list(keys)
        self._notify_keys_accessed(keys)
        if not self._touches or self._closed:
            return

        async def touch() -> None:
            with contextlib.suppress(Exception):
                for obj in await self._backend.batched_get(
                    [object_key_to_cache_key(key) for key in keys]
                ):
                    if obj is not None:
                        obj.release()

        with contextlib.suppress(KvplugError, RuntimeError):
            self._client.run(touch())

    def delete(self, keys: list[ObjectKey]) -> None:
        """Remove ``keys`` from the backend (LMCache's L2 eviction); locked keys and absent
        keys are skipped. Never raises: a failure is logged and counted in the status."""
        keys = list(keys)
        if not keys or self._closed:
            return
        if not self._backend.capabilities.remove:
            logger.warning(
                "KvplugL2Adapter: %s cannot delete, so LMCache's L2 eviction removes nothing.",
                self._config.target(),
            )
            return
        try:
            self._client.run(self._delete(keys)).result(self._timeout + 5)
        except Exception as error:
            self._failed("failed_deletes", error)

    async def _delete(self, keys: list[ObjectKey]) -> None:
        async with self._lock_guard:
            unlocked = [key for key in keys if not self._locks.is_pinned(key)]
            try:
                results: list[bool | BaseException] = await self._within_deadline(
                    asyncio.gather(
                        *(self._backend.remove(object_key_to_cache_key(k)) for k in unlocked),
                        return_exceptions=True,
                    ),
                    "a delete",
                )
            except Exception as error:
                self._failed("failed_deletes", error)
                return
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is not None:
            self._failed("failed_deletes", failure)
        # Absent now either way (and unpinned), unless its removal failed.
        gone = [
            k for k, r in zip(unlocked, results, strict=True) if not isinstance(r, BaseException)
        ]
        self._pinned.difference_update(gone)
        self._forget(gone)

    def list_l2_keys(
        self,
        model_name: str | None = None,
        page_size: int = 500,
        cursor: str | None = None,
    ) -> Any:
        """One page of the MP keys the backend holds, in key order; ``cursor`` is the
        ``next_page_token`` of the page before. ``size_bytes`` is known for keys this adapter
        stored since it started, 0 for the others. Each page lists the whole backend, so
        listing suits maintenance, not the serving path."""
        check_page_request(page_size, cursor)
        if not self._backend.capabilities.list_keys:
            raise NotImplementedError(
                f"{self._config.target()} cannot list its keys (kvplug capability 'list_keys')."
            )
        listed = mp_keys(self._backend, model_name)
        items = self._client.run(self._within_deadline(listed, "a listing")).result()
        page, more = page_after(items, cursor, page_size)
        with self._state:
            entries = tuple(
                KeyEntry(key=key.to_encoded_object_key(), size_bytes=self._sizes.get(key, 0))
                for _, key in page
            )
        return KeyListPage(entries=entries, next_page_token=page[-1][0] if more else None)

    # -- identity, usage, status ----------------------------------------------------------------

    def set_backend_identity(self, name: str, shared: bool = False) -> None:
        super().set_backend_identity(name, shared)
        if MemoryTags is not None:
            self._tags = memory_tags(self._backend, shared)

    def get_memory_tags(self) -> Any:
        """Where the bytes live (LMCache 0.5.7+): DRAM for host-memory tiers, GDS for
        GPUDirect storage, STORAGE otherwise; REMOTE when another process or host can see
        them (Redis, Valkey, a ``shared`` adapter), else LOCAL."""
        if self._tags is None:
            raise NotImplementedError("this LMCache version has no memory tags (0.5.7 adds them)")
        return self._tags

    def report_status(self) -> dict[str, Any]:
        """Health, usage and counters, with kvplug's own statistics where the backend has
        them; URLs and errors are masked.

        Usage, in the fields ``lmcache describe kvcache`` shows for its own adapters ("Stored
        objects", "Used"): ``max_capacity_bytes`` is the capacity LMCache's L2 eviction works
        with (``capacity``, else the backend's ``max_size``, 0 for unknown);
        ``stored_object_count`` and ``current_size_bytes`` are what the store holds by its own
        counters (``usage_source: "backend"``: ``cpu://``, ``file://``, a Store of such tiers,
        which count also what other processes or an earlier run stored), else what this
        adapter stored since it started (``usage_source: "adapter"``: ``tracked_keys`` and
        ``bytes_used``, e.g. on ``redis://``).

        The adapter's own fields come from one snapshot (a task's result, its count and its
        effect on health land together), so they agree with each other: ``tasks_submitted``
        is ``stores_finished + lookups_finished + loads_finished + in_flight_tasks``, each
        ``failed_<kind>`` counts some of ``<kind>_finished``, and ``bytes_used`` is the sum of
        the sizes of the ``tracked_keys``. ``is_healthy`` (and ``healthy``, the same value) is
        true exactly when the adapter's IO thread answers, the last task or delete did not
        fail for an unreachable or late store, and no tier of a Store is failing
        (``failing_tiers``); ``last_error`` is the last failure's reason.

        ``counters`` is what the backend did for this adapter, counted by kvplug's backend
        template (:func:`kvplug.stats.summarize` of its ``operation_stats()``, the numbers
        ``kvplug check`` and a Store's per-tier series read): ``writes`` and ``bytes_written``
        (chunks stored), ``reads``, ``hits``, ``misses``, ``hit_rate`` and ``bytes_read``
        (chunks asked by loads, and by touches on a host-memory tier, which read to refresh its
        LRU), ``lookups`` and ``lookup_hits`` (keys asked by lookups), ``calls``, ``errors``
        (calls that raised: a failed load is one error, not a miss per chunk) and ``seconds``.
        One chunk is one kvplug key. They are not part of the adapter's snapshot: a task that
        just finished may be counted there and not yet in ``<kind>_finished``, or the other way
        round.

        Example::

            >>> adapter = KvplugL2Adapter({"url": "cpu://?max_size=64MiB"})
            >>> status = adapter.report_status()
            >>> status["usage_source"], status["stored_object_count"], status["max_capacity_bytes"]
            ('backend', 0, 67108864)
            >>> status["counters"]["writes"], status["counters"]["hit_rate"]
            (0, None)
            >>> adapter.close()
        """
        with self._state:
            calls = self._health.snapshot()
            status: dict[str, Any] = {
                "type": "KvplugL2Adapter",
                "target": self._config.target(),
                "backend": type(self._backend).__name__,
                "capabilities": list(self._backend.capabilities.declared()),
                "zero_copy_puts": self._io.lends_stores,
                "zero_copy_loads": self._io.lends_loads,
                "pins_locked_keys": self._pins,
                "locked_keys": len(self._locks),
                "tracked_keys": len(self._sizes),
                "bytes_used": self._bytes,
                "tasks_submitted": self._submitted,
                "in_flight_tasks": self._in_flight,
                **{f"{kind}_finished": count for kind, count in self._finished.items()},
                **{name: calls[name] for name in _FAILURES},
                "size_mismatches": self._size_mismatches,
                "last_error": calls["last_error"],
                "closed": self._closed,
            }
        status["counters"] = summarize(self._backend.operation_stats()).as_dict()
        status["max_capacity_bytes"] = self.get_usage().total_capacity_bytes
        store = store_of(self._backend)
        stats = getattr(self._backend, "stats", None)

        async def collect() -> tuple[Any, list[str], tuple[int, int] | None]:
            # On the IO thread, which the Store's state belongs to: one round trip answers
            # whether that thread is alive, with the stats, the failing tiers and the usage.
            failing = [] if store is None else [t.name for t in store.health() if not t.healthy]
            try:
                held = held_by_backend(self._backend)
                collected = mask_data(stats()) if callable(stats) else None
            except Exception as error:
                return KvplugError(mask_text(f"{type(error).__name__}: {error}")), failing, None
            return collected, failing, held

        io_alive, collected, held = False, None, None
        failing: list[str] = []
        if not status["closed"]:
            with contextlib.suppress(Exception):
                collected, failing, held = self._client.run(collect()).result(5)
                io_alive = True
        source = "adapter" if held is None else "backend"
        objects, used = (status["tracked_keys"], status["bytes_used"]) if held is None else held
        status.update(stored_object_count=objects, current_size_bytes=used, usage_source=source)
        if isinstance(collected, KvplugError):
            status["kvplug_error"] = str(collected)
        elif collected is not None:
            status["kvplug"] = collected
        if store is not None and io_alive:
            status["failing_tiers"] = failing
        healthy = io_alive and calls["healthy"] and not failing
        status.update(io_thread_alive=io_alive, healthy=healthy, is_healthy=healthy)
        return status

    # -- close ----------------------------------------------------------------------------------

    def close(self) -> None:
        """Give back every pin, close the backend and the IO thread, then the event fds.
        Idempotent."""
        with self._state:
            if self._closed:
                return
            self._closed = True
        if self._pins:

            async def unpin_all() -> None:
                async with self._lock_guard:
                    for key in list(self._pinned):
                        await self._unpin(key)
                    self._locks.clear()

            with contextlib.suppress(Exception):
                self._client.run(unpin_all()).result(5)
        try:
            self._client.close()
        except Exception as error:
            logger.warning(
                "KvplugL2Adapter: closing %s failed: %s",
                self._config.target(),
                mask_text(str(error)),
            )
        finally:
            for notifier in (self._store_fd, self._lookup_fd, self._load_fd):
                with contextlib.suppress(OSError):
                    notifier.close()


__all__ = [
    "DEFAULT_LOCK_TTL",
    "DEFAULT_TASK_TIMEOUT",
    "KvplugL2Adapter",
    "KvplugL2AdapterConfig",
    "backend_url_and_options",
]
