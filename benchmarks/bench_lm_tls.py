"""What TLS costs on lm://: kvplug's client and ``kvplug lm-server`` over plain TCP
(``lm://``) and over TLS (``lms://``, a client certificate required), side by side in one run.

Two server processes on 127.0.0.1 (one plain, one with test certificates made here), the same
chunks, one client each in this process. For each chunk shape it times a pass of ``--chunks``
puts, then as many gets (one call each), then ``batched_put``/``batched_get`` of ``--batch``
chunks. Passes alternate the order of the two; a cell is the median of ``--repeat`` passes and
the ratio is plain time / TLS time (1.0: TLS costs nothing; 0.5: TLS takes twice as long).
Every chunk read back is compared bit-exact.

    .venv/bin/python benchmarks/bench_lm_tls.py [--chunks 16] [--batch 8] [--repeat 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from importlib.metadata import version
from typing import Any

import torch

import kvplug
from kvplug import CacheKey, FreeListAllocator, MemoryObj
from kvplug.memory import nbytes_of
from kvplug_testing.lm import LMServerProcess
from kvplug_testing.tls import make_tls_files

SHAPES = {
    "[2,32,256,1024] fp16": (2, 32, 256, 1024),
    "[2,8,256,1024] fp16": (2, 8, 256, 1024),
}
SIDES = ("lm", "lms")


async def measure_shape(
    shape: tuple[int, ...], urls: dict[str, str], args: argparse.Namespace
) -> dict[str, dict[str, list[float]]]:
    count, batch = args.chunks, args.batch
    nbytes = nbytes_of(shape, torch.float16)
    source = FreeListAllocator(nbytes * count + (16 << 20), pin=False)
    generator = torch.Generator().manual_seed(7)
    objects: list[MemoryObj] = []
    for _ in range(count):
        obj = source.allocate(shape, torch.float16)
        assert obj is not None
        obj.raw.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator))
        objects.append(obj)
    tag = "x".join(map(str, shape))
    keys = [CacheKey(f"bench-tls/{tag}", 1, 0, n + 1, dtype="half") for n in range(count)]
    groups = [range(s, min(s + batch, count)) for s in range(0, count, batch)]
    backends = {
        side: await kvplug.open_backend(
            url,
            allocator=FreeListAllocator(nbytes * batch + (64 << 20), pin=False),
            timeout=120,
        )
        for side, url in urls.items()
    }

    def passes(backend: kvplug.Backend) -> dict[str, Callable[[], Awaitable[None]]]:
        async def put() -> None:
            for key, obj in zip(keys, objects, strict=True):
                await backend.put(key, obj)

        async def get() -> None:
            for key in keys:
                got = await backend.get(key)
                assert got is not None
                got.release()

        async def batched_put() -> None:
            for group in groups:
                await backend.batched_put([keys[n] for n in group], [objects[n] for n in group])

        async def batched_get() -> None:
            for group in groups:
                for got in await backend.batched_get([keys[n] for n in group]):
                    assert got is not None
                    got.release()

        return {"put": put, "get": get, "batched_put": batched_put, "batched_get": batched_get}

    times: dict[str, dict[str, list[float]]] = {}
    try:
        for round_ in range(args.repeat):
            order = SIDES if round_ % 2 == 0 else tuple(reversed(SIDES))
            for side in order:
                for op, work in passes(backends[side]).items():
                    start = time.perf_counter()
                    await work()
                    times.setdefault(op, {}).setdefault(side, []).append(
                        time.perf_counter() - start
                    )
        for side, backend in backends.items():
            for n, key in enumerate(keys):
                got = await backend.get(key)
                assert got is not None and torch.equal(got.raw, objects[n].raw), (side, n)
                got.release()
    finally:
        for backend in backends.values():
            await backend.close()
    return times


def report(name: str, nbytes: int, times: dict[str, dict[str, list[float]]]) -> None:
    print(f"\n{name}: GB/s of the median pass; ratio = lm:// time / lms:// time")
    print(f"  {'':12} {'lm://':>9} {'lms://':>9} {'ratio':>7}")
    for op, by_side in times.items():
        median = {side: statistics.median(values) for side, values in by_side.items()}
        rates = {side: nbytes / seconds / 1e9 for side, seconds in median.items()}
        print(
            f"  {op:12} {rates['lm']:>9.2f} {rates['lms']:>9.2f} "
            f"{median['lm'] / median['lms']:>6.2f}x"
        )


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-lm-tls-") as directory:
        files = make_tls_files(directory)
        memory = ["--max-memory", args.server_memory]
        plain = LMServerProcess(memory, python=sys.executable)
        tls = LMServerProcess(memory, python=sys.executable, tls=files, client_certificates=True)
        started: list[Any] = []
        try:
            for process in (plain, tls):
                process.start()
                started.append(process)
            print(
                f"kvplug-lm {version('kvplug-lm')}, Python {sys.version.split()[0]}; "
                f"{args.chunks} chunks per pass, batches of {args.batch}, {args.repeat} passes"
            )
            for name, shape in SHAPES.items():
                times = await measure_shape(shape, {"lm": plain.url, "lms": tls.url}, args)
                report(name, nbytes_of(shape, torch.float16) * args.chunks, times)
        finally:
            for process in started:
                process.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--server-memory", default="2GiB")
    asyncio.run(main(parser.parse_args()))
