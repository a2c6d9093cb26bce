"""LMCache's MP StorageManager through kvplug against LMCache's own L2 adapters, in one run.

LMCache's own ``StorageManager`` (the one ``lmcache server`` runs) stores chunks from L1 into L2
and prefetches them back, through ``KvplugL2Adapter`` and through LMCache's built-in adapter
for the same medium, alternating (one manager at a time, each warmed up by a pass that is not
counted), with fresh keys each pass:

- file, buffered: ``file:///dir?o_direct=false`` against LMCache's ``fs`` adapter on the same
  directory (its default, page-cache I/O);
- file, O_DIRECT: ``file:///dir`` (kvplug's default) against ``fs`` with ``use_odirect``;
- redis: ``redis://`` against LMCache's ``resp`` adapter (its native client), on one real
  ``redis-server``.

A pass writes ``--chunks`` chunks of ``[2, 32, 256, 1024]`` fp16 (32 MiB) into L1 and times
until the store controller has put all of them into L2; then drops them from L1 and times a
prefetch of all of them back from L2, checking every byte. The ratio is LMCache's time /
kvplug's time per pass; its median is the result (target >= 1.0).

    .venv-lmcache-0.5.7rc2/bin/python benchmarks/bench_lmcache.py [--chunks 16] [--repeat 5]

Runs in a venv of the engine set-up (``scripts/setup-engines.sh`` builds one per tested LMCache
release).
"""

from __future__ import annotations

import os

# LMCache reports usage to a server of its own unless told not to; this talks to loopback only.
os.environ.update({"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"})

import argparse
import json
import logging
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import version
from typing import Any

import torch
from lmcache.v1.distributed.api import (
    GroupedObjectKeys,
    MemoryLayoutDesc,
    ObjectKey,
    PrefetchTaskSpec,
)
from lmcache.v1.distributed.config import parse_args
from lmcache.v1.distributed.internal_api import L2AdapterListener
from lmcache.v1.distributed.storage_manager import StorageManager
from paired import TARGET_RATIO, cell_text, ratio_cell

SHAPE = (2, 32, 256, 1024)
DEADLINE_S = 600.0
MiB = 1 << 20


@dataclass
class Medium:
    """One medium: kvplug's adapter spec and LMCache's own for it."""

    name: str
    kvplug: dict[str, Any]
    lmcache: dict[str, Any]


@dataclass
class Timings:
    store: list[float] = field(default_factory=list)
    prefetch: list[float] = field(default_factory=list)


def kvplug_spec(url: str) -> dict[str, Any]:
    return {
        "type": "plugin",
        "module_path": "kvplug_lmcache.l2_adapter",
        "class_name": "KvplugL2Adapter",
        "adapter_params": {"url": url},
    }


def manager_with(spec: dict[str, Any], l1_gb: float) -> StorageManager:
    config = parse_args(
        ["--l1-size-gb", f"{l1_gb}", "--eviction-policy", "LRU", "--l2-adapter", json.dumps(spec)]
    )
    # A private L1, not the shared-memory one: its name is per process, so two managers in one
    # process would share one pool.
    for l1 in (config.l1_manager_config, *config.l1_manager_configs):
        l1.memory_config.shm_name = ""
    return StorageManager(config)


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not finish within {DEADLINE_S} s")
        time.sleep(0.002)


class StoredKeys(L2AdapterListener):  # type: ignore[misc]  # lmcache is untyped
    """What the L2 adapters report stored: the store's end, seen as LMCache's own listeners
    see it, without asking the store anything while it works."""

    def __init__(self) -> None:
        self._stored: set[ObjectKey] = set()
        self._changed = threading.Condition()

    def on_l2_keys_stored(self, keys: list[ObjectKey], sizes: list[int]) -> None:
        with self._changed:
            self._stored.update(keys)
            self._changed.notify_all()

    def on_l2_keys_accessed(self, keys: list[ObjectKey]) -> None:
        pass

    def on_l2_keys_deleted(self, keys: list[ObjectKey]) -> None:
        with self._changed:
            self._stored.difference_update(keys)

    def wait_for(self, keys: list[ObjectKey]) -> None:
        with self._changed:
            if not self._changed.wait_for(lambda: self._stored.issuperset(keys), DEADLINE_S):
                raise TimeoutError(f"the store into L2 did not finish within {DEADLINE_S} s")


def one_pass(
    manager: StorageManager, stored: StoredKeys, chunks: int, layout: MemoryLayoutDesc
) -> tuple[float, float]:
    """(store seconds, prefetch seconds) for ``chunks`` fresh chunks, every byte checked."""
    model = f"bench-lmcache-{uuid.uuid4().hex[:12]}"
    keys = [ObjectKey(n.to_bytes(8, "big"), model, 0) for n in range(chunks)]
    reserved = manager.reserve_write(keys, layout)
    if set(reserved) != set(keys):
        raise RuntimeError(f"L1 reserved {len(reserved)} of {chunks} chunks; raise --l1-gb")
    expected = {}
    for n, key in enumerate(keys):
        data = reserved[key].tensor.view(torch.int16)
        data.fill_(n)
        data.view(-1)[n] = -1 - n  # every chunk different from the others
        expected[key] = reserved[key].tensor.clone()

    def settled() -> bool:
        controller = manager.report_status()["store_controller"]
        return not (controller["pending_keys_count"] or controller["in_flight_task_count"])

    start = time.perf_counter()
    manager.finish_write(keys)
    stored.wait_for(keys)
    store_s = time.perf_counter() - start

    wait_for(settled, "the store controller letting go of L1")
    if manager.delete_l1_keys(keys)[0] != chunks:
        raise RuntimeError("L1 did not drop every chunk before the prefetch")
    start = time.perf_counter()
    handle = manager.submit_prefetch_task(
        PrefetchTaskSpec(
            key_groups=[GroupedObjectKeys(keys=keys, object_group_id=0, layout_desc=layout)]
        )
    )
    if not manager.wait_prefetch_status(handle, DEADLINE_S):
        raise TimeoutError("the prefetch did not finish")
    prefetch_s = time.perf_counter() - start
    result = manager.query_prefetch_status(handle)
    if result is None or result.l2_hit_count != chunks:
        raise RuntimeError(f"the prefetch found {result and result.l2_hit_count} of {chunks}")
    with manager.read_prefetched_results(keys, result.l1_owners) as objects:
        if objects is None:
            raise RuntimeError("the prefetched chunks are not readable in L1")
        for key, obj in zip(keys, objects, strict=True):
            if not torch.equal(obj.tensor.view(torch.int16), expected[key].view(torch.int16)):
                raise RuntimeError(f"chunk {key.chunk_hash.hex()} came back different")
    manager.finish_read_prefetched(keys, l1_owners=result.l1_owners)
    manager.delete_l1_keys(keys)
    for _, adapter in manager.l2_adapters():
        adapter.delete(keys)
    return store_s, prefetch_s


def compare(medium: Medium, chunks: int, repeat: int, l1_gb: float) -> dict[str, Any]:
    layout = MemoryLayoutDesc(shapes=[torch.Size(SHAPE)], dtypes=[torch.float16])
    specs = {"kvplug": medium.kvplug, "lmcache": medium.lmcache}
    timings = {name: Timings() for name in specs}
    for round_index in range(repeat):
        order = list(specs) if round_index % 2 else list(reversed(specs))
        for name in order:
            # One manager alive at a time (an idle adapter's threads must not take CPU from
            # the other's pass); each warms up with a pass that is not counted.
            manager = manager_with(specs[name], l1_gb)
            stored = StoredKeys()
            manager.register_l2_listener(stored)
            try:
                one_pass(manager, stored, chunks, layout)
                store_s, prefetch_s = one_pass(manager, stored, chunks, layout)
            finally:
                manager.close()
            timings[name].store.append(store_s)
            timings[name].prefetch.append(prefetch_s)
    nbytes = chunks * torch.Size(SHAPE).numel() * 2
    row: dict[str, Any] = {"path": medium.name, "chunks": chunks, "bytes": nbytes}
    for operation in ("store", "prefetch"):
        ours, theirs = (getattr(timings[n], operation) for n in ("kvplug", "lmcache"))
        row[operation] = ratio_cell(ours, theirs, nbytes, "lmcache")
    return row


def print_row(row: dict[str, Any]) -> None:
    for operation in ("store", "prefetch"):
        print(
            f"{row['path']:<16} {operation:<9} {cell_text(row[operation], 'lmcache')}", flush=True
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=16, help="chunks of 32 MiB per pass")
    parser.add_argument("--repeat", type=int, default=5, help="counted passes per adapter")
    parser.add_argument("--dir", default=None, help="where the file paths write (default: tmp)")
    parser.add_argument("--paths", default="file,file-odirect,redis")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    l1_gb = max(1.0, 2.5 * args.chunks * 32 * MiB / (1 << 30))
    print(
        f"lmcache {version('lmcache')}, torch {torch.__version__}; {args.chunks} chunks of "
        f"{list(SHAPE)} fp16 (32 MiB) a pass, {args.repeat} passes each, alternating; ratio = "
        f"LMCache's adapter time / kvplug's per pass, median (target >= {TARGET_RATIO})"
    )
    print(f"{'path':<16} {'operation':<9} {'kvplug':>12} {'LMCache':>13}   ratio")
    rows = []
    wanted = set(args.paths.split(","))
    with tempfile.TemporaryDirectory(
        prefix="kvplug-bench-lmcache-", dir=args.dir, ignore_cleanup_errors=True
    ) as base:
        for name, odirect in (("file", False), ("file-odirect", True)):
            if name not in wanted:
                continue
            medium = Medium(
                name,
                kvplug_spec(f"file://{base}?o_direct={'true' if odirect else 'false'}"),
                {"type": "fs", "base_path": str(base), "use_odirect": odirect},
            )
            rows.append(compare(medium, args.chunks, args.repeat, l1_gb))
            print_row(rows[-1])
    if "redis" in wanted:
        from kvplug_testing import RedisServer

        with RedisServer() as server:
            medium = Medium(
                "redis",
                kvplug_spec(server.url),
                {"type": "resp", "host": "127.0.0.1", "port": server.port},
            )
            rows.append(compare(medium, args.chunks, args.repeat, l1_gb))
            print_row(rows[-1])
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
