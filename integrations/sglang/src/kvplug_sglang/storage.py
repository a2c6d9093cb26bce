"""kvplug as SGLang's HiCache L3 storage: ``KvplugHiCacheStorage``.

SGLang loads it as a ``dynamic`` storage backend::

    python -m sglang.launch_server --model-path Qwen/Qwen3-8B --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvplug",
            "module_path": "kvplug_sglang", "class_name": "KvplugHiCacheStorage",
            "interface_v1": 1, "url": "file:///var/cache/kv"}'

Extra config keys of kvplug's own (SGLang's ``backend_name``, ``module_path``, ``class_name``,
``interface_v1`` and its prefetch settings pass through): ``url`` (any kvplug URL) or
``config`` (a kvplug tiers YAML), and optionally ``options`` (kvplug backend or Store options),
``task_timeout`` (seconds one call may take, default 60), ``check_on_start`` (fail at start
when the store does not answer, default true) and ``tenant`` (the tenant of every page this
storage stores and reads; default none).

Tenants: SGLang folds each request's ``extra_key`` and ``cache_salt`` into its page hashes
(``storage_namespace_seed``), so two salts never share a page, but it hands the storage the page
hashes alone (``HiCacheStorageExtraInfo`` carries the prefix keys only): kvplug cannot tell
whose page it stores. The ``tenant`` key names the deployment's tenant instead, carried in every
key (:mod:`kvplug_sglang.keys`), for the store's per-tenant quotas and keys.

With ``interface_v1: 1`` SGLang's controller calls the page API (:meth:`batch_set_v1`,
:meth:`batch_get_v1`) with host pool pages, one batched kvplug call per SGLang call. Pages of a
page-major host layout (``page_first``, ``page_first_direct``) are one or two contiguous regions
each (K and V for MHA) and go to kvplug as they are; a ``layer_first`` page is spread over every
layer and is gathered into a buffer of kvplug's own (one copy each way), as SGLang's own
backends do. Without ``interface_v1`` the controller uses the older copying methods
(:meth:`batch_set`, :meth:`batch_get`), which store the same objects.

Keys: see :mod:`kvplug_sglang.keys`. MLA models keep one copy of a page for all TP ranks: only
the storage writer rank writes it, every rank reads it.

**The engine boundary.** SGLang frees or reuses a call's host pages as soon as the call
returns, also when it reports failure. So a call returns within ``task_timeout`` (plus the
time a cancelled operation takes to unwind), and once it has returned nothing of kvplug reads
or writes those pages again:

* the host pages are lent to the backend only where it lets go of them the moment an
  operation is cancelled (the ``releases_on_cancel`` capability) and keeps no reference after a
  put; every other backend (a thread-based one, a host-memory tier, a Store that writes
  behind, also behind a wrapper) stores a copy taken when the call began and reads into
  kvplug's memory, copied into the pages only while the call is live
  (:class:`kvplug.runtime.engine.EngineIO`);
* a gathered ``layer_first`` page already is such a copy: it goes to the backend as it is
  (copied once more only into the memory of a backend that keeps put objects), and a load is
  scattered into the pages on SGLang's thread before the call returns, only from buffers the
  backend has let go of, never after a failure;
* what a key holds is the bytes SGLang handed over when the call began: a page rewritten after
  a failed or timed-out store never lands under the old key. After a failed load a page holds
  undefined bytes (SGLang frees it), and nothing writes it later.

Failures never reach SGLang's threads as exceptions: a store that is down, slow or full makes
the call report failures (``False`` pages, ``0`` existing pages), the first failure is logged as
a warning, and the next call tries again (kvplug's backends reconnect by themselves). A page is
reported stored only when every one of its segments is: where the backend tells which keys of
a failed batch were stored, the other pages of the batch report True.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from kvplug.errors import ConfigError, KvplugError
from kvplug.keys import (
    MAX_TENANT_LENGTH,
    CacheKey,
    InvalidKey,
    lmcache_dtype_name,
    tenant_tag_value,
)
from kvplug.memory import MemoryFormat, MemoryObj
from kvplug.runtime.engine import (
    CallHealth,
    EngineIO,
    check_keys,
    check_target,
    flag,
    keeps_objects,
    open_client,
    positive_seconds,
    probe,
    tiers_of,
    within_deadline,
)
from kvplug.runtime.store import store_url, stored_keys
from kvplug.runtime.sync import SyncClient
from kvplug.secrets import mask_text, mask_url
from kvplug.stats import CounterSummary, summarize
from kvplug_sglang.keys import PageNamespace, model_field
from kvplug_sglang.pool import PoolGeometry, pool_geometry

logger = logging.getLogger("kvplug.sglang")
T = TypeVar("T")

DEFAULT_TASK_TIMEOUT = 60.0
"""Seconds one SGLang call may take before it reports failure."""

KVPLUG_KEYS = {
    "url": "a kvplug URL, e.g. file:///var/cache/kv or redis://host:6379",
    "config": "path of a kvplug tiers YAML (instead of url)",
    "options": "mapping of kvplug backend or Store options",
    "task_timeout": f"seconds one call may take (default {DEFAULT_TASK_TIMEOUT})",
    "check_on_start": "fail at start when the store does not answer (default true)",
    "tenant": "the tenant of every page this storage stores and reads (default: none)",
}
SGLANG_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        "tp_lcm_size",
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
    }
)
"""Extra config keys that SGLang itself reads; kvplug accepts and ignores them."""

_WHAT = "KvplugHiCacheStorage"


_FAILURES = ("failed_sets", "failed_gets", "failed_exists", "failed_clears")


@dataclass(frozen=True)
class StorageHealth:
    """What :meth:`KvplugHiCacheStorage.health` reports: the calls that failed, and the
    store's counters."""

    healthy: bool
    """False once a call found the store unreachable or late, until one succeeds."""
    last_error: str | None
    failed_sets: int
    failed_gets: int
    failed_exists: int
    failed_clears: int
    objects_per_page: int
    """kvplug objects (keys) one page is stored as: 2 for an MHA page of a page-major host
    layout (its K and V regions), 1 otherwise (an MLA page, a gathered ``layer_first`` page,
    and before SGLang registers its host pool)."""
    counters: CounterSummary
    """What the store did for this storage, per kvplug object, counted by kvplug's backend
    template (:func:`kvplug.stats.summarize` of its ``operation_stats()``, the numbers
    ``kvplug check`` and a Store's per-tier series read): ``writes`` and ``bytes_written``
    (objects stored), ``reads``, ``hits``, ``misses``, ``hit_rate`` and ``bytes_read``
    (objects asked by loads), ``lookups`` and ``lookup_hits`` (objects asked by
    ``batch_exists`` and the probe at start), ``calls``, ``errors`` and ``seconds``.

    A page is whole only when each of its ``objects_per_page`` objects is, so with one object
    per page ``writes``, ``hits`` and ``misses`` are pages stored, loaded and missed; with two,
    they are twice the pages where no page is half there, and a page with one object stored (a
    batch the store partly refused, a tier that evicted one of them) counts that object. The
    pages SGLang was told were stored or loaded whole, per call, are SGLang's own metrics
    (:meth:`KvplugHiCacheStorage.get_stats`). A call that raised is one error, not a miss per
    object (and one of ``failed_sets`` or ``failed_gets`` here)."""


@dataclass
class _Metrics:
    """Per-call figures for SGLang's storage metrics, drained by ``get_stats``."""

    prefetch_pgs: list[int] = field(default_factory=list)
    backup_pgs: list[int] = field(default_factory=list)
    prefetch_bandwidth: list[float] = field(default_factory=list)
    backup_bandwidth: list[float] = field(default_factory=list)


def _settings(extra: Mapping[str, Any]) -> dict[str, Any]:
    check_keys(
        extra,
        KVPLUG_KEYS,
        what=_WHAT,
        where="--hicache-storage-backend-extra-config",
        engine="SGLang",
        engine_keys=SGLANG_KEYS,
    )
    check_target(extra.get("url"), extra.get("config"), extra.get("options"), what=_WHAT)
    tenant = extra.get("tenant", "")
    if "tenant" in extra:
        try:
            tenant_tag_value(tenant)
        except InvalidKey as error:
            raise ConfigError(
                f"{_WHAT}: tenant is refused: {error} Set it to the tenant's name, a string of 1 "
                f"to {MAX_TENANT_LENGTH} characters without NUL, or leave it out for none."
            ) from None
    return {
        "tenant": tenant,
        "timeout": positive_seconds(
            extra.get("task_timeout", DEFAULT_TASK_TIMEOUT), name="task_timeout", what=_WHAT
        ),
        "check_on_start": flag(
            extra.get("check_on_start", True), name="check_on_start", what=_WHAT
        ),
    }


def backend_url_and_options(extra_config: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """The kvplug URL and options of the backend :class:`KvplugHiCacheStorage` opens for
    ``extra_config`` (SGLang's ``--hicache-storage-backend-extra-config``, parsed), checked as
    at SGLang's start: ``url`` as given, or for ``config`` the ``store://`` URL of that tiers
    YAML (the same Store over the same tiers), with ``options``. ``kvplug.open_backend(url,
    **options)`` opens that backend, as the contract suite does in
    ``integrations/sglang/tests/test_sglang_contract.py``.

    Example::

        >>> backend_url_and_options({"url": "file:///var/cache/kv", "options": {"timeout": 5}})
        ('file:///var/cache/kv', {'timeout': 5})
        >>> backend_url_and_options({"config": "/etc/kvplug.yaml"})
        ('store:///etc/kvplug.yaml', {})
    """
    _settings(extra_config)
    url, config = extra_config.get("url"), extra_config.get("config")
    if config is not None:
        url = store_url(config)
    return str(url), dict(extra_config.get("options") or {})


def _namespace_shard(config: HiCacheStorageConfig) -> tuple[int, int]:
    """World size and worker id of this rank's pages."""
    if config.is_mla_model:  # one copy for all TP ranks, split by decode context parallelism
        return config.dcp_size, config.dcp_rank
    return config.tp_size, config.tp_rank


def _shard_tags(config: HiCacheStorageConfig) -> tuple[tuple[str, str], ...]:
    tags = []
    if config.pp_size > 1:
        tags.append(("pp", f"{config.pp_rank}/{config.pp_size}"))
    if config.attn_cp_size > 1:
        tags.append(("cp", f"{config.attn_cp_rank}/{config.attn_cp_size}"))
    return tuple(tags)


def _wrap(tensor: torch.Tensor) -> MemoryObj:
    return MemoryObj.from_tensor(tensor, MemoryFormat.BINARY_BUFFER)


class KvplugHiCacheStorage(HiCacheStorage):  # type: ignore[misc]  # sglang is untyped
    """Any kvplug backend or tiers config as SGLang's HiCache L3 storage (see the module
    documentation for the flags). SGLang builds it as ``cls(storage_config, kwargs)``; the
    settings come from ``storage_config.extra_config``, ``kwargs`` is unused.

    Example (SGLang builds it this way from the extra config and then registers its host
    pool; ``host_pool`` is SGLang's ``MHATokenToKVPoolHost``)::

        storage = KvplugHiCacheStorage(storage_config, {})  # extra config in storage_config
        storage.register_mem_pool_host(host_pool)
        ok = storage.batch_set_v1(page_keys, host_indices)          # [True, True, ...]
        hits = storage.batch_exists(page_keys)                      # leading pages present
        loaded = storage.batch_get_v1(page_keys[:hits], other_indices)
    """

    def __init__(
        self, storage_config: HiCacheStorageConfig, kwargs: Mapping[str, Any] | None = None
    ) -> None:
        extra = dict(storage_config.extra_config or {})
        settings = _settings(extra)
        if storage_config.should_split_heads:
            raise ConfigError(
                f"{_WHAT} does not split heads across heterogeneous TP sizes (tp_lcm_size): "
                "remove tp_lcm_size from the extra config, or use one TP size for every "
                "instance that shares the store."
            )
        self.storage_config = storage_config
        self._timeout: float = settings["timeout"]
        self._tenant: str = settings["tenant"]
        self._writer = storage_config.is_storage_writer
        self._metrics_on = storage_config.enable_storage_metrics
        self._metrics = _Metrics()
        self._state = threading.Lock()
        self._target = (
            mask_url(extra["url"]) if extra.get("url") else f"the tiers in {extra['config']}"
        )
        self._calls = CallHealth(self._what, _FAILURES, logger)
        self._client: SyncClient = open_client(
            url=extra.get("url"),
            config=extra.get("config"),
            options=extra.get("options"),
            what=_WHAT,
        )
        try:
            self._io = EngineIO(self._client.backend, timeout=self._timeout, what=self._what)
            self._keeps_objects = keeps_objects(self._client.backend)
            if settings["check_on_start"]:
                self._check_reachable()
        except BaseException:
            self._client.close()
            raise
        if storage_config.is_mla_model and storage_config.tp_size > 1:
            self._warn_unless_shared()
        self.mem_pool_host: Any = None
        self._namespace: PageNamespace | None = None
        self._geometry: PoolGeometry | None = None

    # -- set-up ---------------------------------------------------------------------------------

    def _check_reachable(self) -> None:
        try:
            probe(self._client, self._timeout)
        except Exception as error:
            raise KvplugError(
                f"{_WHAT}: {self._target} did not answer at start "
                f"({mask_text(str(error)) or type(error).__name__}). Start the store, fix the "
                "url, or set check_on_start to false to start anyway and retry on every call."
            ) from None

    def _warn_unless_shared(self) -> None:
        layers = tiers_of(self._client.backend)
        if not any(layer.capabilities.shared_across_processes for layer in layers):
            logger.warning(
                "%s: %s keeps what each process stores to itself, but this MLA model's pages "
                "are written by one TP rank and read by all %d: the other ranks will miss, and "
                "SGLang then loads nothing. Use a store shared across processes (file://, "
                "gds://, redis://, valkey://, or a tiers config with one) for MLA with TP > 1.",
                _WHAT,
                self._target,
                self.storage_config.tp_size,
            )

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Learn the host pool's page geometry and layout (SGLang calls this once, before any
        page call; what is read: :mod:`kvplug_sglang.pool`). Pages the pool describes as at
        most two contiguous regions go to kvplug as they are (lent to the backend, or copied
        where it is not lent them); others are gathered into one object per page. A pool
        kvplug cannot serve raises :class:`~kvplug.errors.ConfigError` saying what it lacks."""
        geometry = pool_geometry(mem_pool_host)
        config = self.storage_config
        world_size, worker_id = _namespace_shard(config)
        namespace = PageNamespace(
            model_name=model_field(config.model_name),
            world_size=world_size,
            worker_id=worker_id,
            dtype=lmcache_dtype_name(geometry.dtype),
            layout=geometry.layout,
            segments=len(geometry.segment_sizes),
            shard_tags=_shard_tags(config),
            tenant=self._tenant,
        )
        super().register_mem_pool_host(mem_pool_host)
        self._geometry, self._namespace = geometry, namespace
        if not config.model_name:
            logger.warning(
                "%s: SGLang passed no model name, so pages are keyed under %r, as SGLang's own "
                "backends then key them by rank alone: another model with the same TP shard, "
                "dtype and layout shares them. Give the storage config a model_name (SGLang's "
                "server passes --served-model-name, which defaults to --model-path).",
                _WHAT,
                namespace.model_name,
            )
        logger.info(
            "%s on %s: %s pages of %d bytes as %d object(s) each, %s, %s.",
            _WHAT,
            self._target,
            geometry.layout,
            geometry.page_bytes,
            len(self._segment_sizes),
            self._moves(),
            f"tenant {self._tenant!r}" if self._tenant else "no tenant",
        )

    def _moves(self) -> str:
        """How pages move, for the log."""
        if not self._zero_copy:
            return "gathered into kvplug's memory (one copy each way)"
        stores = "lent to the backend" if self._io.lends_stores else "copied at submit"
        loads = "read into the pages" if self._io.lends_loads else "read through kvplug's memory"
        return f"stores {stores}, loads {loads}"

    # -- plumbing -------------------------------------------------------------------------------

    def _call(self, counter: str, failed: Callable[[Exception], T], call: Callable[[], T]) -> T:
        """``call()`` on SGLang's thread (waiting for kvplug's IO thread through
        :meth:`_wait`); any failure is counted, logged and answered with ``failed(error)``."""
        if self._namespace is None:
            error = KvplugError("SGLang has not registered its host memory pool yet")
            self._calls.failed(counter, error)
            return failed(error)
        try:
            result = call()
        except Exception as error:
            self._calls.failed(counter, error)
            return failed(error)
        self._calls.succeeded()
        return result

    def _wait(self, work: Coroutine[Any, Any, T]) -> T:
        """Run ``work`` on kvplug's IO thread and wait for it."""
        return self._client.run(work).result()

    async def _within_deadline(self, work: Awaitable[T], what: str) -> T:
        return await within_deadline(work, self._timeout, f"{what} on {self._target}")

    def _keys(self, page_keys: Sequence[str]) -> list[CacheKey]:
        assert self._namespace is not None
        return [key for page in page_keys for key in self._namespace.segment_keys(page)]

    @property
    def _segment_sizes(self) -> tuple[int, ...]:
        return self._geometry.segment_sizes if self._geometry is not None else ()

    @property
    def _segments(self) -> int:
        """Objects per page (1 before a pool is registered)."""
        return len(self._segment_sizes) or 1

    @property
    def _page_bytes(self) -> int:
        return self._geometry.page_bytes if self._geometry is not None else 0

    @property
    def _zero_copy(self) -> bool:
        return self._geometry is not None and self._geometry.zero_copy

    def _whole_pages(self, per_segment: Sequence[bool]) -> list[bool]:
        """Per page: True when every one of its segments is."""
        segments = self._segments
        return [all(per_segment[i : i + segments]) for i in range(0, len(per_segment), segments)]

    def _stored_pages(self, error: BaseException, pages: int) -> list[bool]:
        """Which of ``pages`` pages a failed store stored whole, as far as ``error`` says."""
        segments = pages * self._segments
        return self._whole_pages(stored_keys(error, segments) or [False] * segments)

    @property
    def _what(self) -> str:
        return f"{_WHAT} on {self._target}"

    def _page_views(self, page_keys: Sequence[str], host_indices: torch.Tensor) -> list[MemoryObj]:
        """Each segment of each page as the host pool's own bytes (zero-copy layouts)."""
        pointers, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        expected = len(page_keys) * len(self._segment_sizes)
        if len(pointers) != expected:
            raise KvplugError(
                f"{len(page_keys)} page keys came with host indices of {len(pointers)} page "
                f"regions; expected {expected}."
            )
        assert self._geometry is not None
        views = [self._geometry.view(int(p), int(s)) for p, s in zip(pointers, sizes, strict=True)]
        if any(view is None for view in views):
            raise KvplugError(
                "SGLang's host pool described a page region outside its buffers; kvplug cannot "
                "address it."
            )
        return [_wrap(view) for view in views if view is not None]

    def _page_starts(self, count: int, host_indices: torch.Tensor) -> list[int]:
        assert self._geometry is not None
        tokens = self._geometry.page_tokens
        if host_indices.numel() != count * tokens:
            raise KvplugError(
                f"{count} page keys came with {host_indices.numel()} host indices; expected "
                f"{count * tokens} ({tokens} a page)."
            )
        return [int(host_indices[i * tokens]) for i in range(count)]

    def _bounce(self) -> MemoryObj:
        """A page-sized buffer of kvplug's own for a gathered page (``layer_first``): the
        backend's block-aligned memory where it has room, so O_DIRECT and cuFile move it
        without another copy; plain memory where it has none, or where the backend keeps put
        objects (its memory is then a cache's budget, never taken by a transfer)."""
        if not self._keeps_objects:
            buffer = self._client.backend.allocator.allocate(
                (self._page_bytes,), torch.uint8, MemoryFormat.BINARY_BUFFER
            )
            if buffer is not None:
                return buffer
        return _wrap(torch.empty(self._page_bytes, dtype=torch.uint8))

    @contextlib.contextmanager
    def _gathered(self, starts: Sequence[int], *, fill: bool) -> Iterator[list[MemoryObj]]:
        """Bounce buffers for the pages at ``starts``, filled with them when ``fill`` (on
        SGLang's thread, so kvplug's IO thread never reads the host pool here); released on
        exit, where a transfer still in flight keeps its own reference."""
        bounces: list[MemoryObj] = []
        try:
            for start in starts:
                bounces.append(self._bounce())
                if fill:
                    page = self.mem_pool_host.get_data_page(start, flat=False)
                    bounces[-1].raw.view(page.dtype).view(page.shape).copy_(page)
            yield bounces
        finally:
            for bounce in bounces:
                bounce.release()

    def _flat_page(self) -> torch.Tensor:
        """A new flat page of the host pool's dtype, in plain memory."""
        assert self._geometry is not None
        dtype = self._geometry.dtype
        return torch.empty(self._page_bytes // dtype.itemsize, dtype=dtype)

    def _split(self, page: torch.Tensor) -> list[MemoryObj]:
        """A flat page tensor as its segments (no copy)."""
        flat = page.reshape(-1).view(torch.uint8)
        if flat.numel() != self._page_bytes:
            raise KvplugError(
                f"a page of {flat.numel()} bytes was handed over; this host pool's pages are "
                f"{self._page_bytes} bytes."
            )
        return [_wrap(part) for part in torch.split(flat, list(self._segment_sizes))]

    def _record(self, kind: str, pages: int, started: float) -> None:
        if not self._metrics_on or pages == 0:
            return
        seconds = max(time.perf_counter() - started, 1e-9)
        with self._state:
            getattr(self._metrics, f"{kind}_pgs").append(pages)
            getattr(self._metrics, f"{kind}_bandwidth").append(
                pages * self._page_bytes / seconds / (1 << 30)
            )

    # -- moving pages (every API) --------------------------------------------------------------

    def _store(self, page_keys: list[str], store: Callable[[], None]) -> list[bool]:
        """Run ``store()`` for ``page_keys``; True for each page stored whole."""

        def run() -> list[bool]:
            store()
            return [True] * len(page_keys)

        return self._call(
            "failed_sets", lambda error: self._stored_pages(error, len(page_keys)), run
        )

    def _load(self, page_keys: list[str], load: Callable[[], list[bool]]) -> list[bool]:
        """Run ``load()`` for ``page_keys``; True for each page read whole (False for all
        after a failed call, which is counted as failed)."""
        return self._call("failed_gets", lambda _: [False] * len(page_keys), load)

    def _engine_store(self, page_keys: list[str], sources: list[MemoryObj]) -> None:
        """Store SGLang's memory (``sources``: each page's segments): returns or raises once
        kvplug holds no reference to it, a copy taken first where the backend is not lent it."""
        self._wait(self._io.store(self._keys(page_keys), sources))

    def _engine_load(self, page_keys: list[str], dests: list[MemoryObj]) -> list[bool]:
        """Read into SGLang's memory (``dests``: each page's segments), per page: returns or
        raises once nothing of kvplug can write into it any more."""
        return self._whole_pages(self._wait(self._io.load(self._keys(page_keys), dests)))

    def _store_gathered(self, page_keys: list[str], host_indices: torch.Tensor) -> None:
        """Store the pages at ``host_indices`` through bounce buffers. The gather is the
        snapshot, in kvplug's memory: it goes to the backend as it is, or, to a backend that
        keeps put objects, as a copy in the backend's own memory."""
        starts = self._page_starts(len(page_keys), host_indices)
        with self._gathered(starts, fill=True) as bounces:
            keys = self._keys(page_keys)
            if self._keeps_objects:
                self._wait(self._io.store(keys, bounces))
            else:
                put = self._client.backend.batched_put(keys, bounces)
                self._wait(self._within_deadline(put, "a store"))

    def _load_gathered(self, page_keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        """Read the pages at ``host_indices`` through bounce buffers, scattered into the host
        pool on SGLang's thread while the call is live, and only from buffers the backend has
        let go of; after a failure nothing is scattered."""
        starts = self._page_starts(len(page_keys), host_indices)
        with self._gathered(starts, fill=False) as bounces:
            read = self._client.backend.batched_get_into(self._keys(page_keys), bounces)
            found = self._wait(self._within_deadline(read, "a load"))
            pages = [
                hit and bounce.ref_count == 1
                for hit, bounce in zip(self._whole_pages(found), bounces, strict=True)
            ]
            assert self._geometry is not None
            dtype = self._geometry.dtype
            for start, bounce, page in zip(starts, bounces, pages, strict=True):
                if page:
                    self.mem_pool_host.set_from_flat_data_page(start, bounce.raw.view(dtype))
        return pages

    # -- the page API (interface_v1) ----------------------------------------------------------

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many leading pages of ``keys`` are stored whole (every segment)."""
        if not keys:
            return 0
        segments = self._segments

        async def count() -> int:
            present = await self._within_deadline(
                self._client.backend.batched_contains(self._keys(keys)), "a lookup"
            )
            return int(present) // segments

        return self._call("failed_exists", lambda _: 0, lambda: self._wait(count()))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Store the host pool's pages at ``host_indices`` under ``keys``; True for each page
        stored whole (every segment). On a rank that is not the storage writer (MLA replicas)
        the writer stores the same pages: nothing is written and every page reports True."""
        if not keys:
            return []
        if not self._writer:
            return [True] * len(keys)
        started = time.perf_counter()
        if self._zero_copy:
            stored = self._store(
                keys, lambda: self._engine_store(keys, self._page_views(keys, host_indices))
            )
        else:
            stored = self._store(keys, lambda: self._store_gathered(keys, host_indices))
        self._record("backup", sum(stored), started)
        return stored

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Read ``keys``' pages into the host pool at ``host_indices``; True for each page
        read whole. After False a page's host memory holds undefined bytes (SGLang frees it),
        and nothing of kvplug writes it any more."""
        if not keys:
            return []
        started = time.perf_counter()
        if self._zero_copy:
            loaded = self._load(
                keys, lambda: self._engine_load(keys, self._page_views(keys, host_indices))
            )
        else:
            loaded = self._load(keys, lambda: self._load_gathered(keys, host_indices))
        self._record("prefetch", sum(loaded), started)
        return loaded

    # -- the copying API (without interface_v1) -----------------------------------------------

    def set(
        self,
        key: str,
        value: Any | None = None,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """Store one flat page tensor (``HostKVCache.get_data_page(index, flat=True)``)."""
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any | None = None,
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """Store flat page tensors; True when every page is stored."""
        if not keys:
            return True
        if not self._writer:
            return True
        if values is None or len(values) != len(keys):
            self._calls.failed(
                "failed_sets", KvplugError(f"batch_set got {len(keys)} keys but no matching values")
            )
            return False
        pages = list(values)
        started = time.perf_counter()

        def store() -> None:
            sources = [part for page in pages for part in self._split(page.contiguous())]
            self._engine_store(keys, sources)

        stored = self._store(keys, store)
        self._record("backup", sum(stored), started)
        return all(stored)

    def get(
        self,
        key: str,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> torch.Tensor | None:
        """The stored page read into ``target_location`` (a flat page tensor; a new one when
        None), or None."""
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(
        self,
        keys: list[str],
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> list[torch.Tensor | None]:
        """Read pages into ``target_locations`` (flat page tensors, new ones when None);
        aligned with ``keys``: the filled tensor, or None for a page not read whole."""
        if not keys:
            return []
        if self.mem_pool_host is None:
            self._calls.failed("failed_gets", KvplugError("no host memory pool is registered yet"))
            return [None] * len(keys)
        targets = (
            list(target_locations)
            if target_locations is not None
            else [self._flat_page() for _ in keys]
        )
        if len(targets) != len(keys) or not all(t.is_contiguous() for t in targets):
            self._calls.failed(
                "failed_gets",
                KvplugError("batch_get needs one contiguous target tensor per key"),
            )
            return [None] * len(keys)
        started = time.perf_counter()

        def load() -> list[bool]:
            dests = [part for target in targets for part in self._split(target)]
            return self._engine_load(keys, dests)

        loaded = self._load(keys, load)
        self._record("prefetch", sum(loaded), started)
        return [target if hit else None for target, hit in zip(targets, loaded, strict=True)]

    # -- housekeeping ---------------------------------------------------------------------------

    def clear(self) -> None:
        """Remove this rank's pages (of this storage's tenant) from the store, where the backend
        can list its keys (``cpu://``, ``file://``, Redis and Valkey can); otherwise log that
        nothing was removed."""
        namespace = self._namespace
        backend = self._client.backend
        if namespace is None:
            return
        if not backend.capabilities.list_keys:
            logger.warning(
                "%s: %s cannot list its keys, so clear() removed nothing; its own eviction "
                "ages the pages out.",
                _WHAT,
                self._target,
            )
            return

        async def remove_mine() -> int:
            mine = [key async for key in backend.list_keys() if namespace.owns(key)]
            removed = await self._within_deadline(
                asyncio.gather(*(backend.remove(key) for key in mine)), "a clear"
            )
            return sum(removed)

        removed = self._call("failed_clears", lambda _: 0, lambda: self._wait(remove_mine()))
        logger.info("%s: removed %d objects of this rank from %s.", _WHAT, removed, self._target)

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` for the calls since the last ``get_stats`` (pages per
        call and GiB/s per call, as measured here), or None when SGLang runs without
        ``--enable-metrics`` (its ``enable_storage_metrics`` is then off)."""
        if not self._metrics_on:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._state:
            drained, self._metrics = self._metrics, _Metrics()
        return StorageMetrics(**asdict(drained))

    def health(self) -> StorageHealth:
        """A snapshot of this storage's health, with the store's counters."""
        return StorageHealth(
            **self._calls.snapshot(),
            objects_per_page=self._segments,
            counters=summarize(self._client.backend.operation_stats()),
        )

    def close(self) -> None:
        """Close the kvplug backend (SGLang calls this when it detaches the storage).
        Idempotent."""
        self._client.close()

    def __repr__(self) -> str:
        return f"KvplugHiCacheStorage({self._target})"


__all__ = ["DEFAULT_TASK_TIMEOUT", "KvplugHiCacheStorage", "StorageHealth"]
