"""kvplug as a vLLM offloading tier: ``KvplugTier``.

vLLM's ``OffloadingConnector`` with the ``TieringOffloadingSpec`` keeps offloaded KV in a CPU
primary tier and cascades every stored chunk to its secondary tiers; a chunk missing from the
primary tier is looked up in them and promoted back. ``KvplugTier`` makes any kvplug URL or
tiers config such a secondary tier::

    vllm serve Qwen/Qwen3-8B --kv-transfer-config '{"kv_connector": "OffloadingConnector",
        "kv_role": "kv_both", "kv_connector_extra_config": {
            "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8000000000,
            "secondary_tiers": [{"type": "kvplug", "url": "file:///var/cache/kv"}]}}'

``"type": "kvplug"`` is registered by kvplug-vllm's ``vllm.general_plugins`` entry point; without
it, ``{"type": "KvplugTier", "module_path": "kvplug_vllm.tier", ...}`` loads the same class.

Tier keys (besides vLLM's ``type``, ``module_path`` and ``backpressure``): ``url`` (any kvplug
URL) or ``config`` (a kvplug tiers YAML); optionally ``options`` (kvplug backend or Store
options), ``task_timeout`` (seconds one store or load job may take, default 60),
``lookup_timeout`` (seconds one batch of lookups may take, default 5), ``check_on_start`` (fail
at start when the store does not answer, default true), ``model_identity`` (what identifies the
weights; see :mod:`kvplug_vllm.keys`), ``on_reset`` (``"keep"``, the default, or ``"forget"``),
``max_queued_chunks`` (chunks of store jobs in flight before new ones are refused, default half
the primary tier), ``locality`` (``"LOCAL"`` or ``"REMOTE"``), ``enable_kv_events`` and
``tenant``.

Tenants: each request's chunks are looked up, loaded and stored under its tenant
(:func:`kvplug_vllm.keys.request_tenant`): the one its ``kv_transfer_params["kvplug_tenant"]``
names, else the tier's ``tenant``, else none. A request that names no valid tenant, or another
than the tier's ``tenant``, is served without the tier: its lookups miss and its jobs finish
failed, nothing of it reaching the store (counted in ``refused_requests``, the first logged as a
warning). vLLM keeps tenants apart in its own caches only by the request's ``cache_salt``, which
it folds into the block hashes; give each request both, with the same value.

How it moves data: a job's chunks are rows of the primary tier's shared memory (``view[c]``,
whatever the view's item type: a row is its bytes, as for vLLM's own tiers), one batched kvplug
call per job, on kvplug's IO thread, through
:class:`kvplug.runtime.engine.EngineIO`. A backend that declares ``releases_on_cancel`` (it lets go
of a caller's memory as soon as a cancelled operation returns: ``file://``, ``redis://``) is
lent the rows themselves, with no copy; one that keeps what it is given (``cpu://``, a Store of
several tiers, also behind a wrapper such as ``audit::``) stores a private copy taken when the
job starts, and one that does not declare it reads into kvplug's own memory, copied into the
rows only while the job is live. Lookups are batched once per scheduler step on a background
thread (vLLM's ``AsyncLookupManager``): a key answers RETRY until its batch is back.

The engine boundary: vLLM reuses a job's rows as soon as the job is reported finished, also when
it is reported failed. A job is reported only once kvplug no longer reads or writes its rows,
and a job past ``task_timeout`` is cancelled and reported failed then: a late read never lands
in a row vLLM reused, and a store never persists what vLLM wrote into the row after the report
(a key holds the row as it was when the store started, or nothing). A load reports the chunks it
read whole (``successful_keys``). :meth:`KvplugTier.drain_jobs` and :meth:`KvplugTier.shutdown`
wait at most ``task_timeout`` plus :data:`UNWIND_SECONDS` for the jobs in flight, and never for
lookups; should a backend break its contract and keep rows after the deadline, they raise
instead of returning, so that vLLM neither reuses nor unmaps memory kvplug may still touch.

Failures never reach vLLM's scheduler as exceptions: a store that is down, slow or full makes
lookups answer MISS and jobs finish failed, the first failure is logged, and later calls try
again.

Cache resets (``reset_prefix_cache(reset_connector=True)``, also made by vLLM's sleep and
``pause_generation(clear_cache=True)``) call :meth:`KvplugTier.drain_jobs`. As vLLM's own
secondary tiers do, the tier keeps what it stored (``on_reset="keep"``, the default): the key
names the weights the engine started with. Weights updated in place (RL weight syncs) are not
told to the tier, only a reset is: ``on_reset="forget"`` then moves it to a new key epoch at
each reset, so nothing stored before is served after.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import queue
import secrets
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import (
    JobId,
    JobResult,
    SecondaryTierManager,
    TransferJob,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvplug.errors import KvplugError
from kvplug.keys import CacheKey, InvalidKey
from kvplug.memory import MemoryFormat, MemoryObj
from kvplug.runtime.engine import (
    CallHealth,
    EngineIO,
    QuickSwitches,
    open_client,
    probe,
    tiers_of,
    within_deadline,
)
from kvplug.runtime.sync import SyncClient
from kvplug.secrets import mask_text, mask_url
from kvplug.stats import CounterSummary, summarize
from kvplug_vllm.keys import ChunkNamespace, key_dtype, model_identity, request_tenant
from kvplug_vllm.settings import (
    _WHAT,
    DEFAULT_LOOKUP_TIMEOUT,
    DEFAULT_TASK_TIMEOUT,
    TierSettings,
    backend_url_and_options,
)

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

logger = logging.getLogger("kvplug.vllm")

UNWIND_SECONDS = 5.0
"""Seconds past ``task_timeout`` that :meth:`KvplugTier.drain_jobs` and
:meth:`KvplugTier.shutdown` wait for a job to finish: a job ends at its deadline, once the
operation it cancelled has let go of the primary tier's memory, which takes far less."""
CLOSE_SECONDS = 5.0
"""Seconds :meth:`KvplugTier.shutdown` gives kvplug to close the store once no job is left."""
_FAILURES = ("failed_stores", "failed_loads", "failed_lookups")


@dataclass(frozen=True)
class KvplugTierHealth:
    """What :meth:`KvplugTier.health` reports: the tier's own health and job counts, and the
    store's counters."""

    healthy: bool
    """False once a call found the store unreachable or late, until one succeeds."""
    last_error: str | None
    failed_stores: int
    failed_loads: int
    failed_lookups: int
    refused_stores: int
    """Store jobs refused because ``max_queued_chunks`` were in flight (back-pressure)."""
    chunks_skipped: int
    """Chunks of store jobs that the store already held (not stored again)."""
    refused_requests: int
    """Requests served without the tier because their ``kv_transfer_params`` named no valid
    tenant, or another than the tier's ``tenant``: nothing of them was looked up, loaded or
    stored."""
    jobs_in_flight: int
    counters: CounterSummary
    """What the store did for this tier, one chunk a kvplug key, counted by kvplug's backend
    template (:func:`kvplug.stats.summarize` of its ``operation_stats()``, the numbers
    ``kvplug check`` and a Store's per-tier series read): ``writes`` (chunks stored) and
    ``bytes_written``; ``reads``, ``hits`` (chunks loaded), ``misses`` (chunks a load did not
    find), ``hit_rate`` and ``bytes_read``; ``lookups`` and ``lookup_hits`` (keys asked by
    vLLM's lookups, by each store job for the chunks it skips, and by the probe at start);
    ``calls``, ``errors`` and ``seconds``. A load whose kvplug call raised or passed
    ``task_timeout`` is one error there and one of ``failed_loads`` here, not a miss per
    chunk; a store that raised counts the chunks the store says it kept, if any."""


def byte_rows(primary_kv_view: memoryview) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """The primary tier's memory as (chunks, row bytes) of uint8, sharing its memory: chunk
    ``c`` is ``view[c]`` and its bytes, whatever the view's item type, as vLLM's own tiers read
    it (a row is ``strides[0]`` bytes). Raises :class:`KvplugError` naming the shape and strides
    when the view is not C-contiguous with at least two dimensions, or is read-only.

    Example::

        >>> rows = byte_rows(memoryview(np.zeros((4, 8), dtype=np.float32)))
        >>> rows.shape, rows.dtype
        ((4, 32), dtype('uint8'))
    """
    rows = np.asarray(primary_kv_view)
    if rows.ndim < 2 or not rows.flags.c_contiguous or not rows.flags.writeable:
        wrong = (
            f"{rows.ndim} dimension(s), where chunks are the first of at least two"
            if rows.ndim < 2
            else "not C-contiguous: a chunk's bytes are not one run"
            if not rows.flags.c_contiguous
            else "read-only: loads write into it"
        )
        raise KvplugError(
            f"{_WHAT}: the primary tier's memory view is {wrong} (shape {rows.shape}, strides "
            f"{rows.strides}, item size {rows.itemsize}); kvplug needs a writable C-contiguous "
            "(chunks, row) view, which is what vLLM's primary tier gives "
            "(TieringOffloadingManager.primary_tier.get_kv_memoryview())."
        )
    row_bytes = rows.itemsize * math.prod(rows.shape[1:])
    return rows.reshape(-1).view(np.uint8).reshape(rows.shape[0], row_bytes)


def _namespace(spec: OffloadingSpec, row_bytes: int, identity: str | None) -> ChunkNamespace:
    """The key namespace of ``spec``'s primary-tier rows (see :mod:`kvplug_vllm.keys`)."""
    config = spec.config
    parallel = config.parallel
    agnostic = bool(parallel.is_parallelism_agnostic or config.replicated_layout)
    layout: dict[str, Any] = {
        "engine": "vllm",
        "row_bytes": row_bytes,
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "kv_dtype": config.model.dtype,
        "groups": [[group.tokens_per_block, list(group.layer_names)] for group in config.groups],
        "replicated": bool(config.replicated_layout),
        "canonical": config.kv_cache_layout if config.canonical_layout else None,
    }
    if not agnostic:
        layout["parallel"] = [
            parallel.world_size,
            parallel.tp_size,
            parallel.pp_size,
            parallel.pcp_size,
            parallel.dcp_size,
        ]
    return ChunkNamespace(
        model_name=config.model.name,
        world_size=1 if agnostic else parallel.world_size,
        dtype=key_dtype(config.model.dtype),
        layout=layout,
        identity=identity,
    )


@dataclass(frozen=True)
class _RequestTenant:
    """A request's tenant, resolved once and kept in its ``ReqContext``: ``name`` (``""`` for
    none), or why the request is refused."""

    name: str
    refusal: str | None = None


class _Lookups(AsyncLookupManager):  # type: ignore[misc]  # vllm is untyped
    """vLLM's per-step batched lookups, answered by the tier's store. Once shut down, the
    lookup in flight is abandoned and the batches still queued answer MISS at once, so that a
    cache reset or a shutdown never waits for a slow store's lookups."""

    def __init__(self, tier: KvplugTier) -> None:
        self._tier = tier
        self._guard = threading.Lock()
        self._stopped = False
        self._asking: concurrent.futures.Future[list[bool]] | None = None
        super().__init__(tier_type=tier.tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._tier._present(keys, req_context, self)

    def asking(self, future: concurrent.futures.Future[list[bool]] | None) -> bool:
        """Note the lookup in flight (None: it is over); False once shut down (then
        ``future`` is cancelled)."""
        with self._guard:
            self._asking = None if self._stopped else future
            stopped = self._stopped
        if stopped and future is not None:
            future.cancel()
        return not stopped

    def shutdown(self) -> None:
        with self._guard:
            self._stopped, asking = True, self._asking
        if asking is not None:
            asking.cancel()
        super().shutdown()


class KvplugTier(SecondaryTierManager):  # type: ignore[misc]  # vllm is untyped
    """Any kvplug backend or tiers config as a vLLM secondary offloading tier (see the module
    documentation for the keys). vLLM's ``SecondaryTierFactory`` builds it from a
    ``secondary_tiers`` entry; every method runs on vLLM's scheduler side and returns at once,
    the transfers run on kvplug's IO thread.

    Example (what vLLM's tiering manager does with it)::

        tier = KvplugTier(spec, primary_kv_view, "kvplug", url="file:///var/cache/kv")
        tier.submit_store(TransferJob(1, keys, chunk_ids, False, req_context))
        tier.lookup(keys[0], req_context)      # RETRY until this step's batch is answered
        tier.on_schedule_end(context)           # sends the step's lookups
        ...
        tier.get_finished_jobs()                # [JobResult(job_id=1, success=True, ...)]
    """

    medium = Medium.STORAGE
    _target = "not set up"
    """What the tier opens, safe to print; this default is what a tier whose ``__init__``
    failed before naming its store shows (``repr`` works on a half-built tier)."""

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        **settings: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        parsed = TierSettings.parse(settings)
        self._settings = parsed
        self.locality = parsed.locality
        rows = byte_rows(primary_kv_view)
        self._rows = torch.from_numpy(rows)
        self._row_views: dict[int, MemoryObj] = {}
        self._quick = QuickSwitches(parsed.gil_switch_interval)
        self._row_bytes = int(rows.shape[1])
        self._target = mask_url(parsed.url) if parsed.url else f"the tiers in {parsed.config}"
        self._calls = CallHealth(self._what, _FAILURES, logger)
        identity = parsed.model_identity or model_identity(offloading_spec.config.model.name)
        if identity is None:
            logger.warning(
                "%s: nothing identifies the weights of %r but its name (not a local directory, "
                "not in the Hugging Face cache), so KV stored for other weights under this name "
                "would be served. Set model_identity in the tier config (a checkpoint digest or "
                "revision) when the weights can change.",
                self._what,
                offloading_spec.config.model.name,
            )
        self._base_namespace = _namespace(offloading_spec, self._row_bytes, identity)
        self._namespace = self._base_namespace
        num_chunks = int(rows.shape[0])
        self._max_queued = parsed.max_queued_chunks or max(1, num_chunks // 2)
        self._events: list[OffloadingEvent] | None = None
        if parsed.enable_kv_events:
            if offloading_spec.kv_events_config.enable_kv_cache_events:
                self._events = []
            else:
                logger.warning(
                    "%s: enable_kv_events is set but vLLM's KV cache events are off "
                    "(--kv-events-config); no events are published.",
                    self._what,
                )
        self._state = threading.Lock()
        self._job_done = threading.Condition(self._state)
        """Notified under :attr:`_state` each time a job leaves :attr:`_in_flight`: its result
        is queued by then (a future's waiters are woken before its done-callbacks run, so
        waiting on the futures could return before the result is queued)."""
        self._finished: queue.SimpleQueue[tuple[JobResult, list[OffloadKey] | None]] = (
            queue.SimpleQueue()
        )
        self._in_flight: dict[JobId, concurrent.futures.Future[Any]] = {}
        self._load_keys: dict[JobId, list[OffloadKey]] = {}
        self._queued_chunks = 0
        self._refusing = False
        self._counts = dict.fromkeys(("refused_stores", "chunks_skipped", "refused_requests"), 0)
        self._client: SyncClient = open_client(
            url=parsed.url, config=parsed.config, options=parsed.options, what=_WHAT
        )
        try:
            self._io = EngineIO(self._client.backend, timeout=parsed.task_timeout, what=self._what)
            if all(tier.url.scheme == "cpu" for tier in tiers_of(self._client.backend)):
                self.medium = Medium.CPU
                self.cache_hit_source = CacheHitSource.HOST
            if parsed.check_on_start:
                self._check_reachable()
        except BaseException:
            self._client.close()
            raise
        self._lookups = _Lookups(self)
        logger.info(
            "%s: rows of %d bytes, keys %s@...@vllm%%%s, %s, up to %d chunks of stores in flight.",
            self._what,
            self._row_bytes,
            self._namespace.model_name,
            self._namespace.digest,
            f"tenant {parsed.tenant!r}" if parsed.tenant else "each request's tenant",
            self._max_queued,
        )

    # -- set-up and plumbing --------------------------------------------------------------------

    @property
    def _what(self) -> str:
        return f"{_WHAT} on {self._target}"

    def _check_reachable(self) -> None:
        try:
            probe(self._client, self._settings.lookup_timeout)
        except Exception as error:
            raise KvplugError(
                f"{_WHAT}: {self._target} did not answer at start "
                f"({mask_text(str(error)) or type(error).__name__}). Start the store, fix the "
                "tier's url or config, or set check_on_start to false to start anyway (chunks "
                "then miss until the store answers)."
            ) from None

    def _keys(self, keys: Iterable[OffloadKey], tenant: str) -> list[CacheKey]:
        return self._namespace.keys_of((bytes(key) for key in keys), tenant)

    def _tenant(self, req_context: ReqContext) -> _RequestTenant:
        """The tenant of the request of ``req_context``, resolved on its first call (vLLM's
        ``on_new_request``) and kept in it; a refusal is counted and logged then."""
        known: _RequestTenant | None = req_context.get_state(_RequestTenant)
        if known is not None:
            return known
        try:
            tenant = _RequestTenant(
                request_tenant(req_context.kv_transfer_params, self._settings.tenant)
            )
        except InvalidKey as error:
            tenant = _RequestTenant("", refusal=str(error))
            with self._state:
                self._counts["refused_requests"] += 1
                first = self._counts["refused_requests"] == 1
            (logger.warning if first else logger.debug)(
                "%s: request %s is served without this tier: %s (further refusals are logged "
                "at DEBUG; health().refused_requests counts them)",
                self._what,
                req_context.req_id,
                error,
            )
        req_context.set_state(tenant)
        return tenant

    def _refuse(self, job: TransferJob) -> None:
        """Finish ``job``, of a refused request, failed at once: nothing of it reaches the
        store, and a load's chunks answer MISS from then on."""
        if job.is_promotion:
            with self._state:
                self._load_keys[job.job_id] = list(job.keys)
        self._finished.put((JobResult(job_id=job.job_id, success=False), None))

    def _views(self, chunk_ids: Sequence[int]) -> list[MemoryObj]:
        """The primary rows of ``chunk_ids`` (on the IO thread), each made once and kept: every
        torch call lets go of the GIL, and getting it back waits up to the interpreter's switch
        interval (5 ms) while the engine's scheduler thread runs Python, so three calls per
        chunk and job cost a 2,000-token prefix about 0.3 s of time to first token. Each holds
        one reference, the tier's, which jobs use as theirs (vLLM never moves one chunk in two
        jobs at once)."""
        views = self._row_views
        for chunk in chunk_ids:
            if chunk not in views:
                views[chunk] = MemoryObj.from_tensor(
                    self._rows[int(chunk)], MemoryFormat.BINARY_BUFFER
                )
        return [views[chunk] for chunk in chunk_ids]

    def _submit(self, job: TransferJob, work: Any, chunks: int) -> None:
        """Run coroutine ``work`` (which returns the job's JobResult) on kvplug's IO thread and
        queue its result for :meth:`get_finished_jobs`."""
        job_id = job.job_id
        counter = "failed_loads" if job.is_promotion else "failed_stores"
        try:
            future = self._client.run(work)
        except Exception as error:
            work.close()
            self._calls.failed(counter, error)
            self._finish(JobResult(job_id=job_id, success=False), chunks, job)
            return
        with self._state:
            self._in_flight[job_id] = future

        def done(finished: concurrent.futures.Future[Any]) -> None:
            if finished.cancelled() or finished.exception() is not None:
                error = finished.exception() if not finished.cancelled() else None
                self._calls.failed(counter, error or KvplugError("the job was cancelled"))
                result = JobResult(job_id=job_id, success=False)
            else:
                result = finished.result()
            self._finish(result, chunks, job)

        future.add_done_callback(done)

    def _finish(self, result: JobResult, chunks: int, job: TransferJob) -> None:
        """Queue the job's result for :meth:`get_finished_jobs`, then, in the same critical
        section, take it out of the jobs in flight: whoever sees it gone finds its result."""
        publish = self._events is not None and not job.is_promotion
        with self._state:
            self._finished.put((result, list(job.keys) if publish else None))
            self._in_flight.pop(job.job_id, None)
            if not job.is_promotion:
                self._queued_chunks -= chunks
            self._job_done.notify_all()
        if job.is_promotion:
            self._quick.release()

    # -- lookups --------------------------------------------------------------------------------

    async def _lookup(self, keys: Sequence[CacheKey]) -> list[bool]:
        """Whether each of ``keys`` is stored (vLLM asks per key), in one batched call, within
        ``lookup_timeout``."""
        return await within_deadline(
            self._client.backend.batched_exists(list(keys)),
            self._settings.lookup_timeout,
            f"a lookup on {self._target}",
        )

    def _present(
        self, keys: Sequence[OffloadKey], req_context: ReqContext, lookups: _Lookups
    ) -> list[bool]:
        """Whether each key is stored for the request's tenant (runs on the lookup thread of
        ``lookups``; MISS on any failure, for a refused request, and at once after ``lookups``
        is shut down)."""
        tenant = self._tenant(req_context)
        if not keys or tenant.refusal is not None:
            return [False] * len(keys)
        self._quick.hold()
        try:
            return self._ask(keys, tenant.name, lookups)
        finally:
            self._quick.release()

    def _ask(self, keys: Sequence[OffloadKey], tenant: str, lookups: _Lookups) -> list[bool]:
        try:
            asking = self._client.run(self._lookup(self._keys(keys, tenant)))
        except Exception as error:
            self._calls.failed("failed_lookups", error)
            return [False] * len(keys)
        if not lookups.asking(asking):
            return [False] * len(keys)
        try:
            answer = asking.result(self._settings.lookup_timeout + 1)
        except concurrent.futures.CancelledError:  # shut down meanwhile
            return [False] * len(keys)
        except Exception as error:
            asking.cancel()
            self._calls.failed("failed_lookups", error)
            return [False] * len(keys)
        finally:
            lookups.asking(None)
        self._calls.succeeded()
        return answer

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT or MISS once this key's lookup batch is answered, RETRY until then."""
        present = self._lookups.lookup(key, req_context)
        if present is None:
            return LookupResult.RETRY
        return LookupResult.HIT if present else LookupResult.MISS

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """Resolve the request's tenant (see the module documentation)."""
        self._tenant(req_context)
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """Send this step's lookups as one batch."""
        self._lookups.flush()

    # -- transfers ------------------------------------------------------------------------------

    def submit_store(self, job_metadata: TransferJob) -> None:
        """Store the job's primary rows under its keys (those not stored yet), one batched
        kvplug put. Refused at once, as a failed job, while ``max_queued_chunks`` chunks of
        earlier stores are in flight: vLLM's back-pressure detector sees the failures."""
        job = job_metadata
        tenant = self._tenant(job.req_context)
        if tenant.refusal is not None:
            self._refuse(job)
            return
        chunks = len(job.keys)
        with self._state:
            refuse = self._queued_chunks + chunks > self._max_queued and self._queued_chunks > 0
            if not refuse:
                self._queued_chunks += chunks
        if refuse:
            self._refused(chunks)
            self._finished.put((JobResult(job_id=job.job_id, success=False), None))
            return
        if self._refusing:
            self._refusing = False
            logger.info("%s: stores are accepted again.", self._what)
        self._submit(job, self._store(job, tenant.name), chunks)

    def _refused(self, chunks: int) -> None:
        """Count a refused store job; the first of a stretch is logged as a warning."""
        with self._state:
            self._counts["refused_stores"] += 1
            first, self._refusing = not self._refusing, True
        (logger.warning if first else logger.debug)(
            "%s: %d chunks of stores are in flight, so a store of %d more is refused (vLLM "
            "counts it as a failed cascade). Raise max_queued_chunks, or give the tier a "
            "backpressure config so vLLM stops offering stores while the store is slow.",
            self._what,
            self._max_queued,
            chunks,
        )

    async def _store(self, job: TransferJob, tenant: str) -> JobResult:
        started = time.perf_counter()
        try:
            stored = await within_deadline(
                self._store_missing(list(job.keys), list(job.chunk_ids), tenant),
                self._settings.task_timeout,
                f"a store on {self._target}",
            )
        except Exception as error:
            self._calls.failed("failed_stores", error)
            return JobResult(job_id=job.job_id, success=False)
        self._calls.succeeded()
        with self._state:
            self._counts["chunks_skipped"] += len(job.keys) - stored
        return JobResult(
            job_id=job.job_id,
            success=True,
            transfer_time=time.perf_counter() - started,
            transfer_bytes=stored * self._row_bytes,
        )

    async def _store_missing(
        self, keys: list[OffloadKey], chunk_ids: list[int], tenant: str
    ) -> int:
        """Store the rows of ``keys`` that the store does not hold yet for ``tenant``; how many
        it stored."""
        cache_keys = self._keys(keys, tenant)
        present = await self._client.backend.batched_exists(cache_keys)
        wanted = [index for index, hit in enumerate(present) if not hit]
        views = self._views([chunk_ids[index] for index in wanted])
        await self._io.store([cache_keys[index] for index in wanted], views)
        return len(wanted)

    def submit_load(self, job_metadata: TransferJob) -> None:
        """Read the job's keys into its primary rows, one batched kvplug read; the result names
        the chunks read whole."""
        job = job_metadata
        tenant = self._tenant(job.req_context)
        if tenant.refusal is not None:
            self._refuse(job)
            return
        keys = list(job.keys)
        with self._state:
            self._load_keys[job.job_id] = keys
        self._quick.hold()  # released in _finish
        self._submit(job, self._load(job, keys, tenant.name), len(keys))

    async def _load(self, job: TransferJob, keys: list[OffloadKey], tenant: str) -> JobResult:
        started = time.perf_counter()
        views = self._views(job.chunk_ids)
        try:
            found = await self._io.load(self._keys(keys, tenant), views)
        except Exception as error:
            self._calls.failed("failed_loads", error)
            return JobResult(job_id=job.job_id, success=False)
        self._calls.succeeded()
        loaded = [key for key, hit in zip(keys, found, strict=True) if hit]
        whole = len(loaded) == len(keys)
        return JobResult(
            job_id=job.job_id,
            success=whole,
            successful_keys=None if whole or not loaded else tuple(loaded),
            transfer_time=time.perf_counter() - started,
            transfer_bytes=len(loaded) * self._row_bytes,
        )

    def get_finished_jobs(self) -> Iterable[JobResult]:
        """The jobs finished since the last call. A load that missed some chunks marks them
        MISS for later lookups, so vLLM recomputes them instead of promoting them again."""
        results = []
        while True:
            try:
                result, stored_keys = self._finished.get_nowait()
            except queue.Empty:
                break
            with self._state:
                load_keys = self._load_keys.pop(result.job_id, None)
            if load_keys is not None and not result.success:
                kept = set(result.successful_keys or ())
                self._lookups.mark_miss([key for key in load_keys if key not in kept])
            if self._events is not None and stored_keys and result.success:
                self._events.append(
                    OffloadingEvent(
                        keys=stored_keys, medium=self.medium, removed=False, locality=self.locality
                    )
                )
            results.append(result)
        return results

    def has_pending_work(self) -> bool:
        """True while a job is in flight or a finished one is not yet taken by
        :meth:`get_finished_jobs`: vLLM keeps stepping (and polling) until both are done."""
        with self._state:
            return bool(self._in_flight) or not self._finished.empty()

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._events:
            events, self._events = self._events, []
            yield from events

    def _wait_for_jobs(self, during: str, consequence: str) -> None:
        """Wait until every job in flight has finished, up to :data:`UNWIND_SECONDS` past
        ``task_timeout``; then raise :class:`KvplugError` naming ``during`` (what waits) and
        ``consequence`` if one still holds rows of the primary tier."""
        timeout = self._settings.task_timeout
        with self._state:
            waited_for = set(self._in_flight)
            self._job_done.wait_for(
                lambda: not waited_for & self._in_flight.keys(), timeout + UNWIND_SECONDS
            )
            going = waited_for & self._in_flight.keys()
        if going:
            raise KvplugError(
                f"{self._what}: {len(going)} job(s) still use rows of vLLM's primary tier "
                f"{timeout + UNWIND_SECONDS:g} s into {during}, though each was cancelled at its "
                f"task_timeout of {timeout:g} s: the backend did not let go of the memory of a "
                f"cancelled operation. {consequence} Report this to the backend's maintainers "
                "(kvplug's contract suite checks that a cancelled operation lets go)."
            )

    def drain_jobs(self) -> None:
        """Block until every submitted job has finished, its result queued for
        :meth:`get_finished_jobs` (vLLM's ``reset_cache`` asserts that right after), and kvplug
        holds none of the primary tier's memory: at most ``task_timeout`` plus
        :data:`UNWIND_SECONDS`, since each job ends at its deadline. vLLM calls this on a cache
        reset. What the tier stored stays served (``on_reset="keep"``, the default, as vLLM's
        own tiers do); with ``on_reset="forget"`` the tier then starts a new key epoch, so
        nothing stored before is served again. Raises :class:`KvplugError` if a job still holds
        rows then (a backend that breaks its contract), so that vLLM does not reuse them."""
        self._wait_for_jobs(
            "a cache reset",
            "The reset stops here, so that vLLM does not reuse rows kvplug may still touch.",
        )
        if self._settings.on_reset == "forget":
            self._namespace = dataclasses.replace(self._base_namespace, epoch=secrets.token_hex(8))
            previous, self._lookups = self._lookups, _Lookups(self)
            previous.shutdown()
            logger.info(
                "%s: cache reset; chunks stored before it are no longer served (on_reset=forget).",
                self._what,
            )

    # -- reporting and shutdown -----------------------------------------------------------------

    def health(self) -> KvplugTierHealth:
        """A snapshot of this tier's health and job counts, with the store's counters."""
        with self._state:
            counts: dict[str, Any] = dict(self._counts)
            in_flight = len(self._in_flight)
        return KvplugTierHealth(
            **self._calls.snapshot(),
            **counts,
            jobs_in_flight=in_flight,
            counters=summarize(self._client.backend.operation_stats()),
        )

    def shutdown(self) -> None:
        """Stop the lookup thread, wait for the jobs in flight (each ends at its deadline,
        after which kvplug no longer touches the primary tier's memory, which vLLM unmaps next)
        and close kvplug: within ``task_timeout`` plus :data:`UNWIND_SECONDS` and
        :data:`CLOSE_SECONDS`. Raises :class:`KvplugError` if a job still holds rows then (a
        backend that breaks its contract): vLLM then keeps the primary tier mapped. Idempotent.
        """
        self._lookups.shutdown()
        self._wait_for_jobs(
            "shutdown", "vLLM keeps the primary tier mapped, since kvplug may still touch it."
        )
        try:
            self._client.close(CLOSE_SECONDS)
        except Exception as error:  # no job is left: nothing touches the primary tier
            logger.warning(
                "%s: closing kvplug at shutdown failed (%s); no job uses vLLM's memory, so "
                "vLLM shuts down anyway.",
                self._what,
                mask_text(f"{type(error).__name__}: {error}"),
            )
        # vLLM unmaps the primary tier next, which it can only do once no view of it is left.
        self._row_views.clear()
        self._rows = torch.empty(0, 0, dtype=torch.uint8)

    def __repr__(self) -> str:
        return f"KvplugTier({self._target})"


__all__ = [
    "CLOSE_SECONDS",
    "DEFAULT_LOOKUP_TIMEOUT",
    "DEFAULT_TASK_TIMEOUT",
    "UNWIND_SECONDS",
    "KvplugTier",
    "KvplugTierHealth",
    "backend_url_and_options",
]
