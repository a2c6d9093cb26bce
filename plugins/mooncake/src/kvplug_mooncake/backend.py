"""``mooncakestore://master-host:port``: objects in a Mooncake Store, moved zero-copy.

Mooncake Store keeps objects in memory that its clients lend (segments) and finds them
through a master (``mooncake_master``). This backend is one such client
(``mooncake.store.MooncakeDistributedStore``), on the store's zero-copy calls:

* At open it registers the memory objects live in with Mooncake once: the buffer of the
  backend's allocator (a :class:`~kvplug.memory.FreeListAllocator`) and a small slab of its
  own for frame headers. Memory outside them (an object wrapped around an engine's tensor) is
  registered for the one call that moves it, and never copied.
* Each object is one Mooncake object: a kvplug frame header (shape, dtype, checksums) followed
  by the payload. A put gathers the header from the slab and the payload from the object's
  own memory (``batch_put_from_multi_buffers``); a ``get_into`` scatters them back into a
  header slot and the caller's memory (``batch_get_into_multi_buffers``); a ``get`` reads the
  whole value into one allocator block and returns the payload in place
  (:meth:`~kvplug.memory.MemoryObj.reinterpret`).
* Overwrites replace (clause 3). Mooncake's put keeps the old value of an existing key and
  still returns 0, so a put asks first which keys exist (``batch_is_exist``) and overwrites
  those with ``batch_upsert_from``, which needs header and payload side by side: an overwrite
  costs one copy of the object, a new key none.
* A ``remove`` refused because a reader holds the key's lease (-706) is forced or waited out
  (``leased_remove``), never reported as done when nothing was removed. Every other code maps
  to a kvplug error that names it (:mod:`kvplug_mooncake.codes`).
* Mooncake's calls block, so they run on worker threads; each holds a reference to the
  objects whose memory it moves until it returns, also when a deadline stopped the wait.
* ``open`` checks, within ``connect_timeout``, that the master answers before Mooncake's
  ``setup`` meets it (``setup`` stalls the whole process, GIL held, 60-90 s against a master
  that does not answer), and that the installed wheel has the calls above, naming its
  version when one is missing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import importlib.metadata
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar
from urllib.parse import urlsplit

import torch
import xxhash

from kvplug.backend import Backend, Capabilities
from kvplug.damage import DamagedValues
from kvplug.errors import (
    BackendError,
    BackendUnavailable,
    ConfigError,
    CorruptObject,
    LayoutMismatch,
)
from kvplug.frame import (
    MAX_HEADER_LEN,
    Buffer,
    FrameHeader,
    decode_header,
    encode_header,
    header_len,
    payload_checksum,
    verify_payload,
)
from kvplug.keys import CacheKey
from kvplug.memory import FreeListAllocator, MemoryObj
from kvplug.options import BackendOptions
from kvplug.url import BackendURL
from kvplug_mooncake import codes
from kvplug_mooncake.options import MooncakeOptions, merged_settings

T = TypeVar("T")
K = TypeVar("K")
logger = logging.getLogger(__name__)

DISTRIBUTIONS = ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine")
REQUIRED_CALLS = (
    "setup",
    "register_buffer",
    "unregister_buffer",
    "batch_is_exist",
    "batch_put_from_multi_buffers",
    "batch_upsert_from",
    "batch_get_into",
    "batch_get_into_multi_buffers",
    "batch_get_replica_desc",
    "batch_remove",
    "remove",
    "close",
)
"""The calls of ``MooncakeDistributedStore`` this backend uses (0.3.10 and later have them)."""

PROBE = struct.pack("<BBBBIIII", 0xDE, 1, 0, 0, 0, 0, 0, 0)
"""A coro_rpc request header (Mooncake's RPC framework: magic 0xde, version 1) for function
id 0, which no master serves: it answers by closing the connection."""

GROUP_BYTES = 4 << 20
"""Bytes a batch moves per Mooncake call at least, when it moves several: one call per
KV chunk of a few MiB, whose checksum overlaps the transfer of the next."""

PIECE = 2 << 20
"""Bytes :func:`checksum` hashes between two chances for other threads to take the GIL."""

SLOT = 512
"""Bytes of one header slot: more than any naive frame header (128 for up to 8 dimensions)."""
HEADER_SLOTS = 4096
NAIVE_HEADER_LENS = tuple(sorted({header_len(ndim) for ndim in range(9)}))
"""The header lengths a naive frame can have (64 and 128 bytes)."""
LEASE_RETRY = 0.05
RECOVERY_WINDOW = 30.0
"""Seconds after the master was last unreachable during which a full store (-200) is taken
for one whose segments are being remounted (see :meth:`MooncakeBackend._error`)."""
RPC_TIMEOUT_VARIABLE = "MC_RPC_TIMEOUT_MS"
WRITE_WAIT = 2.0
"""Seconds a read waits for a value being written before it reads as a miss (a writer that
died mid-put leaves it hidden until the master discards the put, 30 s later)."""


def installed_version() -> str:
    """The installed Mooncake wheel and its version, such as
    ``mooncake-transfer-engine-non-cuda 0.3.13.post1``."""
    for name in DISTRIBUTIONS:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return f"{name} {importlib.metadata.version(name)}"
    return "mooncake (version unknown)"


def load_store_class() -> type[Any]:
    """``mooncake.store.MooncakeDistributedStore``, once it is known to have every call this
    backend uses; else :class:`~kvplug.errors.BackendUnavailable` naming the version."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as error:
        hint = (
            " Debian's libibverbs1 must be installed (apt-get install libibverbs1)."
            if "libibverbs" in str(error)
            else ""
        )
        raise BackendUnavailable(
            f"mooncakestore:// needs Mooncake's Python client, which does not import here "
            f"({error}).{hint} Install it: pip install 'kvplug-mooncake[client]' (the "
            "mooncake-transfer-engine-non-cuda wheel; mooncake-transfer-engine on CUDA hosts)."
        ) from None
    missing = [name for name in REQUIRED_CALLS if not hasattr(MooncakeDistributedStore, name)]
    doc = getattr(MooncakeDistributedStore.remove, "__doc__", "") or ""
    if "force" not in doc:
        missing.append("remove(key, force=...)")
    if missing:
        raise BackendUnavailable(
            f"the installed {installed_version()} lacks {', '.join(missing)}, which "
            "mooncakestore:// moves objects with (zero-copy batch calls, forced removal). "
            "Install mooncake-transfer-engine-non-cuda>=0.3.13."
        )
    store_class: type[Any] = MooncakeDistributedStore
    return store_class


@dataclass
class _Slot:
    """One header slot: registered memory a frame header is written to or read into."""

    obj: MemoryObj

    @property
    def ptr(self) -> int:
        return self.obj.data_ptr()

    def view(self, nbytes: int) -> memoryview:
        return self.obj.memoryview()[:nbytes]


class _Registrations:
    """Memory the store may move data from and into: regions registered for the backend's
    life (the allocator's buffer, the header slab), and other memory registered for the
    calls that move it (counted, so that concurrent calls over one region share it)."""

    def __init__(self, store: Any, url: BackendURL) -> None:
        self._store = store
        self._url = url
        self._lock = threading.Lock()
        self._fixed: list[tuple[int, int]] = []
        self._temporary: dict[int, list[int]] = {}
        self.temporary_registrations = 0
        """Calls that registered memory outside the fixed regions (none copied it)."""

    def register_fixed(self, ptr: int, size: int, what: str) -> None:
        code = self._store.register_buffer(ptr, size)
        if code != 0:
            raise BackendUnavailable(
                f"Mooncake could not register {what} ({size} bytes) for zero-copy transfers: "
                f"{codes.describe(code)}. With protocol=rdma, check the device and the locked "
                "memory limit (ulimit -l)."
            )
        self._fixed.append((ptr, size))

    def covers(self, ptr: int, size: int) -> bool:
        return any(start <= ptr and ptr + size <= start + length for start, length in self._fixed)

    @contextlib.contextmanager
    def holding(self, regions: Sequence[tuple[int, int]]) -> Iterator[None]:
        """Keep ``regions`` (pointer, size) registered while the block runs."""
        taken: list[int] = []
        try:
            for ptr, size in regions:
                if size == 0 or self.covers(ptr, size):
                    continue
                with self._lock:
                    entry = self._temporary.get(ptr)
                    if entry is not None and entry[0] >= size:
                        entry[1] += 1
                        taken.append(ptr)
                        continue
                    code = self._store.register_buffer(ptr, size)
                    if code != 0:
                        raise BackendUnavailable(
                            f"Mooncake could not register {size} bytes of memory outside the "
                            f"allocator for a transfer on {self._url}: {codes.describe(code)}. "
                            "Allocate objects from the backend's allocator."
                        )
                    self._temporary[ptr] = [size, 1]
                    self.temporary_registrations += 1
                    taken.append(ptr)
            yield
        finally:
            with self._lock:
                for ptr in taken:
                    entry = self._temporary[ptr]
                    entry[1] -= 1
                    if entry[1] == 0:
                        del self._temporary[ptr]
                        self._store.unregister_buffer(ptr)


def _host(obj: MemoryObj) -> MemoryObj:
    """``obj`` itself in host memory, or a host copy of a GPU object (Mooncake's CPU client
    moves host memory only)."""
    if obj.device.type == "cpu":
        return obj.retain()
    return MemoryObj.from_tensor(obj.tensor.cpu().contiguous(), obj.fmt)


def _is_damage_free_size_mismatch(code: int) -> bool:
    """A multi-buffer read whose buffers do not add up to the stored size: -600 (the value is
    larger) or -800 (smaller)."""
    return code in (codes.INVALID_PARAMS, codes.TRANSFER_FAIL)


class MooncakeBackend(Backend):
    """``mooncakestore://master-host:port?...``: a Mooncake Store client on its zero-copy
    calls (see the module and :class:`~kvplug_mooncake.options.MooncakeOptions`).

    Example, against a running ``mooncake_master`` (this process lends 1 GiB)::

        backend = await kvplug.open_backend(
            "mooncakestore://10.0.0.5:50051?global_segment_size=1GiB"
        )
        obj = backend.allocator.allocate((2, 32, 256, 1024), torch.float16)  # registered
        ...  # fill obj
        await backend.put(key, obj)                     # zero-copy from obj's memory
        await backend.get_into(key, obj)                # zero-copy into obj's memory
    """

    Options: ClassVar[type[BackendOptions]] = MooncakeOptions
    options: MooncakeOptions
    capabilities = Capabilities(remove=True, native_batching=True, shared_across_processes=True)

    def __init__(self, url: BackendURL | str, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        host = self.url.host
        port = self.url.port
        if host and port:
            self.master = f"{host}:{port}"
        elif self.options.master_server_addr:
            self.master = self.options.master_server_addr
        else:
            raise ConfigError(
                f"{self.url} names no Mooncake master: write mooncakestore://host:port (the "
                "master's --rpc_port, 50051 by default) or set master_server_address."
            )
        self.damaged_values = DamagedValues[str](
            self.url, remove=lambda name: self._remove_name(name, force=True)
        )
        """Damaged values read as misses, counted, logged and removed (clause 6)."""
        self.copied_overwrites = 0
        """Puts that overwrote an existing key: the one path that copies an object."""
        self._store: Any = None
        self._registrations: _Registrations | None = None
        self._slots: FreeListAllocator | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._checker: concurrent.futures.ThreadPoolExecutor | None = None
        self._config: Any = None
        self._zero_copy_allocator = False
        self._unreachable_at = -RECOVERY_WINDOW
        self.local_hostname = ""

    @classmethod
    def parse_options(cls, url: BackendURL, explicit: dict[str, Any]) -> BackendOptions:
        """The JSON config file's settings (``config_file`` or ``MOONCAKE_CONFIG_PATH``) under
        the URL's query under ``explicit``, LMCache's and Mooncake's names accepted."""
        merged = merged_settings(url.options, explicit)
        return super().parse_options(dataclasses.replace(url, query=()), merged)

    def describe(self) -> dict[str, str]:
        zero_copy = (
            "allocator buffer and header slab registered"
            if self._zero_copy_allocator
            else "header slab registered; objects registered per call (allocator has no buffer)"
        )
        return {
            "master": self.master,
            "metadata": self.options.metadata_server,
            "protocol": self.options.protocol
            + (f" ({self.options.device})" if self.options.device else ""),
            "lends": f"{self.options.global_segment_size} bytes",
            "zero_copy": zero_copy,
            "client": installed_version(),
        }

    # -- open and close ----------------------------------------------------------------------

    async def _open(self) -> None:
        store_class = load_store_class()
        options = self.options
        self.local_hostname = await asyncio.to_thread(self._probe_master)
        if options.metadata_server.startswith(("http://", "https://")):
            await asyncio.to_thread(self._probe_metadata_server)
        store = await self._setup(store_class)
        self._store = store
        self._pool = concurrent.futures.ThreadPoolExecutor(
            options.threads, thread_name_prefix="kvplug-mooncake"
        )
        self._checker = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="kvplug-mooncake-checksum"
        )
        from mooncake.store import ReplicateConfig

        self._config = ReplicateConfig()
        self._config.replica_num = options.replica_num
        registrations = _Registrations(store, self.url)
        self._slots = FreeListAllocator(SLOT * HEADER_SLOTS, alignment=SLOT, pin=False)
        allocator = self.allocator
        try:
            registrations.register_fixed(
                self._slots.buffer.data_ptr(), self._slots.capacity, "the header slab"
            )
            if isinstance(allocator, FreeListAllocator) and allocator.buffer.device.type == "cpu":
                registrations.register_fixed(
                    allocator.buffer.data_ptr(), allocator.capacity, "the allocator's buffer"
                )
                self._zero_copy_allocator = True
        except BaseException:
            await asyncio.to_thread(store.close)
            raise
        self._registrations = registrations

    def _probe_master(self) -> str:
        """Check that the master answers before Mooncake's ``setup`` meets it: ``setup`` holds
        the GIL while it waits (the whole process stalls) and waits 60 to 90 s for a master
        that does not answer. The probe connects and sends a request no master serves (an
        empty coro_rpc header for function 0), which a live master answers by closing the
        connection; a paused master, or a port that accepts and stays silent, answers
        nothing. The local address of the connection is this client's default hostname."""
        host, _, port_text = self.master.rpartition(":")
        host = host.strip("[]")
        try:
            port = int(port_text)
        except ValueError:
            raise ConfigError(
                f"the Mooncake master address {self.master!r} has no port: write host:port."
            ) from None
        limit = self.options.connect_timeout
        try:
            with socket.create_connection((host, port), timeout=limit) as connection:
                local: str = connection.getsockname()[0]
                connection.sendall(PROBE)
                connection.recv(1)
        except TimeoutError:
            raise BackendUnavailable(
                f"the Mooncake master at {self.master} accepts connections but did not answer "
                f"within {limit} s (connect_timeout): it is paused or overloaded, or this port "
                "is not a mooncake_master's --rpc_port."
            ) from None
        except OSError as error:
            raise BackendUnavailable(
                f"no Mooncake master answers at {self.master} ({error.strerror or error}). "
                "Start mooncake_master there (--rpc_port) or fix the URL."
            ) from None
        return self.options.local_hostname or local

    def _probe_metadata_server(self) -> None:
        parts = urlsplit(self.options.metadata_server)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            with socket.create_connection(
                (parts.hostname or "127.0.0.1", port), timeout=self.options.connect_timeout
            ):
                pass
        except OSError as error:
            raise BackendUnavailable(
                f"no Mooncake metadata server answers at {self.options.metadata_server} "
                f"({error.strerror or error}). Start the master with "
                "--enable_http_metadata_server, or use metadata_server=P2PHANDSHAKE."
            ) from None

    async def _setup(self, store_class: type[Any]) -> Any:
        """A client set up by Mooncake's ``setup``. It holds the GIL while it runs, so no
        deadline of this process can interrupt it: :meth:`_probe_master` has checked that the
        master answers, and it takes tens of milliseconds then."""
        options = self.options
        settings = {
            "local_hostname": self.local_hostname,
            "metadata_server": options.metadata_server,
            "global_segment_size": options.global_segment_size,
            "local_buffer_size": options.local_buffer_size,
            "protocol": options.protocol,
            "rdma_devices": options.device,
            "master_server_addr": self.master,
        }
        _bound_rpc_waits(options.timeout)
        store = store_class()
        code = await asyncio.to_thread(store.setup, settings)
        if code != 0:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(store.close)
            raise BackendUnavailable(
                f"Mooncake's setup against the master at {self.master} returned "
                f"{codes.describe(code)} (local_hostname {self.local_hostname}, metadata "
                f"{options.metadata_server}, protocol {options.protocol}). Its log on stderr "
                "names the cause; check that the master runs with this metadata setting."
            )
        return store

    async def _close(self) -> None:
        """Let the calls in flight finish, then close Mooncake's client (on a thread that
        finishes the job even when the close's deadline gives up waiting for it)."""
        pool, store = self._pool, self._store
        self._pool = None
        if pool is None or store is None:
            return

        def finish() -> None:
            pool.shutdown(wait=True, cancel_futures=True)
            if self._checker is not None:
                self._checker.shutdown(wait=True)
            self._store = None
            store.close()

        await asyncio.to_thread(finish)

    # -- running Mooncake's calls ------------------------------------------------------------

    async def _run(
        self,
        work: Callable[[], T],
        holding: Sequence[MemoryObj] = (),
        *,
        abandoned: Callable[[T], None] | None = None,
    ) -> T:
        """``work()`` on a worker thread, holding a reference to each of ``holding`` until it
        returns, also after a deadline stopped the wait for it; then ``abandoned`` gets the
        result nobody took (to release the objects it holds)."""
        pool = self._pool
        if pool is None:
            self.ensure_open()
            raise BackendUnavailable(f"{self.url} is not open.")
        held = [obj.retain() for obj in holding]

        def run() -> T:
            try:
                return work()
            finally:
                _release_all(held)

        try:
            future = pool.submit(run)
        except RuntimeError:  # the pool shut down: close() ran meanwhile
            _release_all(held)
            self.ensure_open()
            raise
        future.add_done_callback(lambda done: _release_all(held) if done.cancelled() else None)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            if future.cancelled():  # dropped from the queue by close(), never run
                self.ensure_open()
            if abandoned is not None:
                future.add_done_callback(lambda done: _hand_over(done, abandoned))
            raise

    def _name(self, key: CacheKey) -> str:
        return self.options.key_prefix + key.to_string()

    def _slot(self) -> _Slot:
        assert self._slots is not None
        obj = self._slots.allocate((SLOT,), torch.uint8)
        if obj is None:
            raise BackendUnavailable(
                f"{self.url} has {HEADER_SLOTS} operations on objects in flight, its most; "
                "lower the engine's concurrency or raise threads."
            )
        return _Slot(obj)

    def _check(self, code: int, operation: str, name: str) -> None:
        if code < 0:
            raise self._error(code, operation, name)

    def _error(self, code: int, operation: str, name: str) -> BackendError:
        """The error of a call that returned ``code``. A store found full (-200) soon after
        the master was unreachable is a store recovering: a restarted master knows no segment
        until the clients that lend memory remount theirs, at their next ping."""
        now = time.monotonic()
        if code in codes.UNREACHABLE or code == codes.RPC_TIMEOUT:
            self._unreachable_at = now
        elif code == codes.NO_AVAILABLE_HANDLE and now - self._unreachable_at < RECOVERY_WINDOW:
            return BackendUnavailable(
                f"Mooncake {operation} of {name!r} on {self.url} returned "
                f"{codes.describe(code)} {now - self._unreachable_at:.1f} s after the master was "
                "unreachable: the clients that lend memory are remounting their segments with "
                "it. Retry shortly."
            )
        return codes.error_for(code, operation, name, self.url)

    # -- put ---------------------------------------------------------------------------------

    async def _put(self, key: CacheKey, obj: MemoryObj) -> None:
        await self._batched_put([key], [obj])

    async def _batched_put(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]) -> None:
        last = {self._name(key): obj for key, obj in zip(keys, objs, strict=True)}
        names = list(last)
        hosts = [_host(obj) for obj in last.values()]
        try:
            await self._run(lambda: self._store_objects(names, hosts), hosts)
        finally:
            for host in hosts:
                host.release()

    def _store_objects(self, names: list[str], objs: list[MemoryObj]) -> None:
        """Put each object under its name (a worker thread): new keys zero-copy, existing ones
        overwritten with one copy (Mooncake's put would keep their old value)."""
        store, registrations = self._store, self._registrations
        assert registrations is not None
        found = store.batch_is_exist(names)
        for name, code in zip(names, found, strict=True):
            if code < 0:
                raise self._error(code, "put (exists check)", name)
        slots = [self._slot() for _ in names]
        headers = [0] * len(names)

        def frame_headers(group: list[int]) -> None:
            for i in group:
                obj = objs[i]
                payload = obj.memoryview()
                header = encode_header(
                    obj.shape, obj.dtype, obj.fmt, "naive", payload, checksum(payload)
                )
                slots[i].view(len(header))[:] = header
                headers[i] = len(header)

        new = [i for i, code in enumerate(found) if code == 0]
        existing = [i for i, code in enumerate(found) if code == 1]

        def put(group: list[int]) -> None:
            with registrations.holding([(objs[i].data_ptr(), objs[i].nbytes) for i in group]):
                results = store.batch_put_from_multi_buffers(
                    [names[i] for i in group],
                    [[slots[i].ptr, objs[i].data_ptr()] for i in group],
                    [[headers[i], objs[i].nbytes] for i in group],
                    self._config,
                )
            for i, code in zip(group, results, strict=True):
                if code == codes.OBJECT_ALREADY_EXISTS:
                    existing.append(i)  # another writer got there first: overwrite
                else:
                    self._check(code, "put", names[i])

        try:
            self._overlapped(_groups(new, objs), before=frame_headers, transfer=put)
            if existing:
                frame_headers([i for i in existing if not headers[i]])
                self._overwrite(
                    [names[i] for i in existing],
                    [slots[i].view(headers[i]) for i in existing],
                    [objs[i] for i in existing],
                )
        finally:
            for slot in slots:
                slot.obj.release()

    def _overlapped(
        self,
        groups: list[list[int]],
        *,
        transfer: Callable[[list[int]], Any],
        before: Callable[[list[int]], None] | None = None,
        after: Callable[[list[int], Any], None] | None = None,
    ) -> None:
        """Transfer each group on this thread, and hash on the checksum thread: ``before`` of
        the next group (frame headers) or ``after`` of the one just moved (verification) while
        Mooncake moves this one. Mooncake's calls release the GIL, and the checksum thread lets
        go of it between pieces (:func:`checksum`), so the two overlap. The first ``before``
        and the last ``after`` have nothing to overlap with and run here, so a batch of one
        group (a single chunk) runs as if there were no checksum thread."""
        checker = self._checker
        assert checker is not None
        if before is not None and groups:
            before(groups[0])
        running: list[concurrent.futures.Future[None]] = []  # at most one hashing job
        try:
            for index, group in enumerate(groups):
                last = index + 1 == len(groups)
                if before is not None and not last:
                    running.append(checker.submit(_sharing_the_gil, before, groups[index + 1]))
                result = transfer(group)
                while running:
                    running.pop().result()
                if after is not None and last:
                    after(group, result)
                elif after is not None:
                    running.append(checker.submit(_sharing_the_gil, after, group, result))
        finally:
            concurrent.futures.wait(running)  # a transfer failed: the hashing of memory ends first

    def _overwrite(
        self, names: list[str], headers: list[memoryview], objs: list[MemoryObj]
    ) -> None:
        """Upsert each frame from one contiguous copy of header and payload."""
        registrations = self._registrations
        assert registrations is not None
        frames = []
        try:
            for header, obj in zip(headers, objs, strict=True):
                frame = self.allocator.allocate((len(header) + obj.nbytes,), torch.uint8)
                if frame is None or frame.device.type != "cpu":
                    if frame is not None:
                        frame.release()
                    frame = MemoryObj.from_tensor(
                        torch.empty(len(header) + obj.nbytes, dtype=torch.uint8)
                    )
                view = frame.memoryview()
                view[: len(header)] = header
                view[len(header) :] = obj.memoryview()
                frames.append(frame)
            self.copied_overwrites += len(frames)
            with registrations.holding([(f.data_ptr(), f.nbytes) for f in frames]):
                results = self._store.batch_upsert_from(
                    names, [f.data_ptr() for f in frames], [f.nbytes for f in frames], self._config
                )
            for name, code in zip(names, results, strict=True):
                self._check(code, "put", name)
        finally:
            for frame in frames:
                frame.release()

    # -- get ---------------------------------------------------------------------------------

    async def _get(self, key: CacheKey) -> MemoryObj | None:
        return (await self._batched_get([key]))[0]

    async def _batched_get(self, keys: Sequence[CacheKey]) -> list[MemoryObj | None]:
        names = [self._name(key) for key in keys]
        found, damaged = await self._run(
            lambda: self._read_objects(names), abandoned=_release_found
        )
        try:
            await self.damaged_values.drop(damaged)
        except BaseException:
            _release_found((found, damaged))
            raise
        return found

    def _stored_sizes(self, names: Sequence[str]) -> dict[str, int]:
        """The stored size of each name that is present (one call to the master)."""
        sizes = {}
        for name, replicas in self._store.batch_get_replica_desc(list(names)).items():
            for replica in replicas:
                if replica.is_memory_replica():
                    sizes[name] = int(replica.get_memory_descriptor().buffer_descriptor.size)
                    break
            else:
                if replicas:
                    size = int(self._store.get_size(name))
                    if size > 0:
                        sizes[name] = size
        return sizes

    def _read_objects(
        self, names: list[str]
    ) -> tuple[list[MemoryObj | None], dict[str, CorruptObject]]:
        """Read each name's whole value into one allocator block and return its payload in
        place (a worker thread). A value being written is waited for (see
        :func:`_while_being_written`); one that changed size between the size query and the
        read is asked for again."""
        results: dict[str, MemoryObj | None] = {}
        damage = _Damage()
        registrations = self._registrations
        assert registrations is not None

        def attempt(pending: list[str]) -> list[str]:
            sizes = self._stored_sizes(pending)
            absent = [name for name in pending if name not in sizes]
            again = [
                name
                for name, code in zip(absent, self._probe(absent), strict=True)
                if code != codes.OBJECT_NOT_FOUND  # there after all: being written, or was
            ]
            blocks: list[tuple[str, MemoryObj]] = []
            consumed: list[bool] = []  # blocks made into results (or released) by check()
            try:
                for name in pending:
                    size = sizes.get(name)
                    block = None if size is None else self._block(size)
                    if block is not None:
                        blocks.append((name, block))
                    elif name not in again:
                        results[name] = None  # absent, or no room to receive it: a miss
                if not blocks:
                    return again
                failures: list[BackendError] = []
                consumed.extend(False for _ in blocks)

                def read(group: list[int]) -> list[int]:
                    taken = [blocks[j][1] for j in group]
                    with registrations.holding([(b.data_ptr(), b.nbytes) for b in taken]):
                        read_codes: list[int] = self._store.batch_get_into(
                            [blocks[j][0] for j in group],
                            [b.data_ptr() for b in taken],
                            [b.nbytes for b in taken],
                        )
                    return read_codes

                def check(group: list[int], read_codes: list[int]) -> None:
                    for j, code in zip(group, read_codes, strict=True):
                        name, block = blocks[j]
                        consumed[j] = True
                        if code == block.nbytes:
                            try:
                                results[name] = self._payload_in_place(name, block)
                            except CorruptObject as error:
                                if damage.confirmed(name, error):
                                    results[name] = None
                                else:
                                    again.append(name)
                            continue
                        block.release()
                        if code == codes.REPLICA_IS_NOT_READY or code >= 0:
                            again.append(name)  # being overwritten (maybe to another size)
                        elif code == codes.INVALID_PARAMS:
                            again.append(name)  # overwritten with a larger value
                        elif code in codes.MISSES:
                            results[name] = None
                        else:
                            failures.append(self._error(code, "get", name))

                indices = list(range(len(blocks)))
                self._overlapped(
                    _groups(indices, [b for _, b in blocks]), transfer=read, after=check
                )
            finally:
                left = [
                    b for j, (_, b) in enumerate(blocks) if j >= len(consumed) or not consumed[j]
                ]
                _release_all(left)
            if failures:
                raise failures[0]
            return again

        try:
            for name in _while_being_written(attempt, list(dict.fromkeys(names))):
                results[name] = None
        except BaseException:
            for obj in results.values():
                if obj is not None:
                    obj.release()
            raise
        given: set[str] = set()
        found: list[MemoryObj | None] = []
        for name in names:
            obj = results.get(name)
            found.append(obj.retain() if obj is not None and name in given else obj)
            given.add(name)
        return found, damage.found

    def _probe(self, names: list[str]) -> list[int]:
        """Ask for each name's value into a header slot, to learn whether it is there when
        the replica query or ``batch_is_exist`` says it is not: both answer no for a while
        during an overwrite. :data:`~kvplug_mooncake.codes.OBJECT_NOT_FOUND` (or another
        code of :data:`~kvplug_mooncake.codes.MISSES` but -703): absent; -703: being
        written; -600 or a length: present."""
        if not names:
            return []
        slots = [self._slot() for _ in names]
        try:
            read: list[int] = self._store.batch_get_into(
                names, [slot.ptr for slot in slots], [SLOT] * len(names)
            )
        finally:
            _release_all([slot.obj for slot in slots])
        found = []
        for name, code in zip(names, read, strict=True):
            if code in codes.MISSES and code != codes.REPLICA_IS_NOT_READY:
                found.append(codes.OBJECT_NOT_FOUND)
            elif code < 0 and code not in (codes.REPLICA_IS_NOT_READY, codes.INVALID_PARAMS):
                raise self._error(code, "get", name)
            else:
                found.append(code)
        return found

    def _block(self, size: int) -> MemoryObj | None:
        """A host block of ``size`` bytes to read a value into: from the allocator, or (for a
        GPU allocator) from host memory."""
        allocator = self.allocator
        block = allocator.allocate((size,), torch.uint8)
        if block is not None and block.device.type != "cpu":
            block.release()
            return MemoryObj.from_tensor(torch.empty(size, dtype=torch.uint8))
        return block

    def _payload_in_place(self, name: str, block: MemoryObj) -> MemoryObj | None:
        """The object whose frame ``block`` holds, its payload in place; raises
        :class:`~kvplug.errors.CorruptObject` (``block`` released) when the frame is bad."""
        view = block.memoryview()
        try:
            header = decode_header(view[:MAX_HEADER_LEN])
            if header.frame_len != block.nbytes or header.serde != "naive":
                raise CorruptObject(
                    f"frame of {name!r} says {header.frame_len} bytes ({header.serde}); "
                    f"{block.nbytes} were stored."
                )
            verify_payload(header, view[header.header_len :], checksum)
        except CorruptObject:
            block.release()
            raise
        if block.allocator is not None and block.allocator is self.allocator:
            return block.reinterpret(header.header_len, header.shape, header.dtype, header.fmt)
        return self._into_allocator(header, block)

    def _into_allocator(self, header: FrameHeader, block: MemoryObj) -> MemoryObj | None:
        """Copy a value read into host memory to an object of the allocator (a GPU one)."""
        try:
            obj = self.allocator.allocate(header.shape, header.dtype, header.fmt)
            if obj is not None:
                obj.raw.copy_(block.raw[header.header_len :])
            return obj
        finally:
            block.release()

    # -- get_into ----------------------------------------------------------------------------

    async def _get_into(self, key: CacheKey, dest: MemoryObj) -> bool:
        return (await self._batched_get_into([key], [dest]))[0]

    async def _batched_get_into(
        self, keys: Sequence[CacheKey], dests: Sequence[MemoryObj]
    ) -> list[bool]:
        names = [self._name(key) for key in keys]
        targets = [
            dest.retain() if dest.device.type == "cpu" else _host_like(dest) for dest in dests
        ]
        try:
            hits, damaged, resized = await self._run(
                lambda: self._read_into(names, targets), targets
            )
            for dest, target, hit in zip(dests, targets, hits, strict=True):
                if hit and target is not dest:
                    dest.raw.copy_(target.raw)
        finally:
            for target in targets:
                target.release()
        await self.damaged_values.drop(damaged)
        for index in resized:
            # Read whole, once, to name the stored layout (a reader with another layout).
            stored, dest = await self._get(keys[index]), dests[index]
            if stored is not None:
                stored.release()
                if stored.nbytes != dest.nbytes:  # not overwritten to the reader's size since
                    raise LayoutMismatch.between(
                        keys[index],
                        (stored.shape, stored.dtype, stored.nbytes),
                        (dest.shape, dest.dtype, dest.nbytes),
                    )
        return hits

    def _read_into(
        self, names: list[str], dests: list[MemoryObj]
    ) -> tuple[list[bool], dict[str, CorruptObject], list[int]]:
        """Scatter each value into a header slot and its destination (a worker thread). The
        header's length is not known before it is read: the destination's rank gives it, and
        a read the store refuses for its size is tried with the other naive length; a value
        being written is waited for (see :func:`_while_being_written`). Returns the hits, the
        names of damaged values, and the positions whose value has another size than its
        destination at every header length."""
        registrations = self._registrations
        assert registrations is not None
        hits = [False] * len(names)
        resized: list[int] = []
        damage = _Damage()
        slots = [self._slot() for _ in names]
        guesses = [[header_len(len(dest.shape))] for dest in dests]
        for guess in guesses:
            guess.extend(n for n in NAIVE_HEADER_LENS if n != guess[0])
        tried = [0] * len(names)

        def attempt(pending: list[int]) -> list[int]:
            again: list[int] = []

            def read(group: list[int]) -> list[int]:
                codes_read: list[int] = self._store.batch_get_into_multi_buffers(
                    [names[i] for i in group],
                    [[slots[i].ptr, dests[i].data_ptr()] for i in group],
                    [[guesses[i][tried[i]], dests[i].nbytes] for i in group],
                )
                return codes_read

            def check(group: list[int], read_codes: list[int]) -> None:
                for i, code in zip(group, read_codes, strict=True):
                    length = guesses[i][tried[i]]
                    if code == length + dests[i].nbytes:
                        try:
                            hits[i] = self._verify_into(names[i], slots[i], length, dests[i])
                        except CorruptObject as error:
                            if not damage.confirmed(names[i], error):
                                again.append(i)
                    elif code == codes.REPLICA_IS_NOT_READY:
                        again.append(i)
                    elif _is_damage_free_size_mismatch(code):
                        tried[i] += 1  # another header length; past the last, another size
                        if tried[i] < len(guesses[i]):
                            again.append(i)
                        else:
                            resized.append(i)
                    elif code < 0 and code not in codes.MISSES:
                        self._check(code, "get", names[i])

            self._overlapped(_groups(pending, dests), transfer=read, after=check)
            return again

        try:
            with registrations.holding([(d.data_ptr(), d.nbytes) for d in dests]):
                _while_being_written(attempt, list(range(len(names))))
        finally:
            for slot in slots:
                slot.obj.release()
        return hits, damage.found, resized

    def _verify_into(self, name: str, slot: _Slot, length: int, dest: MemoryObj) -> bool:
        """Whether ``dest`` now holds the naive payload the header in ``slot`` describes;
        :class:`~kvplug.errors.CorruptObject` when the frame is bad."""
        header = decode_header(slot.view(length))
        if header.header_len != length or header.payload_len != dest.nbytes:
            raise CorruptObject(f"frame header of {name!r} does not match its stored size.")
        verify_payload(header, dest.memoryview(), checksum)
        return header.serde == "naive"

    # -- contains, remove, damage ------------------------------------------------------------

    async def _contains(self, key: CacheKey) -> bool:
        return (await self._present([self._name(key)]))[0]

    async def _batched_exists(self, keys: Sequence[CacheKey]) -> list[bool]:
        return await self._present([self._name(key) for key in keys])

    async def _present(self, names: list[str]) -> list[bool]:
        return await self._run(lambda: self._present_now(names))

    def _present_now(self, names: list[str]) -> list[bool]:
        """``batch_is_exist``, with each no checked by :meth:`_probe` (it says no while a
        value is overwritten); a value being written counts as present, as ``get`` waits
        for it."""
        found: list[int] = self._store.batch_is_exist(names)
        for name, code in zip(names, found, strict=True):
            if code < 0:
                raise self._error(code, "contains", name)
        present = [code == 1 for code in found]
        doubtful = [i for i, there in enumerate(present) if not there]
        for i, code in zip(doubtful, self._probe([names[i] for i in doubtful]), strict=True):
            present[i] = code != codes.OBJECT_NOT_FOUND
        return present

    async def _remove(self, key: CacheKey) -> bool:
        return await self._remove_name(self._name(key), force=self.options.leased_remove == "force")

    async def _remove_name(self, name: str, *, force: bool) -> bool:
        while True:
            code = await self._run(lambda: self._store.remove(name, force=force))
            if code == 0:
                return True
            if code == codes.OBJECT_NOT_FOUND:
                return False
            if code != codes.OBJECT_HAS_LEASE:
                raise self._error(code, "remove", name)
            await asyncio.sleep(LEASE_RETRY)  # a reader holds the lease: wait it out

    @property
    def corrupt_objects(self) -> int:
        """:class:`~kvplug.backend.CountsCorruptObjects`: damaged values read as misses."""
        return self.damaged_values.count

    # -- the suite's look at stored bytes (clause 6) -----------------------------------------

    async def read_raw(self, key: CacheKey) -> bytes | None:
        """:class:`~kvplug.backend.RawValues`: the stored value of ``key`` as it is."""
        self.ensure_open()
        name = self._name(key)

        def read() -> bytes | None:
            size = self._stored_sizes([name]).get(name)
            if size is None:
                return None
            buffer = torch.empty(size, dtype=torch.uint8)
            assert self._registrations is not None
            with self._registrations.holding([(buffer.data_ptr(), size)]):
                code = self._store.batch_get_into([name], [buffer.data_ptr()], [size])[0]
            if code in codes.MISSES:
                return None
            self._check(code, "get", name)
            return bytes(buffer[:code].numpy().tobytes())

        return await self._run(read)

    async def write_raw(self, key: CacheKey, data: bytes) -> None:
        """:class:`~kvplug.backend.RawValues`: replace the stored value of ``key`` with
        ``data`` as it is."""
        self.ensure_open()
        name = self._name(key)
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8)

        def write() -> None:
            assert self._registrations is not None
            with self._registrations.holding([(buffer.data_ptr(), len(data))]):
                code = self._store.batch_upsert_from(
                    [name], [buffer.data_ptr()], [len(data)], self._config
                )[0]
            self._check(code, "put", name)

        await self._run(write)


_rpc_timeout_set_here = False


def _bound_rpc_waits(seconds: float) -> None:
    """Make the Mooncake clients set up from now on give up on an unanswered master call
    after ``seconds`` (``MC_RPC_TIMEOUT_MS``; Mooncake's own default is 30 s), so that a call
    that outlived its deadline does not hold a worker thread and the caller's memory long. A
    value the user exported is left alone."""
    global _rpc_timeout_set_here
    if RPC_TIMEOUT_VARIABLE in os.environ and not _rpc_timeout_set_here:
        return
    os.environ[RPC_TIMEOUT_VARIABLE] = str(max(1, round(seconds * 1000)))
    _rpc_timeout_set_here = True


_hashing = threading.local()


def _sharing_the_gil(work: Callable[..., None], *args: Any) -> None:
    """Run ``work`` with :func:`checksum` letting go of the GIL between pieces."""
    _hashing.share = True
    try:
        work(*args)
    finally:
        _hashing.share = False


def checksum(payload: Buffer) -> int:
    """:func:`kvplug.frame.payload_checksum` (xxh3-64) of ``payload``. On the checksum thread
    (:func:`_sharing_the_gil`) it is fed in pieces of :data:`PIECE` bytes with the GIL let go
    between them: xxhash holds the GIL for as long as one call hashes, and over a whole KV
    chunk (milliseconds on data not in cache) that would keep the worker thread from starting
    its next Mooncake transfer, undoing the overlap. Elsewhere it is one call."""
    view = memoryview(payload).cast("B")
    if view.nbytes <= PIECE or not getattr(_hashing, "share", False):
        return payload_checksum(view)
    state = xxhash.xxh3_64()
    for start in range(0, view.nbytes, PIECE):
        state.update(view[start : start + PIECE])
        time.sleep(0)  # lets a waiting thread take the GIL
    return int(state.intdigest())


def _groups(indices: list[int], objs: Sequence[MemoryObj]) -> list[list[int]]:
    """``indices`` in order, cut into groups of at least :data:`GROUP_BYTES` each (the last
    may be smaller): the steps in which a batch's transfers and checksums overlap."""
    groups: list[list[int]] = []
    size = GROUP_BYTES
    for i in indices:
        if size >= GROUP_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += objs[i].nbytes
    return groups


def _hand_over(future: concurrent.futures.Future[T], receiver: Callable[[T], None]) -> None:
    """Give the result of a call nobody waits for any more to ``receiver``."""
    if not future.cancelled() and future.exception() is None:
        receiver(future.result())


class _Damage:
    """Frames that failed their checks in one read. A first failure is read again: Mooncake
    overwrites a value of the same size in place, so a read racing an overwrite can receive a
    mix of two values, which the checksum catches; only a frame that fails twice is damage."""

    def __init__(self) -> None:
        self._suspects: set[str] = set()
        self.found: dict[str, CorruptObject] = {}
        """The damaged values: name -> the second failure."""

    def confirmed(self, name: str, error: CorruptObject) -> bool:
        """Note a failed frame of ``name``: True the second time (damage), False the first."""
        if name in self._suspects:
            self.found[name] = error
            return True
        self._suspects.add(name)
        return False


def _release_all(objs: Sequence[MemoryObj]) -> None:
    for obj in objs:
        obj.release()


def _release_found(result: tuple[Sequence[MemoryObj | None], Any]) -> None:
    for obj in result[0]:
        if obj is not None:
            obj.release()


def _while_being_written(attempt: Callable[[list[K]], list[K]], pending: list[K]) -> list[K]:
    """Call ``attempt`` with the items still pending until none is, waiting a little more
    each time, for at most :data:`WRITE_WAIT` seconds; the items still pending then.

    Mooncake hides a value while a put or an overwrite of it runs (its replica is not ready,
    -703): a read then waits for the write to finish rather than miss a key that has a value
    (read-your-writes while another writer overwrites it)."""
    deadline = time.monotonic() + WRITE_WAIT
    pause = 0.001
    while pending:
        pending = attempt(pending)
        if not pending or time.monotonic() + pause > deadline:
            break
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    return pending


def _host_like(dest: MemoryObj) -> MemoryObj:
    """A host object of ``dest``'s shape to read into before copying to a GPU ``dest``."""
    return MemoryObj.from_tensor(torch.empty(dest.shape, dtype=dest.dtype), dest.fmt)


__all__ = ["MooncakeBackend", "installed_version", "load_store_class"]
