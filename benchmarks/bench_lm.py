"""lm:// in one run: kvplug's server and client, LMCache 0.5.6's server and client, and
redis-server with redis-py, on the same chunks over loopback.

Three stacks, each a real server process this script starts on 127.0.0.1 (and kills at the
end) with its own client in this process:

* **kvplug**: ``kvplug lm-server`` and kvplug's ``lm://`` client (``open_backend``), which
  talk the extended mode: acknowledged puts, xxh3 checksums sent and verified;
* **LMCache**: LMCache 0.5.6's ``lmcache_server`` and its ``LMCServerConnector``. Its PUT has
  no reply, so its put pass ends with an ``exists`` of the last key on the same connection
  (the server handles a connection's requests in order): the time until the server holds
  everything, which is what kvplug's acknowledged puts measure too;
* **redis**: ``redis-server`` and redis-py's asyncio client (hiredis when installed): ``SET``
  and ``GET`` of the chunk's bytes.

For each chunk shape (``[2,32,256,1024]`` and ``[2,24,256,1024]`` fp16, 32 and 24 MiB) it
times a pass of ``--chunks`` puts, then a pass of as many gets, one at a time (each side's
per-op call), and kvplug's batched calls (``batched_put``/``batched_get`` of ``--batch`` chunks,
pipelined) against redis pipelines of the same size (LMCache's connector has no batch call:
its per-op numbers stand in). Passes rotate the order of the stacks; the cell is the median of
``--repeat`` passes, and the ratio is the peer's time / kvplug's (above 1.0: kvplug is faster;
the target is >= 1.0 against both). Every chunk read back is compared bit-exact on each side.

    .venv-lmcache-0.5.6/bin/python benchmarks/bench_lm.py [--chunks 16] [--batch 8] [--repeat 5]

Runs in the LMCache 0.5.6 venv that ``scripts/setup-engines.sh`` builds (LMCache 0.5.7rc2 removed
``lm://``); kvplug and redis-py are installed there too, and redis-server comes from PATH.
"""

from __future__ import annotations

import os

# LMCache reports usage to a server of its own unless told not to; this talks to loopback only.
os.environ.update({"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"})
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from importlib.metadata import version
from typing import Any

import redis
import redis.asyncio
import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryFormat as LMFormat
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.connector.lm_connector import LMCServerConnector
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from paired import TARGET_RATIO

import kvplug
from kvplug import CacheKey, FreeListAllocator, MemoryObj
from kvplug.memory import nbytes_of
from kvplug_testing import RedisServer
from kvplug_testing.lm import LMServerProcess

SHAPES = {
    "[2,32,256,1024] fp16": (2, 32, 256, 1024),
    "[2,24,256,1024] fp16": (2, 24, 256, 1024),
}
STACKS = ("kvplug", "lmcache", "redis")
MODEL = "bench-lm"


class Chunks:
    """The chunks of one shape, in an engine-side allocator, and their keys on each stack."""

    def __init__(self, shape: tuple[int, ...], count: int) -> None:
        self.shape = shape
        self.nbytes = nbytes_of(shape, torch.float16)
        self.allocator = FreeListAllocator(self.nbytes * count + (16 << 20), pin=False)
        generator = torch.Generator().manual_seed(11)
        self.objects: list[MemoryObj] = []
        for _ in range(count):
            obj = self.allocator.allocate(shape, torch.float16)
            assert obj is not None
            obj.raw.copy_(
                torch.randint(0, 256, (self.nbytes,), dtype=torch.uint8, generator=generator)
            )
            self.objects.append(obj)
        tag = "x".join(str(d) for d in shape)
        self.keys = [CacheKey(f"{MODEL}/{tag}", 1, 0, n + 1, dtype="half") for n in range(count)]

    def same(self, n: int, data: torch.Tensor) -> bool:
        return bool(torch.equal(self.objects[n].raw, data.contiguous().view(torch.uint8).view(-1)))


class LMCacheStack:
    """LMCache's connector, on this loop, with the CPU backend it allocates reads from."""

    def __init__(
        self, port: int, loop: asyncio.AbstractEventLoop, chunk_bytes: int, count: int
    ) -> None:
        # Room for the sources and the gets in flight (each released at once).
        config = LMCacheEngineConfig.from_defaults(
            chunk_size=256,
            local_cpu=True,
            max_local_cpu_size=(chunk_bytes * (count + 4) + (64 << 20)) / (1 << 30),
            remote_serde="naive",
        )
        metadata = LMCacheMetadata(
            model_name=MODEL,
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=torch.float16,
            kv_shape=(32, 2, 256, 8, 128),
            chunk_size=256,
        )
        self.cpu = LocalCPUBackend(config=config, metadata=metadata, dst_device="cpu")
        self.connector = LMCServerConnector("127.0.0.1", port, loop, self.cpu)

    def source(self, chunks: Chunks, n: int) -> Any:
        """An LMCache memory object holding chunk ``n`` (made once per shape, outside timing)."""
        obj = self.cpu.allocate(torch.Size(chunks.shape), torch.float16, LMFormat.KV_2LTD)
        assert obj is not None, "LMCache's CPU backend is out of memory"
        obj.tensor.view(torch.uint8).view(-1).copy_(chunks.objects[n].raw)
        return obj


def lmcache_key(key: CacheKey) -> Any:
    return CacheEngineKey(key.model_name, 1, 0, key.chunk_hash, torch.float16)


async def timed(work: Callable[[], Awaitable[None]]) -> float:
    start = time.perf_counter()
    await work()
    return time.perf_counter() - start


async def measure_shape(
    name: str, shape: tuple[int, ...], ports: dict[str, int], args: argparse.Namespace
) -> dict[str, dict[str, list[float]]]:
    count, batch = args.chunks, args.batch
    chunks = Chunks(shape, count)
    groups = [range(s, min(s + batch, count)) for s in range(0, count, batch)]
    loop = asyncio.get_running_loop()

    tier = FreeListAllocator(chunks.nbytes * batch + (64 << 20), pin=False)
    backend = await kvplug.open_backend(
        f"lm://127.0.0.1:{ports['kvplug']}", allocator=tier, timeout=120
    )
    lmcache = LMCacheStack(ports["lmcache"], loop, chunks.nbytes, count)
    lm_sources: list[Any] = []
    raw = redis.asyncio.Redis(host="127.0.0.1", port=ports["redis"])
    payloads = [obj.memoryview() for obj in chunks.objects]
    redis_keys = [key.to_string() for key in chunks.keys]
    lm_keys = [lmcache_key(key) for key in chunks.keys]

    async def kvplug_put() -> None:
        for key, obj in zip(chunks.keys, chunks.objects, strict=True):
            await backend.put(key, obj)

    async def kvplug_get() -> None:
        for n, key in enumerate(chunks.keys):
            got = await backend.get(key)
            assert got is not None, f"kvplug missed chunk {n}"
            got.release()

    async def kvplug_batched_put() -> None:
        for group in groups:
            await backend.batched_put(
                [chunks.keys[n] for n in group], [chunks.objects[n] for n in group]
            )

    async def kvplug_batched_get() -> None:
        for group in groups:
            for got in await backend.batched_get([chunks.keys[n] for n in group]):
                assert got is not None
                got.release()

    async def lmcache_put() -> None:
        for n, key in enumerate(lm_keys):
            await lmcache.connector.put(key, lm_sources[n])
        assert await lmcache.connector.exists(lm_keys[-1])

    async def lmcache_get() -> None:
        for n, key in enumerate(lm_keys):
            got = await lmcache.connector.get(key)
            assert got is not None, f"LMCache missed chunk {n}"
            got.ref_count_down()

    async def redis_put() -> None:
        for key, payload in zip(redis_keys, payloads, strict=True):
            await raw.set(key, payload)

    async def redis_get() -> None:
        for n, key in enumerate(redis_keys):
            assert await raw.get(key) is not None, f"redis missed chunk {n}"

    async def redis_batched_put() -> None:
        for group in groups:
            async with raw.pipeline(transaction=False) as pipe:
                for n in group:
                    pipe.set(redis_keys[n], payloads[n])
                await pipe.execute()

    async def redis_batched_get() -> None:
        for group in groups:
            async with raw.pipeline(transaction=False) as pipe:
                for n in group:
                    pipe.get(redis_keys[n])
                assert all(v is not None for v in await pipe.execute())

    work: dict[str, dict[str, Callable[[], Awaitable[None]]]] = {
        "put": {"kvplug": kvplug_put, "lmcache": lmcache_put, "redis": redis_put},
        "get": {"kvplug": kvplug_get, "lmcache": lmcache_get, "redis": redis_get},
        "batched put": {
            "kvplug": kvplug_batched_put,
            "lmcache": lmcache_put,
            "redis": redis_batched_put,
        },
        "batched get": {
            "kvplug": kvplug_batched_get,
            "lmcache": lmcache_get,
            "redis": redis_batched_get,
        },
    }
    times: dict[str, dict[str, list[float]]] = {op: {s: [] for s in STACKS} for op in work}
    try:
        lm_sources.extend(lmcache.source(chunks, n) for n in range(count))
        for op in work:  # warm-up: connections, first touches, server-side allocations
            for stack in STACKS:
                await work[op][stack]()
        for rep in range(args.repeat):
            order = STACKS[rep % 3 :] + STACKS[: rep % 3]
            for op in work:
                for stack in order:
                    times[op][stack].append(await timed(work[op][stack]))
        await verify(chunks, backend, lmcache, raw, redis_keys, lm_keys)
    finally:
        for obj in lm_sources:
            obj.ref_count_down()
        await backend.close()
        await lmcache.connector.close()
        await raw.aclose()
    return times


async def verify(
    chunks: Chunks,
    backend: kvplug.Backend,
    lmcache: LMCacheStack,
    raw: Any,
    redis_keys: list[str],
    lm_keys: list[Any],
) -> None:
    """Every chunk, read back on every stack, bit-exact."""
    for n, key in enumerate(chunks.keys):
        got = await backend.get(key)
        assert got is not None and chunks.same(n, got.raw), f"kvplug chunk {n} differs"
        got.release()
        theirs = await lmcache.connector.get(lm_keys[n])
        assert theirs is not None and chunks.same(n, theirs.tensor), f"LMCache chunk {n} differs"
        theirs.ref_count_down()
        value = await raw.get(redis_keys[n])
        assert value is not None and chunks.same(
            n, torch.frombuffer(bytearray(value), dtype=torch.uint8)
        )


def report(name: str, nbytes: int, times: dict[str, dict[str, list[float]]]) -> None:
    print(
        f"\n{name}: GB/s of the median pass; ratio = peer time / kvplug time "
        f"(target >= {TARGET_RATIO})"
    )
    print(
        f"  {'':12} {'kvplug':>9} {'LMCache':>9} {'redis':>9}   {'vs LMCache':>10} {'vs redis':>9}"
    )
    for op, by_stack in times.items():
        median = {stack: statistics.median(values) for stack, values in by_stack.items()}
        rates = {stack: nbytes / seconds / 1e9 for stack, seconds in median.items()}
        vs_lm = median["lmcache"] / median["kvplug"]
        vs_redis = median["redis"] / median["kvplug"]
        flag = "" if min(vs_lm, vs_redis) >= TARGET_RATIO else "  below target"
        print(
            f"  {op:12} {rates['kvplug']:>9.2f} {rates['lmcache']:>9.2f} {rates['redis']:>9.2f}"
            f"   {vs_lm:>9.2f}x {vs_redis:>8.2f}x{flag}"
        )


async def main(args: argparse.Namespace) -> None:
    kvplug_server = LMServerProcess(["--max-memory", args.server_memory], python=sys.executable)
    lmcache_server = LMServerProcess.lmcache(sys.executable)
    redis_server = RedisServer()
    started: list[Any] = []
    try:
        for process in (kvplug_server, lmcache_server, redis_server):
            process.start()
            started.append(process)
        ports = {
            "kvplug": kvplug_server.port,
            "lmcache": lmcache_server.port,
            "redis": redis_server.port,
        }
        print(
            f"kvplug-lm {version('kvplug-lm')} (server and client), lmcache {version('lmcache')} "
            f"(lmcache_server, LMCServerConnector), redis-py {redis.__version__} "
            f"({'hiredis' if redis.utils.HIREDIS_AVAILABLE else 'python parser'}); "
            f"{args.chunks} chunks per pass, batches of {args.batch}, {args.repeat} passes"
        )
        for name, shape in SHAPES.items():
            times = await measure_shape(name, shape, ports, args)
            report(name, nbytes_of(shape, torch.float16) * args.chunks, times)
    finally:
        for process in started:
            process.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--server-memory", default="4GiB")
    asyncio.run(main(parser.parse_args()))
