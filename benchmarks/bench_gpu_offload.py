"""GPU offload and load end to end, pipelined and not, against a pinned copy of the same bytes.

A vLLM flash cache of ``--layers`` layers (32 by default), each ``[2, num_blocks, 16, 8, 128]``
fp16, and ``--chunks`` chunks of ``--tokens`` tokens (256: ``[2, 32, 256, 1024]`` fp16, 32 MiB)
whose blocks are picked in random order. Three ways to move them, side by side in one run, in
turn within every repetition:

* the raw limit: one pinned ``copy_`` per chunk of the same bytes between a GPU buffer and
  pinned host buffers (GPU -> host for offloads, host -> GPU for loads), all queued, then one
  synchronize;
* the way before the pipeline: per chunk, allocate from the store, ``gather`` (waits for the
  copy), put and wait; for loads get, ``scatter`` (waits), release;
* :func:`kvplug.runtime.gpu.offload` / :func:`kvplug.runtime.gpu.load` at each ``--depths`` (the
  gather of
  chunk i + 1 overlaps the put of chunk i; the get of chunk i + 1 overlaps the scatter of i).

The store is ``--backend`` (``cpu://`` by default, sized to hold every chunk) driven through a
``SyncClient``, as an engine's worker thread drives it. Each pass is timed from its first call
until the last byte is in place (the pipelined calls return only then; the others are
synchronized), and the median over ``--repeat`` repetitions is reported with its ratio: pinned
copy time / kvplug time (1.0: as fast as the raw copy; target >= 0.9).

After every offload every chunk is read back, and after every load every chunk is gathered
from the cache, and compared with the cache's original bytes: any difference stops the run
with an error. Without CUDA the cache lives in host memory and everything runs on the torch
path with unpinned memory; the script says so and its ratios say nothing about a GPU (it
runs that way in the test suite).

    python benchmarks/bench_gpu_offload.py [--chunks 32] [--repeat 5] [--backend cpu://]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable

import torch

from kvplug import CacheKey
from kvplug.errors import NotSupported
from kvplug.runtime.gpu import PagedKVCache, gather, kernel_available, load, offload, scatter
from kvplug.runtime.gpu.pipeline import _allocator_of  # the pipeline's own choice of memory
from kvplug.runtime.sync import SyncClient
from kvplug.url import BackendURL

BLOCK_SIZE = 16
HEADS = 8
HEAD_SIZE = 128


class Mismatch(SystemExit):
    """A chunk came back with other bytes than the cache held: the run stops, failing."""


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(operation: Callable[[], object], device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    operation()
    synchronize(device)
    return time.perf_counter() - start


class Bench:
    """The cache, the chunks' token ranges and keys, the store, and the reference bytes."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.device = device
        self.tokens = args.tokens
        self.chunks = args.chunks
        blocks_needed = -(-args.chunks * args.tokens // BLOCK_SIZE)
        num_blocks = 2 * blocks_needed
        self.layers = [
            torch.randn(2, num_blocks, BLOCK_SIZE, HEADS, HEAD_SIZE, device=device).half()
            for _ in range(args.layers)
        ]
        self.cache = PagedKVCache.vllm_flash(self.layers)
        generator = torch.Generator().manual_seed(0)
        blocks = torch.randperm(num_blocks, generator=generator)[:blocks_needed]
        slots = (blocks[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).flatten()
        self.slots = slots[: args.chunks * args.tokens].to(device)
        self.ranges = [(n * args.tokens, (n + 1) * args.tokens) for n in range(args.chunks)]
        self.keys = [CacheKey("bench-gpu-offload", 1, 0, 7000 + n) for n in range(args.chunks)]
        self.shape = self.cache.chunk_shape(args.tokens)
        self.expected = [self.gathered(start, end) for start, end in self.ranges]
        self.chunk_bytes = self.expected[0].numel()
        self.nbytes = self.chunk_bytes * args.chunks

        pinned = device.type == "cuda"
        self.flat = torch.empty((args.chunks, *self.shape), dtype=torch.float16, device=device)
        self.host = torch.empty((args.chunks, *self.shape), dtype=torch.float16, pin_memory=pinned)
        self.host.fill_(0)  # commit the pages before timing
        self.client = SyncClient(self.backend_url(args.backend, args.depths))
        self.allocate = _allocator_of(self.client.backend)

    def backend_url(self, url: str, depths: list[int]) -> str:
        if not url.startswith("cpu://") or "max_size" in BackendURL.parse(url).options:
            return url
        room = (self.chunks + max(depths) + 2) * self.chunk_bytes
        return BackendURL.parse(url).with_options(max_size=room).secret_url()

    def gathered(self, start: int, end: int) -> torch.Tensor:
        """Tokens ``start:end`` as the cache holds them, in bytes, on the cache's device."""
        shape = self.cache.chunk_shape(end - start)
        out = torch.empty(shape, dtype=torch.float16, device=self.device)
        gather(self.cache, self.slots, out, start=start, end=end, impl="torch")
        return out.view(torch.uint8).flatten()

    # -- the raw limit --------------------------------------------------------------------------

    def copy_down(self) -> None:
        for n in range(self.chunks):
            self.host[n].copy_(self.flat[n], non_blocking=True)

    def copy_up(self) -> None:
        for n in range(self.chunks):
            self.flat[n].copy_(self.host[n], non_blocking=True)

    # -- the way before the pipeline ------------------------------------------------------------

    def offload_one_by_one(self) -> None:
        for key, (start, end) in zip(self.keys, self.ranges, strict=True):
            obj = self.allocate(self.shape, torch.float16, self.cache.memory_format)
            assert obj is not None, "the store has no room for a chunk"
            try:
                gather(self.cache, self.slots, obj, start=start, end=end, validate=False)
                self.client.put(key, obj).result()
            finally:
                obj.release()

    def load_one_by_one(self) -> None:
        for key, (start, end) in zip(self.keys, self.ranges, strict=True):
            obj = self.client.get(key).result()
            if obj is None:
                raise Mismatch(f"chunk {key} is missing from the store before a load")
            try:
                scatter(obj, self.cache, self.slots, start=start, end=end, validate=False)
            finally:
                obj.release()

    # -- the pipeline ---------------------------------------------------------------------------

    def offload_pipelined(self, depth: int) -> Callable[[], None]:
        def run() -> None:
            offload(
                self.cache, self.slots, self.keys, self.client,
                chunk_tokens=self.tokens, depth=depth,
            )  # fmt: skip

        return run

    def load_pipelined(self, depth: int) -> Callable[[], None]:
        def run() -> None:
            loaded = load(
                self.cache, self.slots, self.keys, self.client,
                chunk_tokens=self.tokens, depth=depth,
            )  # fmt: skip
            if loaded != self.chunks:
                raise Mismatch(f"load found {loaded} of {self.chunks} chunks in the store")

        return run

    # -- checks ---------------------------------------------------------------------------------

    def forget(self) -> None:
        """Remove the chunks, so that the next offload's result is its own."""
        for key in self.keys:
            with contextlib.suppress(NotSupported):
                self.client.remove(key).result()

    def check_stored(self, method: str) -> None:
        for n, key in enumerate(self.keys):
            obj = self.client.get(key).result()
            if obj is None:
                raise Mismatch(f"BIT MISMATCH after {method}: chunk {n} is not in the store")
            try:
                same = torch.equal(obj.raw.to(self.device), self.expected[n])
            finally:
                obj.release()
            if not same:
                raise Mismatch(f"BIT MISMATCH after {method}: chunk {n} was stored wrong")

    def clear_cache(self) -> None:
        for layer in self.layers:
            layer.zero_()
        synchronize(self.device)

    def check_loaded(self, method: str) -> None:
        for n, (start, end) in enumerate(self.ranges):
            if not torch.equal(self.gathered(start, end), self.expected[n]):
                raise Mismatch(f"BIT MISMATCH after {method}: chunk {n} was loaded wrong")

    def close(self) -> None:
        self.client.close()


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=32, help="chunks per pass")
    parser.add_argument("--repeat", type=int, default=5, help="repetitions (median)")
    parser.add_argument("--backend", default="cpu://", help="kvplug URL of the store")
    parser.add_argument("--depths", type=int, nargs="+", default=[2, 3], help="pipeline depths")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per chunk")
    parser.add_argument("--layers", type=int, default=32, help="layers of the cache")
    args = parser.parse_args()

    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    if on_gpu:
        props = torch.cuda.get_device_properties(device)
        print(
            f"device {props.name} ({props.total_memory / 2**30:.0f} GiB), torch "
            f"{torch.__version__}, CUDA {torch.version.cuda}"
        )
        raw_name = "pinned copy_ GPU <-> host"
        path = "kvplug's CUDA copy kernel" if kernel_available() else "the torch path (no kernel)"
        print(f"gather and scatter use {path}")
    else:
        print(
            f"no CUDA (torch {torch.__version__}): the cache is in host memory, gather and "
            "scatter take the torch path, host memory is not pinned and nothing overlaps; "
            "these ratios say nothing about a GPU"
        )
        raw_name = "plain copy_, no GPU"
    bench = Bench(args, device)
    chunk = f"[{', '.join(map(str, bench.shape))}] fp16"
    print(
        f"store {bench.client.backend.url} through a SyncClient; "
        f"{args.chunks} chunks of {chunk}, {bench.chunk_bytes / 2**20:.1f} MiB each, "
        f"{bench.nbytes / 2**20:.1f} MiB per pass; medians of {args.repeat}"
    )

    offloads: dict[str, Callable[[], object]] = {
        raw_name: bench.copy_down,
        "gather, then put, per chunk": bench.offload_one_by_one,
    }
    loads: dict[str, Callable[[], object]] = {
        raw_name: bench.copy_up,
        "get, then scatter, per chunk": bench.load_one_by_one,
    }
    for depth in args.depths:
        offloads[f"pipelined offload, depth {depth}"] = bench.offload_pipelined(depth)
        loads[f"pipelined load, depth {depth}"] = bench.load_pipelined(depth)

    times: dict[str, list[float]] = {name: [] for name in [*offloads, *loads]}
    try:
        for repetition in range(args.repeat + 1):  # the first pass warms up, untimed
            for index, (name, operation) in enumerate(offloads.items()):
                if index:
                    bench.forget()
                seconds = timed(operation, device)
                if index:
                    bench.check_stored(name)
                if repetition:
                    times[name].append(seconds)
            for index, (name, operation) in enumerate(loads.items()):
                if index:
                    bench.clear_cache()
                seconds = timed(operation, device)
                if index:
                    bench.check_loaded(name)
                if repetition:
                    times[name].append(seconds)
    finally:
        bench.close()

    for direction, group in (("offload", offloads), ("load", loads)):
        print(f"{direction}:")
        raw = statistics.median(times[next(iter(group))])
        for index, name in enumerate(group):
            seconds = statistics.median(times[name])
            line = f"  {name:<34} {gbps(bench.nbytes, seconds):8.2f} GB/s"
            if index:
                line += f"   {raw / seconds:5.2f}x of raw copy"
            print(line)
    print(
        f"every chunk read back bit-exact after every offload and load "
        f"({args.repeat + 1} passes of {len(offloads) + len(loads) - 2} kvplug methods)"
    )


if __name__ == "__main__":
    main()
