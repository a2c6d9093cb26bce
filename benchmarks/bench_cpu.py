"""The cpu tier against plain tensor copies of the same bytes, side by side in one run.

The engine's path through the host-memory tier is: a chunk arrives in a buffer of the engine
(put copies it into the tier), and later the engine copies a get's result out into its own
buffer (get itself is zero-copy). The raw limit is the same two copies done with plain
``Tensor.copy_`` between preallocated buffers. The ratio is raw time / kvplug time, so 1.0
means no overhead; the target is >= 0.8.

It also reports the per-operation overhead on tiny objects (4 KiB), where copies cost nothing
and what remains is kvplug's own bookkeeping, and the cost of an engine thread's call through
:class:`~kvplug.runtime.sync.SyncClient`, which runs a ``runs_inline`` backend's operation on the
calling thread: against the same operation's coroutine stepped by hand (the raw limit of running
it inline) and against a plain dict lookup.

    .venv/bin/python benchmarks/bench_cpu.py [--chunks 64] [--repeat 5] [--calls 200] [--passes 500]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar, cast

import torch

import kvplug
from kvplug import CacheKey, FreeListAllocator, MemoryObj
from kvplug.runtime.sync import SyncClient

T = TypeVar("T")

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


def stepped(coroutine: Coroutine[Any, Any, T]) -> T:
    """The operation's coroutine run to its end by hand: what running it inline costs at least."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return cast(T, done.value)
    raise AssertionError("an operation of cpu:// waited")


def per_call(calls: int, passes: int, *ways: Callable[[int], object]) -> list[float]:
    """For each of ``ways``, the seconds one ``way(n)`` takes in the fastest of ``passes``
    passes of ``calls`` calls: on a shared machine the pass least disturbed by others. The ways
    take turns within each pass, so load falls on all alike."""
    times: list[list[float]] = [[] for _ in ways]
    for _ in range(passes):
        for way, taken in zip(ways, times, strict=True):
            start = time.perf_counter()
            for n in range(calls):
                way(n)
            taken.append((time.perf_counter() - start) / calls)
    return [min(taken) for taken in times]


def inline_call_overhead(calls: int, passes: int) -> None:
    """Gets (hits) and contains through a SyncClient on cpu://, which runs them on this thread,
    against the same operations stepped by hand and a plain dict lookup."""
    with SyncClient("cpu://?max_size=64MiB") as client:
        backend = client.backend
        keys = [key(n) for n in range(64)]
        for k in keys:
            client.put(k, MemoryObj.from_tensor(torch.ones(1024, dtype=torch.uint8))).result()
        plain = dict.fromkeys(keys, True)

        def client_get(n: int) -> None:
            got = client.get(keys[n % 64]).result()
            assert got is not None
            got.release()

        def stepped_get(n: int) -> None:
            got = stepped(backend.get(keys[n % 64]))
            assert got is not None
            got.release()

        rows = {
            "get": (client_get, stepped_get),
            "contains": (
                lambda n: client.contains(keys[n % 64]).result(),
                lambda n: stepped(backend.contains(keys[n % 64])),
            ),
        }
        print(f"SyncClient on cpu:// (inline, 1 KiB hits, fastest of {passes} x {calls} calls):")
        for operation, (through_client, by_hand) in rows.items():
            inline, raw, dict_op = per_call(
                calls, passes, through_client, by_hand, lambda n: plain[keys[n % 64]]
            )
            print(
                f"  {operation:<9} SyncClient {inline * 1e6:5.2f} us, stepped by hand "
                f"{raw * 1e6:5.2f} us, plain dict {dict_op * 1e6:5.2f} us; inline ratio "
                f"{raw / inline:4.2f}x of stepping by hand"
            )


async def tier_against_copies(chunks: int, repeat: int) -> None:
    for name, shape in SHAPES.items():
        await measure_shape(name, shape, chunks, repeat)
    await small_object_overhead(20_000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--calls", type=int, default=200, help="calls per inline pass")
    parser.add_argument("--passes", type=int, default=500, help="inline passes, the fastest kept")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    asyncio.run(tier_against_copies(args.chunks, args.repeat))
    inline_call_overhead(args.calls, args.passes)  # from a thread without a loop, as engines do


if __name__ == "__main__":
    main()
