"""The cpu tier against plain tensor copies of the same bytes, side by side in one run.

The engine's path through the host-memory tier is: a chunk arrives in a buffer of the engine
(put copies it into the tier), and later the engine copies a get's result out into its own
buffer (get itself is zero-copy). The raw limit is the same two copies done with plain
``Tensor.copy_`` between preallocated buffers. The ratio is raw time / kvplug time, so 1.0
means no overhead; the target is >= 0.8.

It also reports the per-operation overhead on tiny objects (4 KiB), where copies cost nothing
and what remains is kvplug's own bookkeeping.

    .venv/bin/python benchmarks/bench_cpu.py [--chunks 64] [--repeat 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

import kvplug
from kvplug import CacheKey, FreeListAllocator, MemoryObj

SHAPES = {
    "8B-class [2,32,256,1024] fp16": (2, 32, 256, 1024),
    "[2,24,256,1024] fp16": (2, 24, 256, 1024),
}


def key(n: int) -> CacheKey:
    return CacheKey("bench-cpu", 1, 0, n)


async def kvplug_round(
    cpu: kvplug.Backend, sources: list[MemoryObj], sinks: list[torch.Tensor]
) -> float:
    start = time.perf_counter()
    for n, source in enumerate(sources):
        await cpu.put(key(n), source)
    for n, sink in enumerate(sinks):
        hit = await cpu.get(key(n))
        assert hit is not None
        sink.copy_(hit.raw)
        hit.release()
    elapsed = time.perf_counter() - start
    for n in range(len(sources)):
        await cpu.remove(key(n))
    return elapsed


def raw_round(
    sources: list[MemoryObj], middle: list[torch.Tensor], sinks: list[torch.Tensor]
) -> float:
    start = time.perf_counter()
    for source, buffer in zip(sources, middle, strict=True):
        buffer.copy_(source.raw)
    for buffer, sink in zip(middle, sinks, strict=True):
        sink.copy_(buffer)
    return time.perf_counter() - start


async def measure_shape(name: str, shape: tuple[int, ...], chunks: int, repeat: int) -> float:
    nbytes = kvplug.memory.nbytes_of(shape, torch.float16)
    engine = FreeListAllocator(nbytes * chunks + (64 << 20), pin=False)
    sources = [engine.allocate(shape, torch.float16) for _ in range(chunks)]
    for n, source in enumerate(sources):
        assert source is not None
        source.raw.fill_(n % 251)
    sinks = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(chunks)]
    middle = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(chunks)]
    for buffer in sinks + middle:
        buffer.fill_(0)  # commit the pages before timing
    cpu = await kvplug.open_backend(f"cpu://?max_size={nbytes * (chunks + 2)}")
    # Warm the tier's pages once, so neither side pays first-touch page faults in the timing.
    await kvplug_round(cpu, sources, sinks)
    raw_times, kv_times = [], []
    for _ in range(repeat):
        raw_times.append(raw_round(sources, middle, sinks))  # type: ignore[arg-type]
        kv_times.append(await kvplug_round(cpu, sources, sinks))  # type: ignore[arg-type]
    for n, sink in enumerate(sinks):
        assert bool((sink == n % 251).all()), "a get returned wrong bytes"
    await cpu.close()
    for source in sources:
        source.release()  # type: ignore[union-attr]
    moved = 2 * nbytes * chunks
    raw, kv = statistics.median(raw_times), statistics.median(kv_times)
    print(
        f"{name}: {chunks} chunks of {nbytes / 2**20:.0f} MiB, put+get (2 copies each)\n"
        f"  plain copy_  {moved / raw / 1e9:6.2f} GB/s\n"
        f"  kvplug cpu   {moved / kv / 1e9:6.2f} GB/s\n"
        f"  ratio        {raw / kv:6.2f}x of plain copy (target >= 0.8)"
    )
    return raw / kv


async def small_object_overhead(count: int) -> None:
    cpu = await kvplug.open_backend("cpu://?max_size=256MiB")
    allocator = cpu.allocator
    objs = [allocator.allocate((4096,), torch.uint8) for _ in range(count)]
    keys = [key(n) for n in range(count)]
    start = time.perf_counter()
    for k, obj in zip(keys, objs, strict=True):
        await cpu.put(k, obj)  # type: ignore[arg-type]
    put = (time.perf_counter() - start) / count
    start = time.perf_counter()
    for k in keys:
        hit = await cpu.get(k)
        assert hit is not None
        hit.release()
    get = (time.perf_counter() - start) / count
    plain: dict[CacheKey, object] = {}
    start = time.perf_counter()
    for k, obj in zip(keys, objs, strict=True):
        plain[k] = obj
    for k in keys:
        _ = plain[k]
    dict_op = (time.perf_counter() - start) / (2 * count)
    for obj in objs:
        obj.release()  # type: ignore[union-attr]
    await cpu.close()
    print(
        f"small objects (4 KiB, zero-copy, {count} each): put {put * 1e6:.1f} us, "
        f"get {get * 1e6:.1f} us per op; a plain dict insert/lookup {dict_op * 1e6:.2f} us"
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name, shape in SHAPES.items():
        await measure_shape(name, shape, args.chunks, args.repeat)
    await small_object_overhead(20_000)


if __name__ == "__main__":
    asyncio.run(main())
