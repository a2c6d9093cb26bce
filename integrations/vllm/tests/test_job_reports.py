"""Every job kvplug waited for is reported by the next ``get_finished_jobs``: vLLM's
``reset_cache`` calls ``drain_jobs``, polls once and asserts that no job is left, and vLLM stops
polling a tier once its ``has_pending_work`` is false.

A job's future is done before its done-callback queues the result (``concurrent.futures`` wakes
its waiters first), so a wait on the futures can return in between: vLLM's own tier tests, run
against kvplug, met it in 78 to 473 of 2,000 rounds of "store, drain, poll"; on a machine whose
cores are busy it is rare. The :func:`preempted` fixture makes that window last: kvplug's IO
thread pauses there on every job, as a thread the OS preempts would, so that the tests below
meet it in every round instead of by chance."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from vllm.v1.kv_offload.base import ReqContext
from vllm.v1.kv_offload.tiering.base import TransferJob

from kvplug_vllm import KvplugTier
from kvplug_vllm.testing import ROW_BYTES, Engine, chunk_keys, payloads

Start = Callable[..., Engine]

PAUSE = 0.02
"""Seconds kvplug's IO thread pauses between a job's end and the queuing of its result."""
ROUNDS = 40


@pytest.fixture
def preempted(monkeypatch: pytest.MonkeyPatch) -> None:
    """kvplug's IO thread pauses :data:`PAUSE` seconds before it queues each job's result."""
    finish = KvplugTier._finish

    def late(self: KvplugTier, *args: Any) -> None:
        if threading.current_thread() is not threading.main_thread():
            time.sleep(PAUSE)
        finish(self, *args)

    monkeypatch.setattr(KvplugTier, "_finish", late)


@pytest.mark.usefixtures("preempted")
@pytest.mark.parametrize("url", ["cpu://?max_size=16MiB", "file"])
def test_vllms_cache_reset_finds_every_store_job_reported_round_after_round(
    start: Start, tmp_path: Path, url: str
) -> None:
    engine = start({"url": f"file://{tmp_path}/kv" if url == "file" else url}, chunks=4)
    row = payloads(1, ROW_BYTES)[0]
    for done, key in enumerate(chunk_keys(ROUNDS)):
        engine.offload([key], [row])  # complete_store submits the cascade to kvplug at once
        try:
            engine.reset()  # drain_jobs, one poll, then `assert not self._jobs`
        except AssertionError as error:
            pytest.fail(f"round {done}: vLLM's reset_cache found a job unreported: {error!r}")
    assert engine.tier.health().counters.writes == ROUNDS


@pytest.mark.usefixtures("preempted")
def test_a_drained_job_is_pending_work_until_polled_then_reported(start: Start) -> None:
    engine = start({"url": "cpu://?max_size=16MiB", "max_queued_chunks": 16}, chunks=16)
    tier = engine.tier
    context = ReqContext(req_id="direct")
    for job_id, key in enumerate(chunk_keys(ROUNDS)):
        tier.submit_store(TransferJob(job_id, [key], [job_id % 16], False, context))
        tier.drain_jobs()
        assert tier.has_pending_work(), f"round {job_id}: a result not polled yet is pending work"
        assert [result.job_id for result in tier.get_finished_jobs()] == [job_id]
        assert not tier.has_pending_work()
