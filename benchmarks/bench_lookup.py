"""An engine's lookup of 64 chunks on Redis: which of them are stored, asked three ways against
one real redis-server (started on 127.0.0.1 by this script, killed at the end):

* **kvplug batched_exists**: one call, as the engine integrations ask now;
* **kvplug contains per key**: one ``contains`` per chunk, all at once (``asyncio.gather``), as
  the LMCache and vLLM integrations asked before ``batched_exists`` existed;
* **raw pipeline**: one redis-py pipeline (``transaction=False``) of ``EXISTS`` per chunk, on
  the same store keys: the limit.

Of the ``--chunks`` keys every fourth is missing (misses in the middle, as after evictions).
For each way: the median time of a lookup over ``--repeat`` passes of ``--lookups`` lookups
(the ways alternate within a pass), the ratio raw time / its time, and what the server saw per
lookup, from ``INFO stats`` before and after a pass: commands processed and read events
(``total_reads_processed``: one per batch of requests the server read off a socket, so the
round trips). Every answer is checked against the keys stored.

    .venv/bin/python benchmarks/bench_lookup.py [--chunks 64] [--lookups 200] [--repeat 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import redis
import redis.asyncio
import torch

import kvplug
from kvplug import Backend, CacheKey, MemoryObj
from kvplug.backend import BytesBackend
from kvplug_testing import RedisServer


def server_counts(info: redis.Redis) -> tuple[int, int]:
    """(commands processed, read events) so far, asked on ``info``, a connection kept open
    (so no connection set-up is counted; each asking adds one command and one read)."""
    stats = info.info("stats")
    return int(stats["total_commands_processed"]), int(stats["total_reads_processed"])


async def measure(args: argparse.Namespace) -> None:
    with RedisServer() as process:
        backend: Backend = await kvplug.open_backend(process.url)
        raw = redis.asyncio.Redis(host="127.0.0.1", port=process.port)
        info = redis.Redis(host="127.0.0.1", port=process.port)
        try:
            assert isinstance(backend, BytesBackend)
            keys = [CacheKey("bench-lookup", 1, 0, n) for n in range(args.chunks)]
            stored = [n % 4 != 3 for n in range(args.chunks)]
            obj = MemoryObj.from_tensor(torch.ones(2, 1, 16, 64, dtype=torch.float16))
            await backend.batched_put(
                [k for k, s in zip(keys, stored, strict=True) if s], [obj] * sum(stored)
            )
            names = [backend.key_string(k) for k in keys]

            async def batched() -> list[bool]:
                return await backend.batched_exists(keys)

            async def per_key() -> list[bool]:
                return list(await asyncio.gather(*(backend.contains(k) for k in keys)))

            async def pipeline() -> list[bool]:
                pipe = raw.pipeline(transaction=False)
                for name in names:
                    pipe.exists(name)
                return [bool(count) for count in await pipe.execute()]

            ways: dict[str, Callable[[], Awaitable[list[bool]]]] = {
                "raw pipeline of EXISTS": pipeline,
                "kvplug batched_exists": batched,
                "kvplug contains per key": per_key,
            }
            for way in ways.values():  # connections opened, code paths warm
                assert await way() == stored
            seconds: dict[str, list[float]] = {name: [] for name in ways}
            seen: dict[str, tuple[float, float]] = {}
            for n in range(args.repeat):
                order = list(ways) if n % 2 == 0 else list(reversed(ways))
                for name in order:
                    before = server_counts(info)
                    started = time.perf_counter()
                    for _ in range(args.lookups):
                        assert await ways[name]() == stored
                    seconds[name].append((time.perf_counter() - started) / args.lookups)
                    after = server_counts(info)
                    seen[name] = tuple(  # type: ignore[assignment]
                        (b - a - 1) / args.lookups for a, b in zip(before, after, strict=True)
                    )
        finally:
            info.close()
            await raw.aclose()
            await backend.close()
    limit = statistics.median(seconds["raw pipeline of EXISTS"])
    print(
        f"A lookup of {args.chunks} chunks ({sum(stored)} stored) on redis://, medians of "
        f"{args.repeat} passes of {args.lookups} lookups"
    )
    print(f"{'way':26} {'ms/lookup':>10} {'raw/this':>9} {'commands':>9} {'round trips':>12}")
    for name, times in seconds.items():
        median = statistics.median(times)
        commands, reads = seen[name]
        print(f"{name:26} {median * 1e3:10.3f} {limit / median:9.2f} {commands:9.1f} {reads:12.1f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=64)
    parser.add_argument("--lookups", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=5)
    args: Any = parser.parse_args(argv)
    asyncio.run(measure(args))


if __name__ == "__main__":
    main()
