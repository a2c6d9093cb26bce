"""Any kvplug backend as LMCache's in-process remote storage: :class:`KvplugConnector`.

LMCache 0.5.x (in-process mode) loads remote storage plugins from its config. Point it at this
module and give the connector a kvplug URL (or a kvplug tiers YAML); every other key under the
plugin's prefix is a kvplug option::

    chunk_size: 256
    local_cpu: true
    max_local_cpu_size: 5
    remote_serde: naive
    remote_storage_plugins: ["kvplug"]
    extra_config:
      remote_storage_plugin.kvplug.module_path: kvplug_lmcache.connector
      remote_storage_plugin.kvplug.class_name: KvplugConnector
      remote_storage_plugin.kvplug.url: redis://cache-1:6379   # or .config: /etc/kvplug.yaml
      remote_storage_plugin.kvplug.timeout: 5                   # a kvplug option

LMCache's ``basic_check --mode test_remote`` builds its backend from ``remote_url`` only: check
this config with ``LMCACHE_REMOTE_URL=plugin://kvplug`` in the environment. An engine's config
must not name the plugin in both keys (LMCache then builds two connectors to one store): the
second connector built from such a config refuses to start.

LMCache only logs a plugin that fails to load or to build, so a broken set-up is made loud
here: the connector logs an ERROR with kvplug's message and raises LMCache's
``IrrecoverableException`` (:class:`KvplugConnectorError`), which fails LMCache's start where
LMCache lets an error through (``remote_url: plugin://kvplug``, ``basic_check``) and, for
``remote_storage_plugins``, makes LMCache log that it runs without this remote backend.

**The engine boundary.** A put hands kvplug LMCache's memory object; LMCache drops its own
reference when the put returns or raises. The connector lends that buffer to a backend only
where :class:`kvplug.runtime.engine.EngineIO` says it may (the backend lets go at once when a put
is cancelled and keeps no reference after it); every other backend gets a copy taken when the
put starts, so what is stored is exactly what LMCache handed over. A put that passes its
deadline is cancelled and raises. LMCache's in-process memory honours reference counts, so the
connector also keeps one reference on the object until kvplug's side of the put has ended:
LMCache never reuses the buffer while any part of kvplug could still read it. Reads go into
kvplug's own memory and are copied into new LMCache objects, so they never write memory
LMCache already holds.

Module paths that moved between LMCache versions (``lmcache.v1.*`` in 0.5.6, the in-process
modules under ``lmcache.inprocess.v1`` from 0.5.7) are resolved by :func:`inprocess_module`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib
import importlib.util
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, TypeVar

import torch
from lmcache.logging import init_logger
from lmcache.utils import CacheEngineKey
from lmcache.v1.exceptions import IrrecoverableException
from lmcache.v1.memory_management import MemoryFormat as LMCacheFormat
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from kvplug.errors import BackendTimeout, BackendUnavailable, KvplugError, NotSupported
from kvplug.keys import CacheKey
from kvplug.memory import MemoryFormat, MemoryObj
from kvplug.runtime.engine import EngineIO, check_target, open_client
from kvplug.runtime.store import store_url
from kvplug.runtime.sync import SyncClient
from kvplug.secrets import install_log_filter, mask_text, mask_url
from kvplug.stats import summarize
from kvplug_lmcache.keys import engine_key_to_cache_key

T = TypeVar("T")

logger = init_logger(__name__)  # LMCache's log format and LMCACHE_LOG_LEVEL
install_log_filter()

PLUGIN_PREFIX = "remote_storage_plugin."
"""LMCache's prefix of a remote storage plugin's keys in ``extra_config``."""
DEFAULT_PLUGIN_NAME = "kvplug"
DEADLINE_SHARE = 0.9
"""Every wait on kvplug lasts at most this share of LMCache's ``blocking_timeout_secs``, so
LMCache hears a miss or a failure before its own timeout, which would drop the connection."""
IO_SHARE = 0.9
"""A put is cancelled after this share of the connector's deadline, so that kvplug has let go
of LMCache's buffer (and says why the put failed) before LMCache's wait ends."""
PING_TIMEOUT = -1
PING_FAILED = 1

_LOADER_KEYS = frozenset({"module_path", "class_name"})
INPROCESS_PACKAGE = (
    "lmcache.inprocess.v1" if importlib.util.find_spec("lmcache.inprocess") else "lmcache.v1"
)
"""Where LMCache keeps its in-process modules (cache engine, GPU connectors, basic_check)."""


def inprocess_module(name: str) -> ModuleType:
    """LMCache's in-process module ``name`` (``"cache_engine"``, ``"basic_check"``,
    ``"gpu_connector.gpu_connectors"``, ...) in the installed version: under ``lmcache.v1`` in
    0.5.6, under ``lmcache.inprocess.v1`` from 0.5.7 on."""
    return importlib.import_module(f"{INPROCESS_PACKAGE}.{name}")


class KvplugConnectorError(IrrecoverableException):  # type: ignore[misc]
    """The connector cannot be set up (bad URL, unknown scheme or option, a config LMCache
    cannot use with kvplug). It is LMCache's ``IrrecoverableException``, so LMCache does not
    retry the set-up and fails its start where it lets the error through."""


_LIVE: weakref.WeakSet[KvplugConnector] = weakref.WeakSet()
"""The connectors of this process not yet collected (:meth:`KvplugConnector._refuse_a_twin`)."""
_LIVE_LOCK = threading.Lock()


def _close_later(client: SyncClient) -> None:
    # Closing waits for the client's own IO thread, so it must not run on that thread (a
    # garbage collection can run anywhere): close from a thread of its own.
    threading.Thread(target=client.close, name="kvplug-lmcache-close", daemon=True).start()


class KvplugConnector(RemoteConnector):  # type: ignore[misc]
    """LMCache's ``RemoteConnector`` over a kvplug backend (any URL, or a tiered Store).

    LMCache builds it as ``KvplugConnector(loop=, local_cpu_backend=, config=)`` from
    ``remote_storage_plugins`` (see the module docstring for the config). Its settings are the
    ``extra_config`` keys ``remote_storage_plugin.<name>.*`` of the plugin whose ``class_name``
    is this class: exactly one of ``url`` (a kvplug URL) or ``config`` (a kvplug tiers YAML),
    every other key a kvplug option. One kvplug plugin per LMCache instance: LMCache does not
    tell a connector which plugin it was built for (combine stores in one tiers YAML instead).

    * **Keys** are LMCache's ``CacheEngineKey``\\ s under the same string form
      (:func:`kvplug_lmcache.keys.engine_key_to_cache_key`).
    * **Puts** go through :class:`kvplug.runtime.engine.EngineIO`: LMCache's buffer is lent to
      a backend that lets go of it at once when a put is cancelled and keeps nothing after
      the put; every other backend (a ``cpu://`` tier, a write-behind Store, one without
      ``releases_on_cancel``; seen through wrappers) gets a copy taken when the put starts.
      A put is cancelled when its deadline passes; the connector holds its own reference to
      LMCache's object until kvplug's side has ended, also after LMCache stopped waiting. A
      failed put raises with kvplug's message (LMCache logs and counts it).
    * **Gets** copy into objects from ``local_cpu_backend.allocate`` (never waiting for memory
      on LMCache's event loop). A backend that is down or late reads as misses (``None``,
      ``False``, 0), never as an error, so LMCache keeps this connection and kvplug's own
      reconnection brings the data back when the store returns.
    * **Deadlines**: every wait ends within ``0.9 * blocking_timeout_secs`` (LMCache's
      setting), so LMCache's event loop never hangs on a store that stopped answering.
    * ``ping`` (LMCache's health check) is 0 when the backend answers, ``-1`` past the
      deadline and ``1`` when it fails.
    * Layerwise mode, non-``naive`` ``remote_serde`` and KV caches of several layer groups
      are refused with the fix named.

    Attributes: ``target`` (the masked URL or tiers file), ``deadline`` (seconds),
    ``copies_puts`` (whether puts copy LMCache's buffer rather than lend it); :meth:`stats`
    gives the store's counters and the failures LMCache saw, which :meth:`close` also logs.

    Example (what LMCache does with it)::

        connector = KvplugConnector(loop=loop, local_cpu_backend=cpu_backend, config=config)
        await connector.batched_put(keys, memory_objs)      # LMCache then drops its refs
        hits = await connector.batched_get(keys)            # LMCache objects or None
        await connector.close()
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        local_cpu_backend: Any,
        config: Any = None,
    ) -> None:
        if config is None:
            config = getattr(local_cpu_backend, "config", None)
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.plugin_name = DEFAULT_PLUGIN_NAME
        self.target = "kvplug"
        self._lock = threading.Lock()
        self._failures = dict.fromkeys(("put_failures", "read_failures"), 0)
        self._available = True
        self._closed = False
        self._lmcache_config: Any = None
        try:
            try:
                self._set_up(config)
            except BaseException:
                with _LIVE_LOCK:  # a connector that did not start is no twin of a later one
                    _LIVE.discard(self)
                raise
        except BackendUnavailable as error:
            logger.error(
                "kvplug remote storage for LMCache is not available now; LMCache runs without "
                "it until its health check sets the connection up again: %s",
                mask_text(str(error)),
            )
            raise
        except Exception as error:
            message = (
                f"kvplug remote storage for LMCache (plugin {self.plugin_name!r}, "
                f"{self.target}) cannot be set up: {mask_text(str(error))}"
            )
            logger.error("%s", message)
            raise KvplugConnectorError(message) from error

    # -- set-up ---------------------------------------------------------------------------------

    def _set_up(self, config: Any) -> None:
        if config is None:
            raise KvplugError(
                "LMCache gave the connector no config, so its extra_config settings cannot be "
                "read. Build it through LMCache's remote_storage_plugins."
            )
        self.plugin_name, settings = self.plugin_settings(config)
        url, tiers = settings.pop("url", None), settings.pop("config", None)
        self.target = mask_url(str(url)) if url is not None else f"tiers {tiers}"
        self._check_lmcache_config(config)
        self._refuse_a_twin(config)
        metadata = getattr(self.local_cpu_backend, "metadata", None)
        # The scheduler role gives no CPU backend and so no metadata: lookups only.
        self._can_allocate = metadata is not None
        if metadata is not None:
            # Sets meta_shapes, meta_dtypes and meta_fmt, which LMCache's health check and
            # basic_check read from every connector.
            super().__init__(config, metadata)
        blocking = float(getattr(config, "blocking_timeout_secs", 10) or 10)
        self.deadline = max(0.1, DEADLINE_SHARE * blocking)
        self._client = open_client(
            url=url,
            config=tiers,
            options=settings,
            what=f"extra_config {PLUGIN_PREFIX}{self.plugin_name}.*",
        )
        self._finalizer = weakref.finalize(self, _close_later, self._client)
        self._finalizer.atexit = False
        self._io = EngineIO(
            self._client.backend,
            timeout=IO_SHARE * self.deadline,
            what=f"KvplugConnector on {self.target}",
        )
        self.copies_puts = not self._io.lends_stores
        logger.info(
            "kvplug remote storage ready for LMCache: %s (%s puts, deadline %.1f s)",
            self.target,
            "copied" if self.copies_puts else "zero-copy",
            self.deadline,
        )

    def _refuse_a_twin(self, config: Any) -> None:
        """Refuse to be the second connector LMCache builds from one config that names this
        plugin both as ``remote_url`` and in ``remote_storage_plugins`` (LMCache makes one
        remote backend of each); the first one serves."""
        url = f"plugin://{self.plugin_name}"
        named_twice = getattr(config, "remote_url", None) == url and self.plugin_name in (
            getattr(config, "remote_storage_plugins", None) or []
        )
        with _LIVE_LOCK:
            twin = named_twice and any(
                other._lmcache_config is config and other.plugin_name == self.plugin_name
                for other in _LIVE
                if not other._closed
            )
            if not twin:
                self._lmcache_config = config
                _LIVE.add(self)
        if twin:
            raise KvplugError(
                f"LMCache's config names this plugin twice, as remote_url: {url} and in "
                f"remote_storage_plugins, so LMCache builds two connectors to one store and "
                "would write and look up every chunk twice; this second one does not start. "
                f"Remove remote_url from the engine's config (LMCache's basic_check needs it: "
                f"give it there as LMCACHE_REMOTE_URL={url})."
            )

    @classmethod
    def plugin_settings(cls, config: Any) -> tuple[str, dict[str, Any]]:
        """The plugin name this class is configured under and its settings from
        ``config.extra_config`` (``remote_storage_plugin.<name>.*`` less the loader keys)."""
        extra = dict(getattr(config, "extra_config", None) or {})
        listed = list(getattr(config, "remote_storage_plugins", None) or [])
        suffix = ".class_name"
        names = [
            key[len(PLUGIN_PREFIX) : -len(suffix)]
            for key, value in extra.items()
            if key.startswith(PLUGIN_PREFIX) and key.endswith(suffix) and value == cls.__name__
        ]
        if listed:
            names = [name for name in names if name in listed]
        if len(names) > 1:
            raise KvplugError(
                f"extra_config configures {len(names)} remote storage plugins with "
                f"{cls.__name__} ({', '.join(names)}), but LMCache does not tell a connector "
                "which plugin it was built for. Keep one and put the stores in one kvplug "
                f"tiers YAML ({PLUGIN_PREFIX}<name>.config)."
            )
        name = names[0] if names else DEFAULT_PLUGIN_NAME
        prefix = f"{PLUGIN_PREFIX}{name}."
        settings = {
            key[len(prefix) :]: value
            for key, value in extra.items()
            if key.startswith(prefix) and "." not in key[len(prefix) :]
        }
        for key in _LOADER_KEYS:
            settings.pop(key, None)
        return name, settings

    def _check_lmcache_config(self, config: Any) -> None:
        if getattr(config, "use_layerwise", False):
            raise NotSupported(
                "LMCache's use_layerwise stores one object per layer, and kvplug stores whole "
                "chunks. Set use_layerwise: false to use kvplug as remote storage."
            )
        serde = getattr(config, "remote_serde", "naive")
        if serde not in (None, "naive"):
            raise NotSupported(
                f"remote_serde {serde!r} is not supported with kvplug: set remote_serde: naive "
                "(kvplug's own 'serde' option compresses, where a backend supports it)."
            )

    # -- bridging to kvplug's IO thread --------------------------------------------------------

    async def _wait(
        self,
        future: concurrent.futures.Future[T],
        what: str,
        abandon: Callable[[T], None] | None = None,
    ) -> T:
        """``future``'s result, awaited on LMCache's loop within the deadline. On a timeout or a
        cancellation the kvplug operation runs on (it is never cancelled midway); ``abandon``
        then gets its result when it ends, to release what nobody will read."""
        loop = asyncio.get_running_loop()
        done = asyncio.Event()

        def wake(_: concurrent.futures.Future[T]) -> None:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
                loop.call_soon_threadsafe(done.set)

        future.add_done_callback(wake)
        try:
            await asyncio.wait_for(done.wait(), self.deadline)
        except BaseException as error:
            if abandon is not None:
                future.add_done_callback(lambda f: self._abandoned(f, abandon))
            if isinstance(error, TimeoutError):
                raise self._late(what) from None
            raise
        return future.result()

    def _late(self, what: str) -> BackendTimeout:
        return BackendTimeout(
            f"{what} on {self.target} did not finish within {self.deadline:.1f} s "
            "(0.9 x LMCache's blocking_timeout_secs); the store is slow or unreachable."
        )

    @staticmethod
    def _abandoned(future: concurrent.futures.Future[T], abandon: Callable[[T], None]) -> None:
        if not future.cancelled() and future.exception() is None:
            abandon(future.result())

    def _result(self, future: concurrent.futures.Future[T]) -> T:
        """``future``'s result for LMCache's synchronous calls, within the deadline."""
        try:
            return future.result(self.deadline)
        except TimeoutError:
            raise BackendTimeout(
                f"a call on {self.target} did not finish within {self.deadline:.1f} s; the store "
                "is slow or unreachable."
            ) from None

    def _note_read(self, error: BaseException | None) -> None:
        """Log the first failed read of an outage and the first good one after it."""
        with self._lock:
            was_available, self._available = self._available, error is None
            if error is not None:
                self._failures["read_failures"] += 1
        if error is not None and was_available:
            logger.warning(
                "kvplug remote storage %s failed a read, reporting misses until it answers: %s",
                self.target,
                mask_text(str(error)),
            )
        elif error is None and not was_available:
            logger.info("kvplug remote storage %s answers again", self.target)

    def stats(self) -> dict[str, int | float | None]:
        """What the store did for this connector, counted by kvplug's backend template
        (:func:`kvplug.stats.summarize` of the backend's ``operation_stats()``, the numbers
        ``kvplug check`` reads; one LMCache chunk is one kvplug key): ``writes`` and
        ``bytes_written`` (chunks stored), ``reads``, ``hits``, ``misses``, ``hit_rate`` and
        ``bytes_read`` (chunks asked by gets), ``lookups`` and ``lookup_hits`` (chunks asked by
        ``exists``, the batched lookups and ``ping``), ``calls``, ``errors`` (kvplug calls that
        raised) and ``seconds``; with what LMCache saw fail: ``put_failures`` (chunks of puts
        that raised to LMCache) and ``read_failures`` (gets and lookups answered as misses
        because the store failed or was late). A read the store answered after LMCache stopped
        waiting counts its hits there, and one read failure here; a hit LMCache had no memory
        for is a hit there, and a miss to LMCache (logged)."""
        counters: dict[str, int | float | None] = summarize(
            self._client.backend.operation_stats()
        ).as_dict()
        with self._lock:
            counters.update(self._failures)
        return counters

    # -- objects --------------------------------------------------------------------------------

    @staticmethod
    def kvplug_view(memory_obj: Any) -> MemoryObj:
        """A kvplug object over an LMCache ``TensorMemoryObj``'s memory (no copy)."""
        shapes = memory_obj.meta.shapes
        if shapes is not None and len(shapes) > 1:
            raise NotSupported(
                f"this KV cache has {len(shapes)} layer groups in one chunk; kvplug stores one "
                "shape and dtype per chunk. Use LMCache's own remote connectors for hybrid "
                "models."
            )
        fmt = memory_obj.get_memory_format().value
        try:
            kvplug_fmt = MemoryFormat(fmt)
        except ValueError:
            raise NotSupported(
                f"LMCache memory format {memory_obj.get_memory_format().name} has no kvplug form; "
                "kvplug stores KV cache chunks."
            ) from None
        tensor = memory_obj.tensor
        if tensor is None:
            raise KvplugError("LMCache passed an invalidated memory object to put.")
        return MemoryObj.from_tensor(tensor, kvplug_fmt)

    def _to_lmcache(self, obj: MemoryObj) -> Any:
        """A new LMCache object holding ``obj``'s bytes, or None when LMCache has no room."""
        fmt = LMCacheFormat(int(obj.fmt))
        target = self.local_cpu_backend.allocate(
            torch.Size(obj.shape), obj.dtype, fmt, busy_loop=False
        )
        if target is None:
            logger.warning(
                "LMCache's CPU memory has no room for a %d-byte chunk read from %s; reported "
                "as a miss",
                obj.nbytes,
                self.target,
            )
            return None
        try:
            target.raw_data[: obj.nbytes].copy_(obj.raw)
        except BaseException:
            target.ref_count_down()
            raise
        return target

    def _to_lmcache_all(self, found: Sequence[MemoryObj | None]) -> list[Any]:
        """LMCache objects for kvplug's results; one that LMCache cannot hold is a miss."""
        results: list[Any] = []
        try:
            for obj in found:
                if obj is None:
                    results.append(None)
                    continue
                try:
                    results.append(self._to_lmcache(obj))
                except Exception as error:
                    logger.warning(
                        "a chunk read from %s does not fit LMCache (%r); reported as a miss: %s",
                        self.target,
                        obj,
                        mask_text(str(error)),
                    )
                    results.append(None)
        except BaseException:
            for result in results:
                if result is not None:
                    result.ref_count_down()
            raise
        return results

    @staticmethod
    def _release(found: Sequence[MemoryObj | None]) -> None:
        for obj in found:
            if obj is not None:
                obj.release()

    @staticmethod
    def _cache_keys(keys: Sequence[CacheEngineKey]) -> list[CacheKey]:
        return [engine_key_to_cache_key(key) for key in keys]

    # -- reads ----------------------------------------------------------------------------------

    async def _read(self, keys: Sequence[CacheEngineKey], what: str) -> list[Any]:
        if not keys:
            return []
        if not self._can_allocate:
            return [None] * len(keys)
        try:
            future = self._client.batched_get(self._cache_keys(keys))
            found = await self._wait(future, what, abandon=self._release)
        except Exception as error:
            self._note_read(error)
            return [None] * len(keys)
        self._note_read(None)
        try:
            return self._to_lmcache_all(found)
        finally:
            self._release(found)

    async def get(self, key: CacheEngineKey) -> Any:
        """The chunk under ``key`` in a new LMCache object, or None (a miss, or a failed
        read)."""
        return (await self._read([key], f"get of {key.to_string()}"))[0]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[CacheEngineKey]) -> list[Any]:
        """One batched kvplug get; aligned with ``keys``, None for each miss."""
        return await self._read(keys, f"batched get of {len(keys)} chunks")

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(
        self, lookup_id: str, keys: list[CacheEngineKey]
    ) -> list[Any]:
        """The leading hits only: objects after the first miss are released."""
        results = await self._read(keys, f"prefetch {lookup_id} of {len(keys)} chunks")
        prefix: list[Any] = []
        for result in results:
            if result is None:
                break
            prefix.append(result)
        for result in results[len(prefix) :]:
            if result is not None:
                result.ref_count_down()
        return prefix

    async def exists(self, key: CacheEngineKey) -> bool:
        """Whether ``key`` is stored; False when the store cannot answer in time."""
        try:
            found = await self._wait(
                self._client.contains(engine_key_to_cache_key(key)), "contains"
            )
        except Exception as error:
            self._note_read(error)
            return False
        self._note_read(None)
        return found

    def exists_sync(self, key: CacheEngineKey) -> bool:
        """:meth:`exists` for LMCache's worker threads (never kvplug's IO thread)."""
        try:
            found = self._result(self._client.contains(engine_key_to_cache_key(key)))
        except Exception as error:
            self._note_read(error)
            return False
        self._note_read(None)
        return found

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[CacheEngineKey]) -> int:
        """How many leading ``keys`` are stored (one batched kvplug call); 0 on failure."""
        if not keys:
            return 0
        try:
            count = self._result(self._client.batched_contains(self._cache_keys(keys)))
        except Exception as error:
            self._note_read(error)
            return 0
        self._note_read(None)
        return count

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(
        self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False
    ) -> int:
        """:meth:`batched_contains` on LMCache's loop (``pin`` is not used: a remote store's
        entries are not pinned by LMCache's lookups)."""
        if not keys:
            return 0
        try:
            future = self._client.batched_contains(self._cache_keys(keys))
            count = await self._wait(future, f"lookup {lookup_id}")
        except Exception as error:
            self._note_read(error)
            return 0
        self._note_read(None)
        return count

    # -- writes ---------------------------------------------------------------------------------

    async def _store(self, keys: list[CacheKey], views: list[MemoryObj]) -> None:
        """Runs on kvplug's IO thread: one batched put, LMCache's buffers lent or copied (see
        :class:`~kvplug.runtime.engine.EngineIO`), cancelled at the deadline. When this ends,
        kvplug holds no reference to those buffers."""
        started = time.monotonic()
        try:
            await self._io.store(keys, views)
        except BackendTimeout as error:
            if time.monotonic() - started < self._io.timeout:
                raise  # the backend's own timeout, which names its setting
            raise self._late(f"put of {len(keys)} chunks") from error

    async def _write(self, keys: Sequence[CacheEngineKey], memory_objs: Sequence[Any]) -> None:
        if len(keys) != len(memory_objs):
            raise ValueError(f"put got {len(keys)} keys but {len(memory_objs)} objects.")
        try:
            cache_keys = self._cache_keys(keys)
            views = [self.kvplug_view(obj) for obj in memory_objs]
            held: list[Any] = []
            try:
                for obj in memory_objs:
                    obj.ref_count_up()
                    held.append(obj)
                future = self._client.run(self._store(cache_keys, views))
            except BaseException:
                for obj in held:
                    obj.ref_count_down()
                raise
            # LMCache drops its reference when this coroutine returns; this one keeps the
            # buffer alive until kvplug has finished with it, however long that takes.
            future.add_done_callback(lambda _: [obj.ref_count_down() for obj in held])
            await self._wait(future, f"put of {len(keys)} chunks")
        except Exception:
            with self._lock:
                self._failures["put_failures"] += len(keys)
            raise

    async def put(self, key: CacheEngineKey, memory_obj: Any) -> None:
        """Store ``memory_obj`` under ``key``; raises with kvplug's message on failure. The
        caller's reference is left alone (LMCache's wrapper drops it)."""
        await self._write([key], [memory_obj])

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: list[CacheEngineKey], memory_objs: list[Any]) -> None:
        """One batched kvplug put of all pairs."""
        await self._write(keys, memory_objs)

    def remove_sync(self, key: CacheEngineKey) -> bool:
        """Delete ``key``; False when absent, or when the backend cannot delete."""
        try:
            return self._result(self._client.remove(engine_key_to_cache_key(key)))
        except NotSupported:
            return False

    # -- the rest -------------------------------------------------------------------------------

    async def list(self) -> list[str]:
        """Every stored key's string (LMCache's form); empty when the backend cannot list."""
        backend = self._client.backend
        if not backend.capabilities.list_keys:
            return []

        async def collect() -> list[str]:
            return [key.to_string() async for key in backend.list_keys()]

        return await self._wait(self._client.run(collect()), "list")

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        """0 when the backend answers, ``-1`` past the deadline, ``1`` when it fails."""
        probe = CacheKey("kvplug-lmcache-ping", 1, 0, 0)
        try:
            await self._wait(self._client.contains(probe), "ping")
        except BackendTimeout:
            return PING_TIMEOUT
        except Exception as error:
            logger.warning(
                "kvplug remote storage %s failed a ping: %s", self.target, mask_text(str(error))
            )
            return PING_FAILED
        return 0

    async def close(self) -> None:
        """Close the kvplug client (idempotent) and log the counters."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._finalizer.detach()
        await asyncio.to_thread(self._client.close)
        counts = self.stats()
        logger.info(
            "kvplug remote storage %s closed: %d chunks written (%d bytes, %d put failures), "
            "%d read (%d hits, %d misses, %d bytes), %d read failures",
            self.target,
            counts["writes"],
            counts["bytes_written"],
            counts["put_failures"],
            counts["reads"],
            counts["hits"],
            counts["misses"],
            counts["bytes_read"],
            counts["read_failures"],
        )

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.target}>"


def backend_url_and_options(lmcache_config: Any) -> tuple[str, dict[str, Any]]:
    """The kvplug URL and options of the backend :class:`KvplugConnector` opens for
    ``lmcache_config`` (LMCache's in-process config: its ``extra_config`` keys
    ``remote_storage_plugin.<name>.*``, read by :meth:`KvplugConnector.plugin_settings`):
    ``url`` as given, or for ``config`` the ``store://`` URL of that tiers YAML (the same Store
    over the same tiers), with every other key as an option. ``kvplug.open_backend(url,
    **options)`` opens that backend, as the contract suite does in
    ``integrations/lmcache/tests/test_lmcache_contract.py``.

    Example::

        >>> from types import SimpleNamespace
        >>> lmcache_config = SimpleNamespace(extra_config={
        ...     "remote_storage_plugin.kvplug.class_name": "KvplugConnector",
        ...     "remote_storage_plugin.kvplug.url": "redis://cache-1:6379",
        ...     "remote_storage_plugin.kvplug.timeout": 5,
        ... })
        >>> backend_url_and_options(lmcache_config)
        ('redis://cache-1:6379', {'timeout': 5})
    """
    name, settings = KvplugConnector.plugin_settings(lmcache_config)
    url, tiers = settings.pop("url", None), settings.pop("config", None)
    check_target(url, tiers, settings, what=f"extra_config {PLUGIN_PREFIX}{name}.*")
    if tiers is not None:
        url = store_url(tiers)
    return str(url), settings


__all__ = [
    "INPROCESS_PACKAGE",
    "KvplugConnector",
    "KvplugConnectorError",
    "backend_url_and_options",
    "inprocess_module",
]
