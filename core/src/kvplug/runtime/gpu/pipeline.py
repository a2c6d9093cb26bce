"""Pipelined offload and load between an engine's paged KV cache and a kvplug store.

:func:`offload` stores the tokens of a slot mapping as chunks under their keys; :func:`load`
reads the chunks of a list of keys back into the cache, up to the first missing one. Both
overlap the copies on the GPU with the store's own work:

* offload: the gather of chunk ``i + 1`` runs on a CUDA side stream, into a pinned host chunk
  allocated from the store's allocator (so ``cpu://`` keeps it without a copy), while the put
  of chunk ``i`` runs. A put starts only once its gather's CUDA event has completed: a backend
  is never handed memory that a copy is still writing.
* load: the get of chunk ``i + 1`` runs while chunk ``i`` is scattered on the side stream, and a
  scatter starts only once its get has returned.

At most ``depth`` chunks (2 by default) are in flight at once: being copied, being stored, or
read and waiting for their scatter. On any error every copy already queued on the GPU is waited
for before its host memory is released, every object is released, and the error is raised.

Without CUDA (a cache in host memory) the same calls work through the pure-torch gather and
scatter, which copy at once: the results and the bounds are identical, and only a
``SyncClient``'s puts and gets still overlap the copies.

The store is a :class:`~kvplug.runtime.sync.SyncClient` (from an engine's worker thread; puts
and gets run as the client runs them, on its IO thread several at once) or an opened
:class:`~kvplug.backend.Backend`, which is then driven on the calling thread through a private
event loop (one operation at a time, still overlapping the GPU's copies); the calling thread
must not be running an event loop.

Example::

    >>> import torch
    >>> from kvplug import CacheKey
    >>> from kvplug.runtime.gpu import PagedKVCache, load, offload
    >>> from kvplug.runtime.sync import SyncClient
    >>> layers = [torch.randn(2, 8, 16, 4, 64).half() for _ in range(2)]
    >>> cache = PagedKVCache.vllm_flash(layers)
    >>> slots = torch.arange(16, 64)  # 48 tokens in blocks 1 to 3: 3 chunks of 16 tokens
    >>> keys = [CacheKey("demo", 1, 0, h) for h in (11, 12, 13)]
    >>> before = layers[1].clone()
    >>> with SyncClient("cpu://?max_size=16MiB") as client:
    ...     offload(cache, slots, keys, client, chunk_tokens=16)
    ...     _ = [layer.zero_() for layer in layers]
    ...     loaded = load(cache, slots, keys, client, chunk_tokens=16)
    ...     partly = load(cache, slots, [keys[0], CacheKey("demo", 1, 0, 99), keys[2]], client,
    ...                   chunk_tokens=16)
    >>> loaded, partly, torch.equal(layers[1][:, 1:4], before[:, 1:4])
    (3, 1, True)
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import inspect
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from kvplug.backend import Backend
from kvplug.errors import CapacityExceeded, ConfigError
from kvplug.keys import DEFAULT_CHUNK_SIZE, CacheKey
from kvplug.memory import MemoryFormat, MemoryObj
from kvplug.runtime.gpu.layouts import PagedKVCache
from kvplug.runtime.gpu.ops import Impl, _slice_slots, gather, scatter
from kvplug.runtime.sync import Finished, SyncClient, new_io_loop

DEFAULT_DEPTH = 2
"""Chunks in flight by default: one being copied on the GPU while one is stored or read."""

logger = logging.getLogger("kvplug.gpu")

_streams: dict[torch.device, torch.cuda.Stream] = {}
_streams_lock = threading.Lock()

Allocate = Callable[[Sequence[int], torch.dtype, MemoryFormat], MemoryObj | None]


def offload(
    cache: PagedKVCache,
    slot_mapping: torch.Tensor,
    keys: Sequence[CacheKey],
    store: SyncClient | Backend,
    *,
    chunk_tokens: int = DEFAULT_CHUNK_SIZE,
    depth: int = DEFAULT_DEPTH,
    impl: Impl = "auto",
    validate: bool = True,
    stream: torch.cuda.Stream | None = None,
) -> None:
    """Store the tokens of ``slot_mapping`` from ``cache`` as chunks under ``keys``.

    Chunk ``i`` holds tokens ``i * chunk_tokens`` up to ``(i + 1) * chunk_tokens`` of the
    mapping (the last one may be shorter), gathered as by :func:`kvplug.runtime.gpu.gather` into
    a ``cache.chunk_shape(n)`` object in the cache's dtype and ``cache.memory_format``, and put
    under ``keys[i]``. There must be exactly one key per chunk.

    Contract:

    * When ``offload`` returns, every chunk is stored (a ``get`` finds it) and kvplug holds no
      memory of this call beyond what the store keeps.
    * On a CUDA cache the gathers start after the work queued so far on the caller's current
      stream (the forward pass that wrote the KV) and run on ``stream`` (by default one side
      stream per device, shared by all calls), so the caller's stream is never blocked. The
      cache's slots must not be overwritten until ``offload`` returns.
    * A put is issued only after its chunk's gather has completed; at most ``depth`` chunks are
      gathered or being stored at once.
    * Host chunks come from the store's memory: a ``cpu://`` tier's (or a Store's budget,
      which evicts by policy to make room) else the backend's allocator. No room raises
      :class:`~kvplug.errors.CapacityExceeded`.
    * Errors (a failing put, no memory, a bad argument) are raised after every queued copy has
      finished, every put in flight has returned and every object of this call is released.
      Chunks whose put completed stay stored; the error carries a note saying how far it got.

    Args:
        cache: the engine's paged cache.
        slot_mapping: 1-D int64 or int32 slots of the tokens, on the CPU or the cache's device;
            negative slots are not read (their rows of the chunk are undefined).
        keys: one key per chunk, in token order.
        store: a :class:`~kvplug.runtime.sync.SyncClient`, or an opened backend (see the module
            docs).
        chunk_tokens: tokens per chunk (256 by default, kvplug's and LMCache's chunk size).
        depth: chunks in flight, at least 1 (1: no overlap).
        impl: ``"auto"``, ``"torch"`` or ``"cuda"``, as for :func:`kvplug.runtime.gpu.gather`.
        validate: check once that no slot is past the cache's end (for a mapping on the GPU one
            device sync); with ``False`` the caller guarantees it.
        stream: the CUDA stream to copy on; ignored for a cache in host memory.

    Example::

        >>> import torch
        >>> from kvplug import CacheKey
        >>> from kvplug.runtime.gpu import PagedKVCache, offload
        >>> from kvplug.runtime.sync import SyncClient
        >>> cache = PagedKVCache.mla([torch.ones(4, 16, 32) for _ in range(3)])
        >>> keys = [CacheKey("demo", 1, 0, 1), CacheKey("demo", 1, 0, 2)]
        >>> with SyncClient("cpu://?max_size=1MiB") as client:
        ...     offload(cache, torch.arange(20), keys, client, chunk_tokens=16)
        ...     second = client.get(keys[1]).result()
        ...     shape, total = second.shape, second.tensor.sum().item()
        ...     second.release()
        >>> shape, total
        ((1, 3, 4, 32), 384.0)
    """
    plan = _Plan.of(cache, slot_mapping, keys, chunk_tokens, depth, validate)
    if not plan.ranges:
        return
    window: deque[_Chunk] = deque()
    stored = 0
    with _driver(store) as driver:
        allocate = _allocator_of(driver.backend)
        copier = _Copier(cache, stream)
        try:
            for index, (start, end) in enumerate(plan.ranges):
                while len(window) >= depth:
                    stored += _advance_offload(window, driver, keys)
                obj = allocate(cache.chunk_shape(end - start), cache.dtype, cache.memory_format)
                if obj is None:
                    raise CapacityExceeded(
                        f"{driver.backend.url} has no memory for a chunk of {end - start} tokens "
                        f"({cache.row_bytes * cache.kv_planes * cache.num_layers * (end - start)}"
                        " bytes): its entries are pinned or being read. Raise its max_size (or "
                        "the Store's buffer_size), or lower depth."
                    )
                chunk = _Chunk(index, obj)
                window.append(chunk)
                chunk.event = copier.gather(plan.slots, obj, start, end, impl)
                _hand_over_finished(window, driver, keys)
            while window:
                stored += _advance_offload(window, driver, keys)
        except BaseException as error:
            _abandon(window)
            error.add_note(
                f"kvplug.gpu.offload stopped: {stored} of {len(plan.ranges)} chunks were stored "
                "for sure (others may be); nothing of this call is still in flight."
            )
            raise


def load(
    cache: PagedKVCache,
    slot_mapping: torch.Tensor,
    keys: Sequence[CacheKey],
    store: SyncClient | Backend,
    *,
    chunk_tokens: int = DEFAULT_CHUNK_SIZE,
    depth: int = DEFAULT_DEPTH,
    impl: Impl = "auto",
    validate: bool = True,
    stream: torch.cuda.Stream | None = None,
) -> int:
    """Read the chunks stored under ``keys`` into ``cache`` at the slots of ``slot_mapping``;
    return how many leading chunks were loaded.

    The reverse of :func:`offload`, with the same arguments and chunking: chunk ``i`` goes to
    tokens ``i * chunk_tokens`` up to ``(i + 1) * chunk_tokens`` of the mapping, as by
    :func:`kvplug.runtime.gpu.scatter` (negative slots are skipped).

    Contract:

    * The first missing key stops the load: chunks ``0 .. n - 1`` are loaded and ``n`` is
      returned; nothing from that key on is written to the cache (a get already issued for a
      later key is waited for and its object released).
    * When ``load`` returns, the loaded chunks are in the cache and visible to every stream,
      and kvplug holds no memory of this call.
    * On a CUDA cache the scatters wait for the work queued so far on the caller's current
      stream and run on ``stream``. A scatter starts only once its get has returned; at most
      ``depth`` chunks are being read or scattered at once.
    * A stored object whose shape or dtype is not the chunk's raises
      :class:`~kvplug.errors.ConfigError` (the keys belong to another model or layout).
    * Errors are raised after every queued scatter has finished, every get in flight has
      returned and every object is released; chunks before the failing one may already be in
      the cache. The error carries a note saying how many.

    Example::

        >>> import torch
        >>> from kvplug import CacheKey, MemoryObj
        >>> from kvplug.runtime.gpu import PagedKVCache, load
        >>> from kvplug.runtime.sync import SyncClient
        >>> k = [torch.zeros(64, 2, 8, dtype=torch.bfloat16)]
        >>> v = [torch.zeros(64, 2, 8, dtype=torch.bfloat16)]
        >>> cache = PagedKVCache.sglang(k, v)
        >>> keys = [CacheKey("demo", 1, 0, n) for n in range(2)]  # 6 tokens: 2 chunks of 4
        >>> with SyncClient("cpu://?max_size=1MiB") as client:
        ...     chunk = torch.full(cache.chunk_shape(4), 7.0, dtype=torch.bfloat16)
        ...     client.put(keys[0], MemoryObj.from_tensor(chunk)).result()
        ...     loaded = load(cache, torch.tensor([9, 3, 5, 1, 2, 8]), keys, client, chunk_tokens=4)
        >>> loaded, k[0][:, 0, 0].nonzero().flatten().tolist()
        (1, [1, 3, 5, 9])
    """
    plan = _Plan.of(cache, slot_mapping, keys, chunk_tokens, depth, validate)
    if not plan.ranges:
        return 0
    gets: deque[tuple[int, concurrent.futures.Future[MemoryObj | None]]] = deque()
    window: deque[_Chunk] = deque()
    loaded = 0
    with _driver(store) as driver:
        copier = _Copier(cache, stream)
        issued = 0
        try:
            gets.append((0, driver.get(keys[0])))
            issued = 1
            while gets:
                index, future = gets.popleft()
                obj = future.result()
                if obj is None:
                    break
                chunk = _Chunk(index, obj)
                window.append(chunk)
                start, end = plan.ranges[index]
                chunk.event = copier.scatter(obj, plan.slots, start, end, impl)
                loaded += 1
                _release_finished(window, block=False)
                if issued < len(plan.ranges):
                    while window and len(window) + len(gets) >= depth:
                        _release_finished(window, block=True)
                    while issued < len(plan.ranges) and len(window) + len(gets) < depth:
                        gets.append((issued, driver.get(keys[issued])))
                        issued += 1
            while window:
                _release_finished(window, block=True)
        except BaseException as error:
            _abandon(window)
            _drain(gets)
            error.add_note(
                f"kvplug.gpu.load stopped: {loaded} of {len(plan.ranges)} chunks had been "
                "queued into the cache; nothing of this call is still in flight."
            )
            raise
        _drain(gets)
    return loaded


# -- the plan ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    """The checked mapping, on the cache's device, and each chunk's token range."""

    slots: torch.Tensor
    ranges: list[tuple[int, int]]

    @classmethod
    def of(
        cls,
        cache: PagedKVCache,
        slot_mapping: torch.Tensor,
        keys: Sequence[CacheKey],
        chunk_tokens: int,
        depth: int,
        validate: bool,
    ) -> _Plan:
        if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
            raise ConfigError(
                f"chunk_tokens must be a positive int, got {chunk_tokens!r}; kvplug's chunks "
                f"are {DEFAULT_CHUNK_SIZE} tokens unless the engine says otherwise."
            )
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ConfigError(
                f"depth must be an int >= 1 (chunks in flight), got {depth!r}; "
                f"{DEFAULT_DEPTH} overlaps one copy with one store operation."
            )
        slots = _slice_slots(slot_mapping, 0, None, cache, validate)
        total = int(slots.shape[0])
        ranges = [(at, min(at + chunk_tokens, total)) for at in range(0, total, chunk_tokens)]
        if len(keys) != len(ranges):
            raise ConfigError(
                f"{len(keys)} keys for {total} tokens in chunks of {chunk_tokens}: that is "
                f"{len(ranges)} chunks, and each needs one key. Pass one key per chunk (for "
                "example kvplug.keys.chunk_keys of the tokens), or the slot mapping of just "
                "the tokens those keys cover."
            )
        for key in keys:
            if not isinstance(key, CacheKey):
                raise ConfigError(f"keys must be CacheKey objects, got {type(key).__name__}.")
        return cls(_on_device(slots, cache.device), ranges)


def _on_device(slots: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The slots as int64 on ``device``, copied once, without blocking on queued GPU work."""
    slots = slots.to(torch.int64)
    if device.type != "cuda" or slots.device == device:
        return slots.contiguous()
    if slots.device.type == "cpu":
        # A copy from pageable memory would wait for every stream; from pinned memory it is
        # queued on the current stream, which the side stream waits for.
        return slots.pin_memory().to(device, non_blocking=True)
    return slots.to(device)


# -- the store side ---------------------------------------------------------------------------


class _Driver(abc.ABC):
    """Issues puts and gets and hands back futures; :attr:`backend` is where memory comes from."""

    backend: Backend

    @abc.abstractmethod
    def put(self, key: CacheKey, obj: MemoryObj) -> concurrent.futures.Future[None]: ...

    @abc.abstractmethod
    def get(self, key: CacheKey) -> concurrent.futures.Future[MemoryObj | None]: ...

    def close(self) -> None:
        """Nothing to close by default."""


class _ClientDriver(_Driver):
    """Through a SyncClient: operations run as it runs them (on its IO thread, several at once)."""

    def __init__(self, client: SyncClient) -> None:
        self.client = client
        self.backend = client.backend

    def put(self, key: CacheKey, obj: MemoryObj) -> concurrent.futures.Future[None]:
        return self.client.put(key, obj)

    def get(self, key: CacheKey) -> concurrent.futures.Future[MemoryObj | None]:
        return self.client.get(key)


class _CallerThreadDriver(_Driver):
    """A backend driven on the calling thread: each operation runs to its end when issued (the
    GPU's queued copies go on meanwhile) and comes back as a finished future."""

    def __init__(self, backend: Backend) -> None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise ConfigError(
                "kvplug.gpu offload/load got a Backend on a thread that runs an event loop, "
                "and it drives the backend on the calling thread. Call it from a worker thread "
                "(await asyncio.to_thread(offload, ...)) or pass a kvplug.runtime.sync.SyncClient."
            )
        self.backend = backend
        self.loop, self.executor = new_io_loop()

    def _run(self, coroutine: Any) -> concurrent.futures.Future[Any]:
        try:
            return Finished(self.loop.run_until_complete(coroutine))
        except Exception as error:
            return Finished(exception=error)

    def put(self, key: CacheKey, obj: MemoryObj) -> concurrent.futures.Future[None]:
        return self._run(self.backend.put(key, obj))

    def get(self, key: CacheKey) -> concurrent.futures.Future[MemoryObj | None]:
        return self._run(self.backend.get(key))

    def close(self) -> None:
        from kvplug.runtime.sync import close_io_loop

        close_io_loop(self.loop, self.executor)


@contextmanager
def _driver(store: SyncClient | Backend) -> Iterator[_Driver]:
    from kvplug.runtime.sync import SyncClient

    driver: _Driver
    if isinstance(store, SyncClient):
        driver = _ClientDriver(store)
    elif isinstance(store, Backend):
        driver = _CallerThreadDriver(store)
    else:
        raise ConfigError(
            f"store must be a kvplug.runtime.sync.SyncClient or an opened kvplug Backend, got "
            f"{type(store).__name__}. Open one with SyncClient('cpu://') or "
            "kvplug.runtime.engine.open_client(...)."
        )
    try:
        yield driver
    finally:
        driver.close()


def _allocator_of(backend: Backend) -> Allocate:
    """Where chunks come from: memory the store keeps without a copy, evicting to make room."""
    from kvplug.runtime.store import Store

    allocate = getattr(backend, "allocate", None)
    # A Store's allocate belongs to its event loop; its budget evicts through the same policy.
    if (
        isinstance(backend, Store)
        or not callable(allocate)
        or inspect.iscoroutinefunction(allocate)
    ):
        return backend.allocator.allocate
    return allocate  # type: ignore[no-any-return]


# -- the GPU side -----------------------------------------------------------------------------


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One copy stream per device, made on first use."""
    with _streams_lock:
        stream = _streams.get(device)
        if stream is None:
            stream = _streams[device] = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        return stream


class _Copier:
    """Queues gathers and scatters on the side stream and returns their completion events; on a
    host cache copies at once and returns ``None``."""

    def __init__(self, cache: PagedKVCache, stream: torch.cuda.Stream | None) -> None:
        self.cache = cache
        self.stream: torch.cuda.Stream | None = None
        if cache.device.type == "cuda":
            self.stream = stream if stream is not None else _side_stream(cache.device)
            self.stream.wait_stream(torch.cuda.current_stream(cache.device))

    def gather(
        self, slots: torch.Tensor, obj: MemoryObj, start: int, end: int, impl: Impl
    ) -> torch.cuda.Event | None:
        if self.stream is None:
            gather(self.cache, slots, obj, start=start, end=end, impl=impl, validate=False)
            return None
        with torch.cuda.stream(self.stream):
            gather(
                self.cache,
                slots,
                obj,
                start=start,
                end=end,
                impl=impl,
                synchronize=False,
                validate=False,
            )
            return self._recorded()

    def scatter(
        self, obj: MemoryObj, slots: torch.Tensor, start: int, end: int, impl: Impl
    ) -> torch.cuda.Event | None:
        if self.stream is None:
            scatter(obj, self.cache, slots, start=start, end=end, impl=impl, validate=False)
            return None
        with torch.cuda.stream(self.stream):
            scatter(
                obj,
                self.cache,
                slots,
                start=start,
                end=end,
                impl=impl,
                synchronize=False,
                validate=False,
            )
            return self._recorded()

    def _recorded(self) -> torch.cuda.Event:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self.stream)
        return event


# -- chunks in flight -------------------------------------------------------------------------


@dataclass(eq=False)
class _Chunk:
    """One chunk in flight. ``obj`` is this call's reference (``None`` once handed to a put);
    ``event`` completes when the GPU copy is done (``None``: done, or no GPU); ``future`` is
    the put's."""

    index: int
    obj: MemoryObj | None
    event: torch.cuda.Event | None = None
    future: concurrent.futures.Future[None] | None = None

    def copied(self) -> bool:
        return self.event is None or bool(self.event.query())  # type: ignore[no-untyped-call]

    def wait_copy(self) -> None:
        if self.event is not None:
            self.event.synchronize()
            self.event = None


def _hand_over(chunk: _Chunk, driver: _Driver, keys: Sequence[CacheKey]) -> None:
    """Issue the put of a chunk whose copy is done and drop this call's reference."""
    chunk.wait_copy()
    obj = chunk.obj
    assert obj is not None
    chunk.future = driver.put(keys[chunk.index], obj)  # the put holds a reference of its own
    chunk.obj = None
    obj.release()


def _hand_over_finished(window: deque[_Chunk], driver: _Driver, keys: Sequence[CacheKey]) -> None:
    """Issue the puts of the oldest chunks whose copies are done, in order, without waiting.

    Only for a store whose puts run elsewhere: on the calling thread a put would be run now,
    ahead of making room for the next gather."""
    if not isinstance(driver, _ClientDriver):
        return
    for chunk in window:
        if chunk.obj is None:
            continue
        if not chunk.copied():
            return
        _hand_over(chunk, driver, keys)


def _advance_offload(window: deque[_Chunk], driver: _Driver, keys: Sequence[CacheKey]) -> int:
    """Move the oldest chunk one step: put it once copied, or wait for its put (returns 1 when
    that put is done, raising its error)."""
    chunk = window[0]
    if chunk.obj is not None:
        _hand_over(chunk, driver, keys)
        return 0
    window.popleft()
    assert chunk.future is not None
    chunk.future.result()
    return 1


def _release_finished(window: deque[_Chunk], *, block: bool) -> None:
    """Release the objects of the oldest chunks whose scatters are done (with ``block``, at
    least the oldest one, waiting for it)."""
    while window and (block or window[0].copied()):
        chunk = window.popleft()
        chunk.wait_copy()
        if chunk.obj is not None:
            chunk.obj.release()
            chunk.obj = None
        block = False


def _abandon(window: deque[_Chunk]) -> None:
    """After an error: wait for every queued copy, release every object, wait for every put."""
    while window:
        chunk = window.popleft()
        try:
            chunk.wait_copy()
        except Exception:
            # The device failed: the copy may still write the memory, so it is not released.
            logger.exception(
                "kvplug.gpu: waiting for the copy of chunk %d failed; its host memory is kept "
                "out of use rather than released under a copy that may still write it",
                chunk.index,
            )
            continue
        if chunk.obj is not None:
            chunk.obj.release()
            chunk.obj = None
        if chunk.future is not None:
            concurrent.futures.wait([chunk.future])


def _drain(gets: deque[tuple[int, concurrent.futures.Future[MemoryObj | None]]]) -> None:
    """Wait for gets issued ahead and release what they found."""
    while gets:
        _, future = gets.popleft()
        concurrent.futures.wait([future])
        if future.cancelled() or future.exception() is not None:
            continue
        obj = future.result()
        if obj is not None:
            obj.release()


__all__ = ["DEFAULT_DEPTH", "load", "offload"]
