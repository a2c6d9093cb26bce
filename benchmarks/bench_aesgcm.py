"""What encryption at rest costs: the same chunks through a real Redis server and the disk tier,
plain and sealed with kvplug-aesgcm (the ``aesgcm`` serde on ``redis://``, the ``aesgcm::``
wrapper over ``file://``), side by side in one run, with AES-256-GCM alone over the same bytes
(``cryptography``'s ``encrypt_into``/``decrypt_into``) as the limit.

One redis-server on 127.0.0.1 and one temporary directory; for each pair it times
``batched_put`` of ``--chunks`` chunks in batches of ``--batch``, then ``batched_get`` of them
all; passes alternate the order of the plain and the sealed side; a cell is the median of
``--repeat`` passes; the ratio is plain time / sealed time (1.0: encryption costs nothing).
Every chunk read back is compared bit-exact.

    .venv/bin/python benchmarks/bench_aesgcm.py [--chunks 16] [--batch 8] [--repeat 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import torch

import kvplug
from kvplug import CacheKey, FreeListAllocator, MemoryObj
from kvplug.memory import nbytes_of
from kvplug_aesgcm.keyring import new_entry
from kvplug_testing import RedisServer

LAYERS, HIDDEN = 32, 1024
"""A chunk is ``(2, LAYERS, --tokens, HIDDEN)`` fp16: a 32-layer model with 8 KV heads of 128
(256 tokens: 32 MiB)."""


async def measure_pair(
    urls: dict[str, str], objects: list[MemoryObj], args: argparse.Namespace
) -> dict[str, dict[str, float]]:
    keys = [CacheKey("bench-aesgcm", 1, 0, n + 1, "half") for n in range(len(objects))]
    groups = [range(s, min(s + args.batch, len(keys))) for s in range(0, len(keys), args.batch)]
    nbytes = objects[0].nbytes
    backends = {
        side: await kvplug.open_backend(
            url, allocator=FreeListAllocator(nbytes * (args.batch + 2) + (64 << 20)), timeout=120
        )
        for side, url in urls.items()
    }
    times: dict[str, dict[str, list[float]]] = {"batched_put": {}, "batched_get": {}}
    try:
        for round_ in range(args.repeat):
            sides = list(urls) if round_ % 2 == 0 else list(reversed(urls))
            for side in sides:
                backend = backends[side]
                start = time.perf_counter()
                for group in groups:
                    await backend.batched_put([keys[n] for n in group], [objects[n] for n in group])
                times["batched_put"].setdefault(side, []).append(time.perf_counter() - start)
                start = time.perf_counter()
                for group in groups:
                    found = await backend.batched_get([keys[n] for n in group])
                    for n, got in zip(group, found, strict=True):
                        assert got is not None and torch.equal(got.raw, objects[n].raw), (side, n)
                        got.release()
                times["batched_get"].setdefault(side, []).append(time.perf_counter() - start)
    finally:
        for backend in backends.values():
            await backend.close()
    return {
        op: {side: statistics.median(values) for side, values in by_side.items()}
        for op, by_side in times.items()
    }


def cipher_limit(objects: list[MemoryObj], repeat: int) -> dict[str, float]:
    """Seconds AES-256-GCM alone takes to seal and to open every chunk (median of passes)."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    cipher = AESGCM(os.urandom(32))
    sealed = [bytearray(obj.nbytes + 16) for obj in objects]
    plain = [bytearray(obj.nbytes) for obj in objects]
    nonce = os.urandom(12)
    seal, open_ = [], []
    for _ in range(repeat):
        start = time.perf_counter()
        for obj, out in zip(objects, sealed, strict=True):
            cipher.encrypt_into(nonce, obj.memoryview(), b"", out)
        seal.append(time.perf_counter() - start)
        start = time.perf_counter()
        for data, out in zip(sealed, plain, strict=True):
            cipher.decrypt_into(nonce, data, b"", out)
        open_.append(time.perf_counter() - start)
    return {"batched_put": statistics.median(seal), "batched_get": statistics.median(open_)}


def report(
    title: str,
    names: tuple[str, str],
    total: int,
    times: dict[str, dict[str, float]],
    limit: dict[str, float],
) -> None:
    plain, sealed = names
    print(f"\n{title}: GB/s of the median pass; ratio = plain time / sealed time")
    print(f"  {'':12} {'plain':>9} {'sealed':>9} {'ratio':>7} {'AES-GCM alone':>14}")
    for op, by_side in times.items():
        rate = {side: total / seconds / 1e9 for side, seconds in by_side.items()}
        print(
            f"  {op:12} {rate[plain]:>9.2f} {rate[sealed]:>9.2f} "
            f"{by_side[plain] / by_side[sealed]:>6.2f}x {total / limit[op] / 1e9:>14.2f}"
        )


async def main(args: argparse.Namespace) -> None:
    shape = (2, LAYERS, args.tokens, HIDDEN)
    nbytes = nbytes_of(shape, torch.float16)
    source = FreeListAllocator(nbytes * args.chunks + (16 << 20), pin=False)
    generator = torch.Generator().manual_seed(11)
    objects = []
    for _ in range(args.chunks):
        obj = source.allocate(shape, torch.float16)
        assert obj is not None
        obj.tensor.copy_(torch.randn(shape, generator=generator))
        objects.append(obj)
    total = nbytes * args.chunks
    limit = cipher_limit(objects, args.repeat)
    print(
        f"kvplug-aesgcm {version('kvplug-aesgcm')}, cryptography {version('cryptography')}, "
        f"Python {sys.version.split()[0]}; {args.chunks} chunks of {shape} fp16 "
        f"({nbytes / 2**20:g} MiB) per pass, batches of {args.batch}, {args.repeat} passes"
    )
    with tempfile.TemporaryDirectory(prefix="bench-aesgcm-") as directory:
        keys = Path(directory) / "keys"
        keys.write_text(new_entry(1) + "\n")
        keys.chmod(0o600)
        with RedisServer(maxmemory=f"{3 * total + (256 << 20)}") as server:
            redis = {
                "plain": server.url,
                "sealed": f"{server.url}?serde=aesgcm&serde_key_file={keys}",
            }
            times = await measure_pair(redis, objects, args)
        report("redis:// (serde=aesgcm)", ("plain", "sealed"), total, times, limit)
        disk = {
            "plain": f"file://{directory}/plain",
            "sealed": f"aesgcm://?key_file={keys}::file://{directory}/sealed",
        }
        times = await measure_pair(disk, objects, args)
        report("file:// (aesgcm:: wrapper)", ("plain", "sealed"), total, times, limit)
    for obj in objects:
        obj.release()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per chunk")
    asyncio.run(main(parser.parse_args()))
