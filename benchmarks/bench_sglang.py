"""SGLang's HiCache L3 page path through kvplug ``file://`` against SGLang's built-in ``file``
backend, in one run.

Both backends are built by SGLang's own ``StorageBackendFactory`` over one real host pool
(``MHATokenToKVPoolHost``) and driven by SGLang's own ``HiCacheController`` page functions,
the ones its backup and prefetch threads call:

- kvplug (``dynamic`` with ``interface_v1``): ``_page_set_zero_copy`` / ``_page_get_zero_copy``,
  i.e. ``batch_set_v1`` / ``batch_get_v1`` on the host pool's pages;
- SGLang's ``file``: ``_generic_page_set`` / ``_generic_page_get`` (``get_data_page`` copies,
  ``batch_set`` / ``batch_get``, ``set_from_flat_data_page``).

A pass backs up ``--pages`` model-shaped pages under fresh keys (Llama-3.1-8B-like: 32 layers,
8 KV heads of 128, bf16, ``--page-size`` 64 tokens: 8 MiB a page) and prefetches them back
into other host pages, checking every byte; then both stores are cleared. The two backends
alternate (each pass in the other order), both write to sibling directories on the same disk,
a first pass of each is not counted, and each pass starts after an ``os.sync()`` (no dirty
pages of the other backend's pass left to write back). The ratio is SGLang's time / kvplug's
time per pass; its median is the result (target >= 1.0). kvplug runs twice: ``file://`` with
O_DIRECT (its default) and with ``o_direct=false`` (page-cache I/O, as SGLang's ``file`` does).
With ``--cold`` the page cache is dropped before each prefetch, so both read from the disk.

    .venv-sglang-0.5.23/bin/python benchmarks/bench_sglang.py [--pages 32] [--repeat 5]

Runs in the SGLang venv of the engine set-up (``scripts/setup-engines.sh``); it uses the
integration tests' harness (``integrations/sglang/tests/conftest.py``) to build SGLang's pools on
a CPU machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import sys
import tempfile
import time
import types
import uuid
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
from paired import TARGET_RATIO, cell_text, ratio_cell

HARNESS = Path(__file__).resolve().parents[1] / "integrations/sglang/tests/conftest.py"
DYNAMIC = {
    "backend_name": "kvplug",
    "module_path": "kvplug_sglang",
    "class_name": "KvplugHiCacheStorage",
    "interface_v1": 1,
}


def load_harness() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("sglang_harness", HARNESS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@dataclass
class Timings:
    backup: list[float] = field(default_factory=list)
    prefetch: list[float] = field(default_factory=list)


class Side:
    """One backend with the controller page functions SGLang uses for it."""

    def __init__(self, name: str, backend: Any, pool: Any, page_size: int, zero_copy: bool):
        from sglang.srt.managers.cache_controller import HiCacheController

        self.name = name
        self.backend = backend
        # The attributes HiCacheController's page functions read.
        self.controller = types.SimpleNamespace(
            storage_backend=backend, storage_host_pool=pool, page_size=page_size
        )
        self.operation = types.SimpleNamespace(request_id="bench", is_terminated=lambda: False)
        if zero_copy:
            self._set, self._get = (
                HiCacheController._page_set_zero_copy,
                HiCacheController._page_get_zero_copy,
            )
        else:
            self._set, self._get = (
                HiCacheController._generic_page_set,
                HiCacheController._generic_page_get,
            )

    def backup(self, keys: list[str], slots: torch.Tensor) -> None:
        if not self._set(self.controller, keys, slots):
            raise RuntimeError(f"{self.name}: the backup failed")

    def prefetch(self, keys: list[str], slots: torch.Tensor) -> None:
        got = self._get(self.controller, self.operation, keys, slots)
        if got != len(keys):
            raise RuntimeError(f"{self.name}: the prefetch got {got} of {len(keys)} pages")


def drop_page_cache() -> None:
    """Write back and drop the kernel's page cache, so reads come from the disk (needs root)."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("1\n")


def one_pass(
    side: Side, harness: types.ModuleType, pool: Any, pages: int, page_size: int, cold: bool
) -> tuple[float, float]:
    """(backup seconds, prefetch seconds) of ``pages`` fresh pages, every byte checked; with
    ``cold`` the prefetch reads from the disk, not from the page cache."""
    keys = [uuid.uuid4().hex + uuid.uuid4().hex for _ in range(pages)]
    source = torch.arange(pages * page_size)
    dest = source + pages * page_size
    for page in range(pages):  # every page different from the last pass's
        pool.get_data_page(page * page_size, flat=False).normal_()
    os.sync()  # each pass starts with no dirty pages of another pass to write back
    start = time.perf_counter()
    side.backup(keys, source)
    backup_s = time.perf_counter() - start
    if cold:
        drop_page_cache()
    start = time.perf_counter()
    side.prefetch(keys, dest)
    prefetch_s = time.perf_counter() - start
    for page in range(pages):
        if not torch.equal(
            harness.page_bytes(pool, page * page_size),
            harness.page_bytes(pool, (pages + page) * page_size),
        ):
            raise RuntimeError(f"{side.name}: page {page} came back different")
    side.backend.clear()
    return backup_s, prefetch_s


def compare(
    harness: types.ModuleType, layout: str, kvplug_url: str, sglang_dir: Path, args: Any
) -> dict[str, Any]:
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    pool = harness.build_kv_pools(
        layout,
        page_size=args.page_size,
        layers=32,
        heads=8,
        head_dim=128,
        dtype=torch.bfloat16,
        pages=2 * args.pages + 1,
    ).host
    config = harness.storage_config
    ours = StorageBackendFactory.create_backend(
        "dynamic", config(pool, extra_config={**DYNAMIC, "url": kvplug_url}), pool
    )
    ours.register_mem_pool_host(pool)
    theirs = StorageBackendFactory.create_backend(
        "file", config(pool, extra_config={"file_storage_path": str(sglang_dir)}), pool
    )
    theirs.register_mem_pool_host(pool)
    sides = {
        "kvplug": Side("kvplug", ours, pool, args.page_size, zero_copy=True),
        "sglang": Side("sglang file", theirs, pool, args.page_size, zero_copy=False),
    }
    timings = {name: Timings() for name in sides}
    try:
        for side in sides.values():  # warm-up, not counted
            one_pass(side, harness, pool, args.pages, args.page_size, args.cold)
        for round_index in range(args.repeat):
            order = list(sides) if round_index % 2 else list(reversed(sides))
            for name in order:
                backup_s, prefetch_s = one_pass(
                    sides[name], harness, pool, args.pages, args.page_size, args.cold
                )
                timings[name].backup.append(backup_s)
                timings[name].prefetch.append(prefetch_s)
    finally:
        ours.close()
    page_bytes = pool.get_dummy_flat_data_page().numel() * 2
    nbytes = args.pages * page_bytes
    row: dict[str, Any] = {
        "layout": layout,
        "kvplug_url": kvplug_url.split("?")[1] if "?" in kvplug_url else "o_direct=true",
        "pages": args.pages,
        "page_bytes": page_bytes,
    }
    for operation in ("backup", "prefetch"):
        mine, other = (getattr(timings[n], operation) for n in ("kvplug", "sglang"))
        row[operation] = ratio_cell(mine, other, nbytes, "sglang")
    return row


def print_row(row: dict[str, Any]) -> None:
    for operation in ("backup", "prefetch"):
        print(
            f"{row['layout']:<18} {row['kvplug_url']:<15} {operation:<9} "
            f"{cell_text(row[operation], 'sglang')}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=int, default=32, help="pages per pass (8 MiB each)")
    parser.add_argument("--page-size", type=int, default=64, help="tokens per page")
    parser.add_argument("--repeat", type=int, default=5, help="counted passes per backend")
    parser.add_argument("--dir", default=None, help="where both backends write (default: tmp)")
    parser.add_argument("--layouts", default="page_first,page_first_direct,layer_first")
    parser.add_argument("--o-direct", default="true,false", help="kvplug file:// o_direct runs")
    parser.add_argument(
        "--cold",
        action="store_true",
        help="drop the page cache before each prefetch (root): reads come from the disk",
    )
    args = parser.parse_args()
    harness = load_harness()
    logging.disable(logging.WARNING)
    print(
        f"sglang {version('sglang')}, torch {torch.__version__}; {args.pages} pages of "
        f"{args.page_size} tokens x 32 layers x 8 heads x 128 bf16 a pass, {args.repeat} "
        "passes each, alternating; ratio = SGLang file's time / kvplug file://'s per pass, "
        f"median (target >= {TARGET_RATIO}); prefetch reads "
        f"{'from the disk (page cache dropped)' if args.cold else 'what was just written'}"
    )
    print(f"{'layout':<18} {'kvplug file://':<15} {'operation':<9} {'kvplug':>12} {'SGLang':>13}")
    rows = []
    with tempfile.TemporaryDirectory(
        prefix="kvplug-bench-sglang-", dir=args.dir, ignore_cleanup_errors=True
    ) as base:
        for layout in args.layouts.split(","):
            for o_direct in args.o_direct.split(","):
                run = Path(base) / f"{layout}-{o_direct}"
                url = f"file://{run}/kvplug?o_direct={o_direct}"
                rows.append(compare(harness, layout, url, run / "sglang", args))
                print_row(rows[-1])
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
