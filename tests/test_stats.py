"""The one set of counters: OperationCounters, the latency histogram and summarize."""

from __future__ import annotations

import threading
import time

from kvplug.stats import LATENCY_BUCKETS, OperationCounters, OperationStats, summarize


def test_counts_from_many_threads_at_once_lose_nothing() -> None:
    counters = OperationCounters()
    threads, each = 8, 2000
    start = threading.Barrier(threads)

    def work() -> None:
        start.wait()
        for n in range(each):
            counters.count("get", None, hits=n % 2, misses=1 - n % 2, nbytes=10 * (n % 2))

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    stats = counters.snapshot()["get"]
    total = threads * each
    assert (stats.calls, stats.keys, stats.hits, stats.misses) == (
        total,
        total,
        total / 2,
        total / 2,
    )
    assert stats.bytes == 10 * total / 2 and sum(stats.latency_counts) == total


def test_a_call_lands_in_the_first_bucket_whose_bound_it_does_not_exceed() -> None:
    counters = OperationCounters()
    counters.count("put", time.perf_counter() - 0.002, keys=1)  # 2 ms: the 5 ms bucket
    counters.count("put", time.perf_counter() - 60.0, keys=1)  # over every bound: +Inf
    counts = counters.snapshot()["put"].latency_counts
    assert counts[LATENCY_BUCKETS.index(5e-3)] == 1 and counts[-1] == 1 and sum(counts) == 2


def test_a_failed_call_counts_an_error_and_no_keys() -> None:
    counters = OperationCounters()
    counters.count("batched_get", None, errors=1)
    stats = counters.snapshot()["batched_get"]
    assert (stats.calls, stats.errors, stats.keys) == (1, 1, 0)


def test_summary_separates_reads_lookups_and_writes() -> None:
    summary = summarize(
        {
            "get": OperationStats(calls=2, keys=2, hits=1, misses=1, bytes=100),
            "batched_get_into": OperationStats(calls=1, keys=3, hits=3, bytes=300),
            "batched_exists": OperationStats(calls=1, keys=4, hits=2, misses=2),
            "put": OperationStats(calls=3, errors=1, keys=2, bytes=200),
            "remove": OperationStats(calls=1),
        }
    )
    assert (summary.reads, summary.hits, summary.misses, summary.bytes_read) == (5, 4, 1, 400)
    assert (summary.lookups, summary.lookup_hits) == (4, 2)
    assert (summary.writes, summary.bytes_written, summary.errors, summary.calls) == (2, 200, 1, 8)
    assert summary.hit_rate == 0.8 and summarize({}).hit_rate is None
    assert summary.as_dict()["hit_rate"] == 0.8
