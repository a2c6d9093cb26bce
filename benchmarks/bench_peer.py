"""kvplug against LMCache 0.5.6's own backends and the raw limit, per path, in one run.

The workload of issue 19: KV chunks ``[2, L, 256, 1024]`` fp16 with L = 32 (32 MiB) and
L = 24 (24 MiB), about ``--gib`` GiB a pass. A *store* is allocate + copy the chunk in from the
engine's buffer + put, awaited; a *retrieve* is a get (plus the copy out into the caller's
tensor for the cpu tier). Everything is driven from this, the caller's, thread as an engine
would: kvplug through :class:`kvplug.runtime.sync.SyncClient`, LMCache's backends called directly
(they run their own event-loop thread, as in LMCache's engine). Each path has a per-op
variant (one chunk a call) and a batched one (``--batch`` chunks a call, where the API batches).

Per path, the sides are:

- **cpu**: kvplug ``cpu://`` against LMCache's ``LocalCPUBackend``; raw = ``Tensor.copy_``
  into a preallocated buffer and back out.
- **disk** (O_DIRECT): kvplug ``file://<dir>?workers=<batch>`` (O_DIRECT by default; as many
  I/O threads as the raw side's) against LMCache's
  ``LocalDiskBackend`` with ``extra_config={"use_odirect": True}`` (its default is page-cache
  I/O); raw = one file per chunk written with ``os.pwrite`` and read with ``os.preadv`` on an
  ``O_DIRECT`` descriptor from page-aligned buffers (the batch spread over ``--batch`` threads).
- **redis**: kvplug ``redis://`` against LMCache's ``redis://`` connector (redis-py) and its
  ``resp://`` connector (its C++ client), each through LMCache's ``RemoteBackend``; raw =
  redis-py ``SET``/``GET`` (pipelines for the batch) and a hand-written RESP client on plain
  sockets that sends from and reads into preallocated buffers (``sendall`` of memoryviews,
  ``recv_into``), a batch pipelined on one connection or spread over ``--batch`` of them;
  the fastest of these is the raw limit. One ``redis-server`` per run, flushed between sides.

Each side is warmed up by untimed passes; then each repetition runs one pass per side and
variant, the order of the sides rotating between repetitions, with fresh keys every pass.
Every chunk retrieved is compared with what was stored (a mismatch stops the run). A cell is
MB/s (1 MB = 1e6 bytes) of the median pass; the ratios are kvplug's MB/s over LMCache's best
option for the medium and over the best raw, flagged below their targets (>= 1.0 against
LMCache, >= 0.95 against raw). ``--json`` also prints every pass's MB/s and the same ratios
taken per round (``paired_vs_lmcache``, ``paired_vs_raw``: median of the rounds' ratios).

On the redis path the engine's copies (each chunk into the store's memory) run on one torch
thread unless ``--torch-threads`` says otherwise. With two, torch's second thread keeps
spinning after each copy: on a 2-core machine it takes the core that redis-server needs. The
server then used 0.56 s of CPU per GiB stored instead of 0.45 s, and kvplug's per-op puts ran
at 1260 MB/s instead of 1795 MB/s (docs/benchmarks.md). Every side pays that, but unevenly.

On the redis path the run also reads redis-server's CPU seconds over each pass's retrieves,
and prints them per GiB, per side, with how many passes ran at the server's usual
cost (within ``SLOW_SERVER`` of the row's lowest), and kvplug's ratio to the best raw over
those passes alone. On this VM the server's cost for the same GETs can double for a while,
whichever client is reading (docs/benchmarks.md).

    .venv-lmcache-0.5.6/bin/python benchmarks/bench_peer.py [--paths cpu,disk,redis]
        [--gib 2] [--repeat 3] [--batch 8] [--layers 32,24] [--dir DIR] [--json]
        [--torch-threads N]

Runs in the LMCache 0.5.6 venv that ``scripts/setup-engines.sh`` builds (kvplug and its plugins are
installed there too); ``redis-server`` comes from PATH.
"""

from __future__ import annotations

import os

# LMCache reports usage to a server of its own unless told not to; this talks to loopback only.
os.environ.update({"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"})
os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")

import abc
import argparse
import asyncio
import itertools
import json
import mmap
import shutil
import socket
import statistics
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

import psutil
import redis
import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryFormat as LMFormat
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend
from lmcache.v1.storage_backend.remote_backend import RemoteBackend

from kvplug import CacheKey, FreeListAllocator, MemoryObj
from kvplug.memory import nbytes_of
from kvplug.runtime.sync import SyncClient
from kvplug_testing import RedisServer

MODEL = "bench-peer"
TARGET_VS_LMCACHE = 1.0
TARGET_VS_RAW = 0.95
SLOW_SERVER = 1.25  # server CPU per GiB over this times a row's lowest: a slow-server pass
WAIT_S = 300.0
MiB = 1 << 20
VARIANTS = ("per-op", "batch")
OPERATIONS = ("store", "retrieve")

_key_numbers = itertools.count(1)


# -- the chunks ----------------------------------------------------------------------------------


class Chunks:
    """The engine's chunks of one shape: a few random sources; chunk ``n`` of a pass is source
    ``n % len(sources)`` with its first 8 bytes set to the chunk's key number, so a chunk that
    comes back under another key, or stale, or torn, does not compare equal."""

    def __init__(self, layers: int, sources: int = 4) -> None:
        self.layers = layers
        self.shape = (2, layers, 256, 1024)
        self.nbytes = nbytes_of(self.shape, torch.float16)
        generator = torch.Generator().manual_seed(19 + layers)
        self.sources = [
            torch.randint(0, 256, (self.nbytes,), dtype=torch.uint8, generator=generator)
            for _ in range(sources)
        ]

    @property
    def name(self) -> str:
        return f"{self.nbytes // MiB} MiB"

    def fill(self, into: torch.Tensor, number: int) -> None:
        """Copy chunk ``number`` into ``into`` (a flat uint8 view of the destination)."""
        into.copy_(self.sources[number % len(self.sources)])
        into[:8].view(torch.int64).fill_(number)

    def check(self, got: torch.Tensor, number: int, side: str) -> None:
        """Fail loudly unless ``got`` holds chunk ``number``."""
        source = self.sources[number % len(self.sources)]
        stamp = int(got[:8].view(torch.int64).item()) if got.numel() >= 8 else None
        if got.numel() != self.nbytes or stamp != number or not torch.equal(got[8:], source[8:]):
            raise RuntimeError(
                f"{side}: chunk {number} ({self.name}) came back different: {got.numel()} "
                f"bytes, stamp {stamp}"
            )


def flat(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8).view(-1)


class Latch:
    """Waits for ``count`` completion callbacks (LMCache's puts report through them)."""

    def __init__(self, count: int) -> None:
        self._left = count
        self._done = threading.Condition()

    def count_down(self, _key: object = None) -> None:
        with self._done:
            self._left -= 1
            self._done.notify_all()

    def wait(self, what: str) -> None:
        with self._done:
            if not self._done.wait_for(lambda: self._left <= 0, WAIT_S):
                raise TimeoutError(f"{what}: {self._left} puts did not complete in {WAIT_S} s")


# -- the sides -----------------------------------------------------------------------------------


class Side(abc.ABC):
    """One way of storing and retrieving the chunks, called from the caller's thread.

    ``store`` stores the given chunk numbers (one call of the API, or one per chunk for APIs
    without batching); ``retrieve`` gets them back and returns flat uint8 views of what came
    back, for checking after the timed region; ``release`` lets go of those.
    """

    name: str
    group: str  # "kvplug", "lmcache" or "raw"

    def __init__(self, chunks: Chunks) -> None:
        self.chunks = chunks

    @abc.abstractmethod
    def store(self, numbers: Sequence[int]) -> None: ...

    @abc.abstractmethod
    def retrieve(self, numbers: Sequence[int]) -> list[torch.Tensor]: ...

    def release(self) -> None:
        """Drop what the last ``retrieve`` returned."""

    @abc.abstractmethod
    def clear(self, numbers: Sequence[int]) -> None:
        """Remove a pass's chunks (untimed)."""

    def close(self) -> None:
        pass


class CopyOut:
    """The cpu tier's retrieve ends with a copy into the caller's tensors: these."""

    def __init__(self, chunks: Chunks, batch: int) -> None:
        self.sinks = [torch.zeros(chunks.nbytes, dtype=torch.uint8) for _ in range(batch)]


class KvplugSide(Side):
    group = "kvplug"

    def __init__(
        self,
        chunks: Chunks,
        url: str,
        batch: int,
        allocator: FreeListAllocator | None = None,
        copy_out: bool = False,
    ) -> None:
        super().__init__(chunks)
        self.name = "kvplug"
        self.client = SyncClient(url, allocator=allocator)
        self.allocator = self.client.backend.allocator
        self.sinks = CopyOut(chunks, batch).sinks if copy_out else None
        self._held: list[MemoryObj] = []

    def key(self, number: int) -> CacheKey:
        return CacheKey(MODEL, 1, 0, number, dtype="half")

    def store(self, numbers: Sequence[int]) -> None:
        if len(numbers) == 1:
            obj = self.allocator.allocate(self.chunks.shape, torch.float16)
            if obj is None:
                raise RuntimeError("kvplug: the allocator is full")
            self.chunks.fill(obj.raw, numbers[0])
            try:
                self.client.put(self.key(numbers[0]), obj).result()
            finally:
                obj.release()
            return
        objs = self.allocator.batched_allocate(self.chunks.shape, torch.float16, len(numbers))
        if objs is None:
            raise RuntimeError("kvplug: the allocator is full")
        try:
            for obj, number in zip(objs, numbers, strict=True):
                self.chunks.fill(obj.raw, number)
            self.client.batched_put([self.key(n) for n in numbers], objs).result()
        finally:
            for obj in objs:
                obj.release()

    def retrieve(self, numbers: Sequence[int]) -> list[torch.Tensor]:
        if len(numbers) == 1:
            got = [self.client.get(self.key(numbers[0])).result()]
        else:
            got = self.client.batched_get([self.key(n) for n in numbers]).result()
        objs = [obj for obj in got if obj is not None]
        if len(objs) != len(numbers):
            for obj in objs:
                obj.release()
            raise RuntimeError(f"kvplug missed {len(numbers) - len(objs)} of {list(numbers)}")
        if self.sinks is None:
            self._held = objs
            return [obj.raw for obj in objs]
        for obj, sink in zip(objs, self.sinks, strict=False):
            sink.copy_(obj.raw)
            obj.release()
        return self.sinks[: len(objs)]

    def release(self) -> None:
        for obj in self._held:
            obj.release()
        self._held = []

    def clear(self, numbers: Sequence[int]) -> None:
        for number in numbers:
            self.client.remove(self.key(number)).result()

    def close(self) -> None:
        self.client.close()


class LoopThread:
    """The event loop LMCache's disk and remote backends schedule their work on."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="lmcache-loop")
        self.thread.start()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


def lmcache_metadata(chunks: Chunks) -> LMCacheMetadata:
    # kv_shape is (layers, 2, tokens, heads, head size): chunks of [2, layers, 256, 8 * 128].
    return LMCacheMetadata(
        model_name=MODEL,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.float16,
        kv_shape=(chunks.layers, 2, 256, 8, 128),
        chunk_size=256,
    )


class LMCacheSide(Side):
    """What LMCache's sides share: a ``LocalCPUBackend`` (the tier itself, or the staging
    memory the other backends allocate from) and its keys."""

    group = "lmcache"

    def __init__(self, chunks: Chunks, cpu_chunks: int, **config: Any) -> None:
        super().__init__(chunks)
        self.config = LMCacheEngineConfig.from_defaults(
            chunk_size=256,
            max_local_cpu_size=(chunks.nbytes * cpu_chunks + 64 * MiB) / (1 << 30),
            **config,
        )
        self.metadata = lmcache_metadata(chunks)
        self.cpu = LocalCPUBackend(config=self.config, metadata=self.metadata, dst_device="cpu")
        self.shape = torch.Size(chunks.shape)
        self._held: list[Any] = []

    def key(self, number: int) -> CacheEngineKey:
        return CacheEngineKey(MODEL, 1, 0, number, torch.float16)

    def allocate_filled(self, numbers: Sequence[int]) -> list[Any]:
        if len(numbers) == 1:
            one = self.cpu.allocate(self.shape, torch.float16, LMFormat.KV_2LTD)
            objs = None if one is None else [one]
        else:
            objs = self.cpu.batched_allocate(
                self.shape, torch.float16, len(numbers), LMFormat.KV_2LTD
            )
        if objs is None:
            raise RuntimeError(f"{self.name}: LocalCPUBackend could not allocate")
        for obj, number in zip(objs, numbers, strict=True):
            self.chunks.fill(flat(obj.tensor), number)
        return objs

    def hold(self, got: Sequence[Any], numbers: Sequence[int]) -> list[torch.Tensor]:
        objs = [obj for obj in got if obj is not None]
        self._held = objs
        if len(objs) != len(numbers):
            self.release()
            raise RuntimeError(f"{self.name} missed {len(numbers) - len(objs)} of {numbers}")
        return [flat(obj.tensor) for obj in objs]

    def release(self) -> None:
        for obj in self._held:
            obj.ref_count_down()
        self._held = []


class LMCacheCPUSide(LMCacheSide):
    def __init__(self, chunks: Chunks, count: int, batch: int) -> None:
        super().__init__(chunks, count + 2 * batch, local_cpu=True)
        self.name = "LMCache cpu"
        self.sinks = CopyOut(chunks, batch).sinks

    def store(self, numbers: Sequence[int]) -> None:
        objs = self.allocate_filled(numbers)
        keys = [self.key(n) for n in numbers]
        if len(numbers) == 1:
            self.cpu.submit_put_task(keys[0], objs[0])
        else:
            self.cpu.batched_submit_put_task(keys, objs)
        for obj in objs:
            obj.ref_count_down()  # the backend holds its own reference

    def retrieve(self, numbers: Sequence[int]) -> list[torch.Tensor]:
        keys = [self.key(n) for n in numbers]
        if len(numbers) == 1:
            got = [self.cpu.get_blocking(keys[0])]
        else:
            got = self.cpu.batched_get_blocking(keys)
        views = self.hold(got, numbers)
        for view, sink in zip(views, self.sinks, strict=False):
            sink.copy_(view)
        self.release()
        return self.sinks[: len(numbers)]

    def clear(self, numbers: Sequence[int]) -> None:
        for number in numbers:
            self.cpu.remove(self.key(number))


class LMCacheDiskSide(LMCacheSide):
    def __init__(
        self, chunks: Chunks, count: int, batch: int, passes: int, directory: Path
    ) -> None:
        self.loop = LoopThread()
        # Its remove() (0.5.6) deletes the file but keeps the bytes in the size it admits
        # against, which then evicts the chunks of the pass being stored: its limit is set to
        # what all passes write, while the files of each pass are removed after it.
        super().__init__(
            chunks,
            4 * batch,
            local_cpu=False,
            local_disk=str(directory),
            max_local_disk_size=(chunks.nbytes * (count + batch) * passes + 64 * MiB) / (1 << 30),
            extra_config={"use_odirect": True},
        )
        self.name = "LMCache disk"
        self.disk = LocalDiskBackend(
            self.config, self.loop.loop, self.cpu, "cpu", None, self.metadata
        )
        if not self.disk.use_odirect:
            raise RuntimeError("LocalDiskBackend did not take use_odirect")

    def store(self, numbers: Sequence[int]) -> None:
        objs = self.allocate_filled(numbers)
        keys = [self.key(n) for n in numbers]
        latch = Latch(len(numbers))
        if len(numbers) == 1:
            self.disk.submit_put_task(keys[0], objs[0], on_complete_callback=latch.count_down)
        else:
            self.disk.batched_submit_put_task(keys, objs, on_complete_callback=latch.count_down)
        for obj in objs:
            obj.ref_count_down()  # the write holds its own reference until it is done
        latch.wait(self.name)

    def retrieve(self, numbers: Sequence[int]) -> list[torch.Tensor]:
        keys = [self.key(n) for n in numbers]
        if len(numbers) == 1:
            return self.hold([self.disk.get_blocking(keys[0])], numbers)
        return self.hold(self.disk.batched_get_blocking(keys), numbers)

    def clear(self, numbers: Sequence[int]) -> None:
        for number in numbers:
            self.disk.remove(self.key(number))

    def close(self) -> None:
        self.disk.close()
        self.loop.stop()


class LMCacheRemoteSide(LMCacheSide):
    def __init__(self, chunks: Chunks, batch: int, scheme: str, port: int) -> None:
        self.loop = LoopThread()
        super().__init__(
            chunks,
            4 * batch,
            local_cpu=False,
            remote_url=f"{scheme}://127.0.0.1:{port}",
            remote_serde="naive",
            save_unfull_chunk=False,  # resp:// asks for it
            extra_config={"save_chunk_meta": False},
        )
        self.name = f"LMCache {scheme}://"
        self.remote = RemoteBackend(self.config, self.metadata, self.loop.loop, self.cpu, "cpu")
        if self.remote.connection is None:
            raise RuntimeError(f"{self.name}: LMCache could not connect to 127.0.0.1:{port}")

    def store(self, numbers: Sequence[int]) -> None:
        objs = self.allocate_filled(numbers)
        keys = [self.key(n) for n in numbers]
        try:
            if len(numbers) == 1:
                self.remote.submit_put_task(keys[0], objs[0]).result(WAIT_S)
            else:
                # Its batched put reports every key done, also when the batch failed: the
                # retrieve's check is what catches a failed put.
                latch = Latch(len(numbers))
                self.remote.batched_submit_put_task(
                    keys, objs, on_complete_callback=latch.count_down
                )
                latch.wait(self.name)
        finally:
            for obj in objs:
                obj.ref_count_down()

    def retrieve(self, numbers: Sequence[int]) -> list[torch.Tensor]:
        keys = [self.key(n) for n in numbers]
        if len(numbers) == 1:
            return self.hold([self.remote.get_blocking(keys[0])], numbers)
        return self.hold(self.remote.batched_get_blocking(keys), numbers)

    def clear(self, numbers: Sequence[int]) -> None:
        pass  # the server is flushed between sides

    def close(self) -> None:
        # RemoteBackend.close() (0.5.6) blocks the loop thread on a future that needs that
        # loop (its connectors' close runs the queue's synchronous shutdown on the loop), so
        # the connector is taken apart here instead.
        connector = getattr(self.remote.connection, "_connector", self.remote.connection)

        async def shut() -> None:
            await connector.pq_executor.shutdown_async(wait=True)
            native = getattr(connector, "client", None)
            if native is not None:
                native.close()
            pool = getattr(connector, "connection", None)
            if pool is not None:
                await pool.aclose()

        asyncio.run_coroutine_threadsafe(shut(), self.loop.loop).result(WAIT_S)
        self.loop.stop()


class RawCPUSide(Side):
    """Plain ``Tensor.copy_`` into preallocated buffers and back out."""

    group = "raw"

    def __init__(self, chunks: Chunks, count: int, batch: int) -> None:
        super().__init__(chunks)
        self.name = "raw copy_"
        self.buffers = [torch.zeros(chunks.nbytes, dtype=torch.uint8) for _ in range(count)]
        self.sinks = CopyOut(chunks, batch).sinks
        self.slots: dict[int, int] = {}

    def store(self, numbers: Sequence[int]) -> None:
        for number in numbers:
            slot = self.slots.setdefault(number, len(self.slots))
            self.chunks.fill(self.buffers[slot], number)

    def retrieve(self, numbers: Sequence[int]) -> list[torch.Tensor]:
        for number, sink in zip(numbers, self.sinks, strict=False):
            sink.copy_(self.buffers[self.slots[number]])
        return self.sinks[: len(numbers)]

    def clear(self, numbers: Sequence[int]) -> None:
        self.slots.clear()


def byte_buffer(nbytes: int) -> tuple[memoryview, torch.Tensor]:
    """A zeroed buffer the socket calls take as a memoryview, and a uint8 tensor over it."""
    memory = bytearray(nbytes)
    return memoryview(memory), torch.frombuffer(memory, dtype=torch.uint8)


def aligned_buffer(nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    """Page-aligned anonymous memory (what O_DIRECT needs) and a uint8 tensor over it."""
    memory = mmap.mmap(-1, nbytes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return memory, torch.frombuffer(memory, dtype=torch.uint8)


class RawDiskSide(Side):
    """One file per chunk, ``pwrite``/``preadv`` on an O_DIRECT descriptor."""

    group = "raw"

    def __init__(self, chunks: Chunks, batch: int, directory: Path) -> None:
        super().__init__(chunks)
        self.name = "raw O_DIRECT"
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.buffers = [aligned_buffer(chunks.nbytes) for _ in range(batch)]
        self.pool = ThreadPoolExecutor(batch, thread_name_prefix="raw-disk")

    def path(self, number: int) -> Path:
        return self.directory / f"{number}.chunk"

    def _write(self, number: int, slot: int) -> None:
        memory, tensor = self.buffers[slot]
        self.chunks.fill(tensor, number)
        fd = os.open(self.path(number), os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_DIRECT)
        try:
            view, done = memoryview(memory), 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], done)
        finally:
            os.close(fd)

    def _read(self, number: int, slot: int) -> torch.Tensor:
        memory, tensor = self.buffers[slot]
        fd = os.open(self.path(number), os.O_RDONLY | os.O_DIRECT)
        try:
            view, done = memoryview(memory), 0
            while done < len(view):
                got = os.preadv(fd, [view[done:]], done)
                if got == 0:
                    raise RuntimeError(f"raw O_DIRECT: {self.path(number)} is short")
                done += got
        finally:
            os.close(fd)
        return tensor

    def store(self, numbers: Sequence[int]) -> None:
        if len(numbers) == 1:
            self._write(numbers[0], 0)
        else:
            list(self.pool.map(self._write, numbers, range(len(numbers))))

    def retrieve(self, numbers: Sequence[int]) -> list[torch.Tensor]:
        if len(numbers) == 1:
            return [self._read(numbers[0], 0)]
        return list(self.pool.map(self._read, numbers, range(len(numbers))))

    def clear(self, numbers: Sequence[int]) -> None:
        for number in numbers:
            self.path(number).unlink()

    def close(self) -> None:
        self.pool.shutdown()


class RawRedisPySide(Side):
    """redis-py's synchronous client: ``SET``/``GET``, pipelines for a batch."""

    group = "raw"

    def __init__(self, chunks: Chunks, batch: int, port: int) -> None:
        super().__init__(chunks)
        self.name = "raw redis-py"
        self.client = redis.Redis(host="127.0.0.1", port=port)
        self.staging = [byte_buffer(chunks.nbytes) for _ in range(batch)]
        self._values: list[Any] = []

    def store(self, numbers: Sequence[int]) -> None:
        for number, (_, tensor) in zip(numbers, self.staging, strict=False):
            self.chunks.fill(tensor, number)
        if len(numbers) == 1:
            self.client.set(f"raw:{numbers[0]}", self.staging[0][0])
            return
        pipe = self.client.pipeline(transaction=False)
        for number, (view, _) in zip(numbers, self.staging, strict=False):
            pipe.set(f"raw:{number}", view)
        pipe.execute()

    def retrieve(self, numbers: Sequence[int]) -> list[torch.Tensor]:
        if len(numbers) == 1:
            values = [self.client.get(f"raw:{numbers[0]}")]
        else:
            pipe = self.client.pipeline(transaction=False)
            for number in numbers:
                pipe.get(f"raw:{number}")
            values = pipe.execute()
        if any(value is None for value in values):
            raise RuntimeError(f"raw redis-py missed one of {list(numbers)}")
        self._values = values
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only bytes; only compared
            return [torch.frombuffer(value, dtype=torch.uint8) for value in values]

    def release(self) -> None:
        self._values = []

    def clear(self, numbers: Sequence[int]) -> None:
        pass  # the server is flushed between sides

    def close(self) -> None:
        self.client.close()


class RespConnection:
    """One plain socket speaking RESP, written by hand: ``SET`` sends the payload straight
    from the caller's buffer, ``GET`` reads it straight into one."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    @staticmethod
    def command(*parts: bytes, payload_len: int | None = None) -> bytes:
        count = len(parts) + (payload_len is not None)
        head = [f"*{count}\r\n".encode()]
        head += [b"$%d\r\n%s\r\n" % (len(part), part) for part in parts]
        if payload_len is not None:
            head.append(b"$%d\r\n" % payload_len)
        return b"".join(head)

    def line(self) -> bytes:
        """One reply line, consumed without reading past it."""
        peeked = self.sock.recv(128, socket.MSG_PEEK)
        end = peeked.find(b"\r\n")
        while end < 0:
            if not peeked:
                raise ConnectionError("raw socket: the server closed the connection")
            peeked = self.sock.recv(len(peeked) + 128, socket.MSG_PEEK)
            end = peeked.find(b"\r\n")
        line = self.sock.recv(end + 2)
        while len(line) < end + 2:
            line += self.sock.recv(end + 2 - len(line))
        return line[:-2]

    def fill(self, view: memoryview) -> None:
        done = 0
        while done < len(view):
            got = self.sock.recv_into(view[done:])
            if got == 0:
                raise ConnectionError("raw socket: the server closed the connection")
            done += got

    def set_all(self, items: Sequence[tuple[bytes, memoryview]]) -> None:
        """``SET`` each (key, payload), pipelined, then check every reply."""
        for key, view in items:
            self.sock.sendall(self.command(b"SET", key, payload_len=len(view)))
            self.sock.sendall(view)
            self.sock.sendall(b"\r\n")
        for key, _ in items:
            reply = self.line()
            if reply != b"+OK":
                raise RuntimeError(f"raw socket: SET {key!r} answered {reply!r}")

    def get_all(self, items: Sequence[tuple[bytes, memoryview]]) -> None:
        """``GET`` each key into its buffer, pipelined."""
        self.sock.sendall(b"".join(self.command(b"GET", key) for key, _ in items))
        for key, view in items:
            head = self.line()
            if head != b"$%d" % len(view):
                raise RuntimeError(f"raw socket: GET {key!r} answered {head!r}")
            self.fill(view)
            self.fill(memoryview(bytearray(2)))

    def close(self) -> None:
        self.sock.close()


class RawSocketSide(Side):
    """Hand-written RESP on plain sockets from and into preallocated buffers: a batch goes
    pipelined on one connection, or spread over ``connections`` of them (one thread each)."""

    group = "raw"

    def __init__(self, chunks: Chunks, batch: int, port: int, connections: int = 1) -> None:
        super().__init__(chunks)
        self.name = "raw socket" if connections == 1 else f"raw socket x{connections}"
        self.connections = [RespConnection(port) for _ in range(connections)]
        self.pool = ThreadPoolExecutor(connections, thread_name_prefix="raw-socket")
        buffers = [byte_buffer(chunks.nbytes) for _ in range(batch)]
        self.views = [view for view, _ in buffers]
        self.buffers = [tensor for _, tensor in buffers]

    def _spread(
        self, numbers: Sequence[int], work: Callable[[RespConnection, list[Any]], None]
    ) -> None:
        items = [(f"raw:{n}".encode(), view) for n, view in zip(numbers, self.views, strict=False)]
        shares = [
            (connection, items[i :: len(self.connections)])
            for i, connection in enumerate(self.connections)
            if items[i :: len(self.connections)]
        ]
        if len(shares) == 1:
            work(*shares[0])
        else:
            list(self.pool.map(lambda share: work(*share), shares))

    def store(self, numbers: Sequence[int]) -> None:
        for number, buffer in zip(numbers, self.buffers, strict=False):
            self.chunks.fill(buffer, number)
        self._spread(numbers, RespConnection.set_all)

    def retrieve(self, numbers: Sequence[int]) -> list[torch.Tensor]:
        self._spread(numbers, RespConnection.get_all)
        return self.buffers[: len(numbers)]

    def clear(self, numbers: Sequence[int]) -> None:
        pass  # the server is flushed between sides

    def close(self) -> None:
        self.pool.shutdown()
        for connection in self.connections:
            connection.close()


# -- the passes ----------------------------------------------------------------------------------


@dataclass
class Times:
    """Seconds of each timed pass, per (variant, operation), and the server's CPU seconds over
    each pass's retrieves where the path has a server process."""

    passes: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    server: dict[tuple[str, str], list[float]] = field(default_factory=dict)

    def add(self, variant: str, operation: str, seconds: float, server_s: float | None) -> None:
        self.passes.setdefault((variant, operation), []).append(seconds)
        if server_s is not None:
            self.server.setdefault((variant, operation), []).append(server_s)


ServerCPU = Callable[[], float]


def cpu_seconds_of(pid: int) -> ServerCPU:
    """A function giving the user + system CPU seconds that process ``pid`` has used so far."""
    process = psutil.Process(pid)

    def seconds() -> float:
        times = process.cpu_times()
        return float(times.user + times.system)

    return seconds


def one_pass(
    side: Side, count: int, batch: int, after: Callable[[], None], server_cpu: ServerCPU | None
) -> tuple[float, float, float | None]:
    """Store ``count`` chunks under fresh keys, ``batch`` a call, then retrieve and check
    them; (store seconds, retrieve seconds), each the sum of the calls alone, and the server's
    CPU seconds over the retrieves and checks (None without a server)."""
    first = next(_key_numbers)
    numbers = list(range(first * 100_000, first * 100_000 + count))
    groups = [numbers[i : i + batch] for i in range(0, count, batch)]
    store_s = retrieve_s = 0.0
    for group in groups:
        start = time.perf_counter()
        side.store(group)
        store_s += time.perf_counter() - start
    server_start = server_cpu() if server_cpu else 0.0
    for group in groups:
        start = time.perf_counter()
        got = side.retrieve(group)
        retrieve_s += time.perf_counter() - start
        try:
            if len(got) != len(group):
                raise RuntimeError(f"{side.name}: {len(got)} chunks for {len(group)} keys")
            for view, number in zip(got, group, strict=True):
                side.chunks.check(view, number, side.name)
        finally:
            side.release()
    server_s = server_cpu() - server_start if server_cpu else None
    side.clear(numbers)
    after()
    return store_s, retrieve_s, server_s


def measure(
    sides: list[Side],
    count: int,
    args: argparse.Namespace,
    after: Callable[[], None],
    server_cpu: ServerCPU | None,
) -> dict[str, Times]:
    """Warm each side, then ``--repeat`` rounds of one pass per side and variant, the order
    of the sides rotating between rounds."""
    batch_of = {"per-op": 1, "batch": args.batch}
    for side in sides:
        one_pass(side, count, args.batch, after, None)
        one_pass(side, min(count, args.batch), 1, after, None)
    times = {side.name: Times() for side in sides}
    for round_index in range(args.repeat):
        shift = round_index % len(sides)
        order = sides[shift:] + sides[:shift]
        for variant in VARIANTS:
            for side in order:
                store_s, retrieve_s, server_s = one_pass(
                    side, count, batch_of[variant], after, server_cpu
                )
                times[side.name].add(variant, "store", store_s, None)
                times[side.name].add(variant, "retrieve", retrieve_s, server_s)
    return times


def chunk_count(chunks: Chunks, args: argparse.Namespace) -> int:
    """Chunks a pass: about ``--gib``, a whole number of batches."""
    batches = max(1, round(float(args.gib) * (1 << 30) / chunks.nbytes / int(args.batch)))
    return batches * int(args.batch)


def rows_of(path: str, chunks: Chunks, count: int, times: dict[str, Times]) -> list[dict[str, Any]]:
    rows = []
    for variant in VARIANTS:
        for operation in OPERATIONS:
            key = (variant, operation)
            mb_s = {
                name: count * chunks.nbytes / statistics.median(t.passes[key]) / 1e6
                for name, t in times.items()
            }
            row: dict[str, Any] = {
                "path": path,
                "chunk": chunks.name,
                "chunks": count,
                "variant": variant,
                "operation": operation,
                "mb_s": mb_s,
                "pass_mb_s": {
                    name: [count * chunks.nbytes / seconds / 1e6 for seconds in t.passes[key]]
                    for name, t in times.items()
                },
            }
            # Retrieves only (one_pass measures no more): every side's GETs ask the server for
            # the same work, where its CPU for stores depends on how each client's sends arrive.
            if all(key in t.server for t in times.values()):
                gib = count * chunks.nbytes / (1 << 30)
                row["server_s_per_gib"] = {
                    name: [seconds / gib for seconds in t.server[key]] for name, t in times.items()
                }
            rows.append(row)
    return rows


def finish_rows(rows: list[dict[str, Any]], groups: dict[str, str]) -> None:
    """Add the best LMCache option, the best raw and kvplug's ratios to each row."""
    for row in rows:
        mb_s = row["mb_s"]
        best = {
            group: max((name for name in mb_s if groups[name] == group), key=mb_s.__getitem__)
            for group in ("lmcache", "raw")
        }
        row["best_lmcache"], row["best_raw"] = best["lmcache"], best["raw"]
        row["vs_lmcache"] = mb_s["kvplug"] / mb_s[best["lmcache"]]
        row["vs_raw"] = mb_s["kvplug"] / mb_s[best["raw"]]
        # The same ratios taken per round (passes of one round run back to back), median: less
        # sensitive to the machine's bandwidth drifting between rounds.
        passes = row["pass_mb_s"]
        for group, label in (("lmcache", "paired_vs_lmcache"), ("raw", "paired_vs_raw")):
            peers = [name for name in passes if groups[name] == group]
            row[label] = statistics.median(
                ours / max(passes[name][round_index] for name in peers)
                for round_index, ours in enumerate(passes["kvplug"])
            )
        if "server_s_per_gib" in row:
            add_server_cost(row, groups)
        row["below_target"] = [
            what
            for what, ratio, target in (
                ("vs LMCache", row["vs_lmcache"], TARGET_VS_LMCACHE),
                ("vs raw", row["vs_raw"], TARGET_VS_RAW),
            )
            if ratio < target
        ]


def add_server_cost(row: dict[str, Any], groups: dict[str, str]) -> None:
    """Which passes ran while the server worked at its usual cost, and kvplug's ratio to the
    best raw over those passes alone.

    On a virtual machine the server's CPU time for the same requests can double for a while
    (docs/benchmarks.md: its page faults cost more when the host has to back the pages), which
    slows whichever side is running then. A pass counts as at the usual cost when the server's
    CPU seconds per GiB stayed within ``SLOW_SERVER`` of the row's lowest.
    """
    cost = row["server_s_per_gib"]
    floor = min(min(passes) for passes in cost.values())
    usual = {
        name: [
            mb_s
            for mb_s, seconds in zip(row["pass_mb_s"][name], cost[name], strict=True)
            if seconds <= SLOW_SERVER * floor
        ]
        for name in cost
    }
    row["usual_server_passes"] = {name: len(passes) for name, passes in usual.items()}
    raw = [
        statistics.median(passes)
        for name, passes in usual.items()
        if groups[name] == "raw" and passes
    ]
    row["usual_server_vs_raw"] = (
        statistics.median(usual["kvplug"]) / max(raw) if usual["kvplug"] and raw else None
    )


def print_rows(rows: list[dict[str, Any]], names: list[str]) -> None:
    print(
        f"{'path':<6} {'chunk':<7} {'variant':<7} {'op':<8} "
        + " ".join(f"{name:>15}" for name in names)
        + f" {'vs LMCache':>11} {'vs raw':>7}"
    )
    for row in rows:
        cells = " ".join(f"{row['mb_s'][name]:>15.0f}" for name in names)
        flag = f"  below target ({', '.join(row['below_target'])})" if row["below_target"] else ""
        print(
            f"{row['path']:<6} {row['chunk']:<7} {row['variant']:<7} {row['operation']:<8} "
            f"{cells} {row['vs_lmcache']:>10.2f}x {row['vs_raw']:>6.2f}x{flag}",
            flush=True,
        )
    for row in rows:
        if "server_s_per_gib" not in row:
            continue
        usual = row["usual_server_passes"]
        costs = ", ".join(
            f"{name} {statistics.median(cost):.2f} ({usual[name]}/{len(cost)})"
            for name, cost in row["server_s_per_gib"].items()
        )
        ratio = row["usual_server_vs_raw"]
        print(
            f"  {row['variant']} {row['operation']}: server CPU s/GiB, median (passes at its usual "
            f"cost): {costs}; kvplug vs raw over those: "
            + (f"{ratio:.2f}x" if ratio is not None else "no such pass of kvplug or raw")
        )


# -- the paths -----------------------------------------------------------------------------------


def run_cpu(chunks: Chunks, count: int, args: argparse.Namespace) -> list[Side]:
    size = chunks.nbytes * (count + 2 * args.batch) + 64 * MiB
    return [
        KvplugSide(chunks, f"cpu://?max_size={size}", args.batch, copy_out=True),
        LMCacheCPUSide(chunks, count, args.batch),
        RawCPUSide(chunks, count, args.batch),
    ]


def check_o_direct(side: Side) -> None:
    """Fail unless kvplug's file:// used O_DIRECT, as the other disk sides do."""
    assert isinstance(side, KvplugSide)
    directories = getattr(side.client.backend, "directories", [])
    if not directories or not all(directory.o_direct for directory in directories):
        raise RuntimeError(f"kvplug file:// did not use O_DIRECT: {directories}")


def run_path(
    path: str, chunks: Chunks, args: argparse.Namespace, base: Path
) -> tuple[list[dict[str, Any]], list[str]]:
    count = chunk_count(chunks, args)
    sides: list[Side] = []
    server: RedisServer | None = None
    after: Callable[[], None] = lambda: None  # noqa: E731
    server_cpu: ServerCPU | None = None
    try:
        if path == "cpu":
            sides = run_cpu(chunks, count, args)
        elif path == "disk":
            staging = FreeListAllocator(chunks.nbytes * 4 * args.batch + 64 * MiB, pin=False)
            directory = Path(tempfile.mkdtemp(prefix=f"{chunks.layers}-", dir=base))
            disk_max = chunks.nbytes * (count + 2 * args.batch) + 64 * MiB
            sides.append(
                KvplugSide(
                    chunks,
                    f"file://{directory / 'kvplug'}?max_size={disk_max}&workers={args.batch}",
                    args.batch,
                    allocator=staging,
                )
            )
            sides.append(
                LMCacheDiskSide(
                    chunks, count, args.batch, 2 * args.repeat + 2, directory / "lmcache"
                )
            )
            sides.append(RawDiskSide(chunks, args.batch, directory / "raw"))
        elif path == "redis":
            # LMCache's redis:// keeps a metadata key beside each chunk; room for one pass.
            maxmemory = chunks.nbytes * (count + 2 * args.batch) * 5 // 4 + 256 * MiB
            server = RedisServer(maxmemory=maxmemory, policy="noeviction")
            server.start()
            control = server.client()
            staging = FreeListAllocator(chunks.nbytes * 4 * args.batch + 64 * MiB, pin=False)

            def flush() -> None:
                control.flushall()

            after = flush
            server_cpu = cpu_seconds_of(int(control.info()["process_id"]))
            sides.append(KvplugSide(chunks, server.url, args.batch, allocator=staging))
            sides.append(LMCacheRemoteSide(chunks, args.batch, "redis", server.port))
            sides.append(LMCacheRemoteSide(chunks, args.batch, "resp", server.port))
            sides.append(RawRedisPySide(chunks, args.batch, server.port))
            sides.append(RawSocketSide(chunks, args.batch, server.port))
            sides.append(RawSocketSide(chunks, args.batch, server.port, args.batch))
        else:
            raise SystemExit(f"unknown path {path!r}; the paths are cpu, disk, redis")
        times = measure(sides, count, args, after, server_cpu)
        if path == "disk":
            check_o_direct(sides[0])
        rows = rows_of(path, chunks, count, times)
        finish_rows(rows, {side.name: side.group for side in sides})
        return rows, [side.name for side in sides]
    finally:
        for side in sides:
            side.close()
        if server is not None:
            server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--paths", default="cpu,disk,redis")
    parser.add_argument("--gib", type=float, default=2.0, help="GiB a pass (whole batches)")
    parser.add_argument("--repeat", type=int, default=3, help="timed passes per side")
    parser.add_argument("--batch", type=int, default=8, help="chunks a batched call")
    parser.add_argument("--layers", default="32,24", help="L of the [2, L, 256, 1024] chunks")
    parser.add_argument("--dir", default=None, help="where the disk path writes (default: tmp)")
    parser.add_argument("--json", action="store_true", help="also print the rows as JSON")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch's intra-op threads for the engine's copies (default: 1 on the redis path, "
        "torch's own elsewhere; see the docstring)",
    )
    args = parser.parse_args()
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    layers = [int(n) for n in args.layers.split(",")]
    redis_server = shutil.which("redis-server")
    print(
        f"kvplug {version('kvplug')}, lmcache {version('lmcache')}, torch {torch.__version__}, "
        f"redis-py {redis.__version__}, {redis_server}; {args.gib} GiB a pass, "
        f"{args.repeat} passes per side and variant, batches of {args.batch}, alternating; "
        f"MB/s of the median pass; targets: >= {TARGET_VS_LMCACHE} of LMCache's best option, "
        f">= {TARGET_VS_RAW} of the best raw",
        flush=True,
    )
    everything: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(
        prefix="kvplug-bench-peer-", dir=args.dir, ignore_cleanup_errors=True
    ) as base:
        default_threads = torch.get_num_threads()
        for path in paths:
            threads = args.torch_threads or (1 if path == "redis" else default_threads)
            torch.set_num_threads(threads)
            print(f"{path}: the engine's copies on {threads} torch thread(s)", flush=True)
            for layer_count in layers:
                chunks = Chunks(layer_count)
                rows, names = run_path(path, chunks, args, Path(base))
                print()
                print_rows(rows, names)
                everything.extend(rows)
    if args.json:
        print(json.dumps(everything))


if __name__ == "__main__":
    main()
