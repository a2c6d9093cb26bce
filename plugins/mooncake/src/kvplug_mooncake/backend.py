"""``mooncakestore://master-host:port``: objects in a Mooncake Store, moved zero-copy.

Mooncake Store keeps objects in memory that its clients lend (segments) and finds them
through a master (``mooncake_master``). This backend is one such client
(``mooncake.store.MooncakeDistributedStore``), on the store's zero-copy calls:

* At open it registers the memory objects live in with Mooncake once: the buffer of the
  backend's allocator (a :class:`~kvplug.memory.FreeListAllocator`) and a slab of header
  slots (:mod:`kvplug_mooncake.registration`). Memory outside them (an object wrapped around
  an engine's tensor) is registered for the one call that moves it, and never copied.
* Each object is one Mooncake object: a header region of fixed length (the kvplug frame
  header: shape, dtype, checksums) followed by the payload (:mod:`kvplug_mooncake.layout`).

What each operation costs in Mooncake calls (a batch makes one call per group of 4 MiB or
more of objects, so that the checksum of one group overlaps the transfer of the next; the
counts below are for a batch of one group):

* ``contains`` / ``batched_exists``: one ``batch_is_exist``. With ``probe=true``, the keys it
  calls absent are read once more into a header slot (:meth:`MooncakeBackend._probe`): a key
  another client is overwriting at that moment is absent to ``batch_is_exist`` until the
  overwrite ends, and the probe reads it as present.
* ``get_into``: one ``batch_get_into_multi_buffers``, scattering the header region into a slot
  and the payload into the caller's memory; both lengths are known beforehand.
* ``get``: one ``batch_get_into`` into an allocator block of the size values of the key's
  family were seen with (:class:`~kvplug_mooncake.layout.SizeHints`), and the payload returned
  in place (:meth:`~kvplug.memory.MemoryObj.reinterpret`). Mooncake has no call that both
  sizes and reads a value into memory of the caller's: a key of a family not seen yet costs
  one more call first (``batch_get_replica_desc``), and a value larger than its family's two
  more (the read Mooncake refuses, then the size).
* ``put``: ``batch_is_exist``, then ``batch_put_from_multi_buffers`` (header slot and the
  object's own memory, no copy) for the new keys. Mooncake's put of an existing key keeps the
  old value and returns 0, and its upserts take one contiguous buffer per key, so existing
  keys are upserted (``batch_upsert_from``) from one copy of header and payload side by side.
* A value being written is hidden by Mooncake (-703): a read waits for it
  (:func:`~kvplug_mooncake.overlap.while_being_written`). A ``remove`` refused by a reader's
  lease (-706) is forced or waited out (``leased_remove``); every other code maps to a kvplug
  error that names it (:mod:`kvplug_mooncake.codes`).
* Mooncake's calls block, so they run on worker threads; each holds a reference to the
  objects whose memory it moves until it returns, also when a deadline stopped the wait.
  ``open`` checks the master and the wheel first (:mod:`kvplug_mooncake.client`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any, ClassVar, TypeVar

import torch

from kvplug.backend import Backend, Capabilities
from kvplug.damage import DamagedValues
from kvplug.errors import (
    BackendError,
    BackendUnavailable,
    ConfigError,
    CorruptObject,
    LayoutMismatch,
)
from kvplug.frame import verify_payload
from kvplug.keys import CacheKey
from kvplug.memory import FreeListAllocator, MemoryObj
from kvplug.options import BackendOptions
from kvplug.url import BackendURL
from kvplug_mooncake import codes
from kvplug_mooncake.client import (
    check_master_answers,
    check_metadata_server,
    installed_version,
    load_store_class,
    set_up_client,
)
from kvplug_mooncake.layout import (
    HEADER_REGION,
    Damage,
    SizeHints,
    object_of_value,
    read_header_region,
    write_header_region,
)
from kvplug_mooncake.options import MooncakeOptions, merged_settings
from kvplug_mooncake.overlap import checksum, groups_of, overlapped, while_being_written
from kvplug_mooncake.registration import (
    HeaderSlab,
    HeaderSlot,
    Registrations,
    host_copy,
    host_like,
    release_slots,
)

T = TypeVar("T")
logger = logging.getLogger(__name__)

LEASE_RETRY = 0.05
RECOVERY_WINDOW = 30.0
"""Seconds after the master was last unreachable during which a full store (-200) is taken
for one whose segments are being remounted (see :meth:`MooncakeBackend._error`)."""
SIZE_MISMATCH = frozenset({codes.INVALID_PARAMS, codes.TRANSFER_FAIL})
"""What a multi-buffer read whose buffers do not add up to the stored size returns: -600 (the
value is larger) or -800 (smaller)."""


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
        self.size_hints = SizeHints()
        """The sizes ``get`` reads values of a family of keys with, without asking first."""
        self._store: Any = None
        self._registrations: Registrations | None = None
        self._slab: HeaderSlab | None = None
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
            "probe": "on: absent answers read once more" if self.options.probe else "off",
            "client": installed_version(),
        }

    # -- open and close ----------------------------------------------------------------------

    async def _open(self) -> None:
        store_class = load_store_class()
        options = self.options
        limit = options.connect_timeout
        local = await asyncio.to_thread(check_master_answers, self.master, limit)
        self.local_hostname = options.local_hostname or local
        if options.metadata_server.startswith(("http://", "https://")):
            await asyncio.to_thread(check_metadata_server, options.metadata_server, limit)
        settings = {
            "local_hostname": self.local_hostname,
            "metadata_server": options.metadata_server,
            "global_segment_size": options.global_segment_size,
            "local_buffer_size": options.local_buffer_size,
            "protocol": options.protocol,
            "rdma_devices": options.device,
            "master_server_addr": self.master,
        }
        store = await set_up_client(store_class, settings, options.timeout)
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
        registrations = Registrations(store, self.url)
        slab = HeaderSlab(self.url)
        allocator = self.allocator
        try:
            registrations.register_fixed(
                slab.allocator.buffer.data_ptr(), slab.allocator.capacity, "the header slab"
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
        self._slab = slab

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

    def _overlapped(
        self,
        groups: list[list[int]],
        *,
        transfer: Callable[[list[int]], Any],
        before: Callable[[list[int]], None] | None = None,
        after: Callable[[list[int], Any], None] | None = None,
    ) -> None:
        """:func:`~kvplug_mooncake.overlap.overlapped` on this backend's checksum thread."""
        assert self._checker is not None
        overlapped(self._checker, groups, transfer=transfer, before=before, after=after)

    def _name(self, key: CacheKey) -> str:
        return self.options.key_prefix + key.to_string()

    def _slots(self, count: int) -> list[HeaderSlot]:
        assert self._slab is not None
        return self._slab.take(count)

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
        last = {self._name(key): (key, obj) for key, obj in zip(keys, objs, strict=True)}
        names = list(last)
        hosts = [host_copy(obj) for _, obj in last.values()]
        try:
            await self._run(lambda: self._store_objects(names, hosts), hosts)
        finally:
            _release_all(hosts)
        for key, obj in last.values():
            self.size_hints.saw(SizeHints.family(key), HEADER_REGION + obj.nbytes)

    def _store_objects(self, names: list[str], objs: list[MemoryObj]) -> None:
        """Put each object under its name (a worker thread): new keys zero-copy, existing ones
        overwritten with one copy (Mooncake's put would keep their old value)."""
        store, registrations = self._store, self._registrations
        assert registrations is not None
        found = store.batch_is_exist(names)
        for name, code in zip(names, found, strict=True):
            if code < 0:
                raise self._error(code, "put (exists check)", name)
        slots = self._slots(len(names))
        framed = [False] * len(names)

        def frame_headers(group: list[int]) -> None:
            for i in group:
                write_header_region(slots[i].view(), objs[i])
                framed[i] = True

        new = [i for i, code in enumerate(found) if code == 0]
        existing = [i for i, code in enumerate(found) if code == 1]

        def put(group: list[int]) -> None:
            with registrations.holding_objects([objs[i] for i in group]):
                results = store.batch_put_from_multi_buffers(
                    [names[i] for i in group],
                    [[slots[i].ptr, objs[i].data_ptr()] for i in group],
                    [[HEADER_REGION, objs[i].nbytes] for i in group],
                    self._config,
                )
            for i, code in zip(group, results, strict=True):
                if code == codes.OBJECT_ALREADY_EXISTS:
                    existing.append(i)  # another writer got there first: overwrite
                else:
                    self._check(code, "put", names[i])

        try:
            self._overlapped(groups_of(new, objs), before=frame_headers, transfer=put)
            if existing:
                frame_headers([i for i in existing if not framed[i]])
                self._overwrite(
                    [names[i] for i in existing],
                    [slots[i] for i in existing],
                    [objs[i] for i in existing],
                )
        finally:
            release_slots(slots)

    def _overwrite(
        self, names: list[str], headers: list[HeaderSlot], objs: list[MemoryObj]
    ) -> None:
        """Upsert each value from one contiguous copy of header region and payload."""
        registrations = self._registrations
        assert registrations is not None
        frames = []
        try:
            for header, obj in zip(headers, objs, strict=True):
                frame = self._block(HEADER_REGION + obj.nbytes)
                if frame is None:
                    frame = MemoryObj.from_tensor(
                        torch.empty(HEADER_REGION + obj.nbytes, dtype=torch.uint8)
                    )
                view = frame.memoryview()
                view[:HEADER_REGION] = header.view()
                view[HEADER_REGION:] = obj.memoryview()
                frames.append(frame)
            self.copied_overwrites += len(frames)
            with registrations.holding_objects(frames):
                results = self._store.batch_upsert_from(
                    names, [f.data_ptr() for f in frames], [f.nbytes for f in frames], self._config
                )
            for name, code in zip(names, results, strict=True):
                self._check(code, "put", name)
        finally:
            _release_all(frames)

    # -- get ---------------------------------------------------------------------------------

    async def _get(self, key: CacheKey) -> MemoryObj | None:
        return (await self._batched_get([key]))[0]

    async def _batched_get(self, keys: Sequence[CacheKey]) -> list[MemoryObj | None]:
        names = [self._name(key) for key in keys]
        families = {name: SizeHints.family(key) for name, key in zip(names, keys, strict=True)}
        found, damaged = await self._run(
            lambda: self._read_objects(names, families), abandoned=_release_found
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
        self, names: list[str], families: dict[str, Hashable]
    ) -> tuple[list[MemoryObj | None], dict[str, CorruptObject]]:
        """Read each name's whole value into one allocator block and return its payload in
        place (a worker thread): into a block of its family's size (:attr:`size_hints`) at
        once, else, and for a value larger than that, at the size the master reports. A value
        being written is waited for (see :func:`~kvplug_mooncake.overlap.while_being_written`)."""
        results: dict[str, MemoryObj | None] = {}
        damage = Damage()

        def attempt(pending: list[str]) -> list[str]:
            again: list[str] = []
            guessed: list[tuple[str, MemoryObj]] = []
            unsized: list[str] = []
            for name in pending:
                size = self.size_hints.size(families[name])
                block = None if size is None else self._block(size)
                if block is None:
                    unsized.append(name)
                else:
                    guessed.append((name, block))
            unsized += self._read_whole(guessed, families, results, damage, again)
            if not unsized:
                return again
            sizes = self._stored_sizes(unsized)
            absent = [name for name in unsized if name not in sizes]
            written = self._being_written(absent) if self.options.probe else set()
            sized: list[tuple[str, MemoryObj]] = []
            for name in unsized:
                size = sizes.get(name)
                block = None if size is None else self._block(size)
                if block is not None:
                    sized.append((name, block))
                elif name in written:
                    again.append(name)
                else:
                    results[name] = None  # absent, or no room to receive it: a miss
            again += self._read_whole(sized, families, results, damage, again)  # grew since
            return again

        try:
            for name in while_being_written(attempt, list(dict.fromkeys(names))):
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

    def _read_whole(
        self,
        blocks: list[tuple[str, MemoryObj]],
        families: dict[str, Hashable],
        results: dict[str, MemoryObj | None],
        damage: Damage,
        again: list[str],
    ) -> list[str]:
        """Read each name's value into its block (one ``batch_get_into`` per group) and put
        the object it holds in ``results`` (None for a miss), or its name in ``again`` (being
        written, or a first failed check). Returns the names whose value is larger than its
        block. Every block is consumed."""
        registrations = self._registrations
        assert registrations is not None
        larger: list[str] = []
        failures: list[BackendError] = []
        consumed = [False] * len(blocks)

        def read(group: list[int]) -> list[int]:
            taken = [blocks[j][1] for j in group]
            with registrations.holding_objects(taken):
                read_codes: list[int] = self._store.batch_get_into(
                    [blocks[j][0] for j in group],
                    [block.data_ptr() for block in taken],
                    [block.nbytes for block in taken],
                )
            return read_codes

        def check(group: list[int], read_codes: list[int]) -> None:
            for j, code in zip(group, read_codes, strict=True):
                name, block = blocks[j]
                consumed[j] = True
                if code >= 0:  # the whole value, code bytes long
                    try:
                        results[name] = object_of_value(name, block, code, self.allocator)
                        self.size_hints.saw(families[name], code)
                    except CorruptObject as error:
                        if damage.confirmed(name, error):
                            results[name] = None
                        else:
                            again.append(name)
                    continue
                block.release()
                if code == codes.INVALID_PARAMS:
                    larger.append(name)
                elif code == codes.REPLICA_IS_NOT_READY:
                    again.append(name)
                elif code in codes.MISSES:
                    results[name] = None
                else:
                    failures.append(self._error(code, "get", name))

        try:
            self._overlapped(
                groups_of(list(range(len(blocks))), [block for _, block in blocks]),
                transfer=read,
                after=check,
            )
        finally:
            _release_all([block for j, (_, block) in enumerate(blocks) if not consumed[j]])
        if failures:
            raise failures[0]
        return larger

    def _being_written(self, names: list[str]) -> set[str]:
        """Those of ``names`` (absent to the master's replica query) that :meth:`_probe` finds
        present after all: being written or overwritten."""
        return {name for name, there in zip(names, self._probe(names), strict=True) if there}

    def _probe(self, names: list[str]) -> list[bool]:
        """Whether each name has a value after all, though ``batch_is_exist`` or the replica
        query says it has not: both say so for as long as an overwrite of it runs. One
        ``batch_get_into`` of each value into a header slot: -704 (or another miss but -703)
        is absent; -703 (being written), -600 (larger than the slot) or a length, present."""
        if not names:
            return []
        slots = self._slots(len(names))
        try:
            read: list[int] = self._store.batch_get_into(
                names, [slot.ptr for slot in slots], [HEADER_REGION] * len(names)
            )
        finally:
            release_slots(slots)
        present = []
        for name, code in zip(names, read, strict=True):
            if code < 0 and code not in (codes.REPLICA_IS_NOT_READY, codes.INVALID_PARAMS):
                if code not in codes.MISSES:
                    raise self._error(code, "get", name)
                present.append(False)
            else:
                present.append(True)
        return present

    def _block(self, size: int) -> MemoryObj | None:
        """A host block of ``size`` bytes to read a value into: from the allocator, or (for a
        GPU allocator) from host memory."""
        allocator = self.allocator
        block = allocator.allocate((size,), torch.uint8)
        if block is not None and block.device.type != "cpu":
            block.release()
            return MemoryObj.from_tensor(torch.empty(size, dtype=torch.uint8))
        return block

    # -- get_into ----------------------------------------------------------------------------

    async def _get_into(self, key: CacheKey, dest: MemoryObj) -> bool:
        return (await self._batched_get_into([key], [dest]))[0]

    async def _batched_get_into(
        self, keys: Sequence[CacheKey], dests: Sequence[MemoryObj]
    ) -> list[bool]:
        names = [self._name(key) for key in keys]
        targets = [host_like(dest) for dest in dests]
        try:
            hits, damaged, resized = await self._run(
                lambda: self._read_into(names, targets), targets
            )
            for dest, target, hit in zip(dests, targets, hits, strict=True):
                if hit and target is not dest:
                    dest.raw.copy_(target.raw)
        finally:
            _release_all(targets)
        for key, dest, hit in zip(keys, dests, hits, strict=True):
            if hit:
                self.size_hints.saw(SizeHints.family(key), HEADER_REGION + dest.nbytes)
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
        """Scatter each value into a header slot and its destination, one
        ``batch_get_into_multi_buffers`` per group (a worker thread); a value being written is
        waited for (see :func:`~kvplug_mooncake.overlap.while_being_written`). Returns the
        hits, the names of damaged values, and the positions whose value has another size
        than its destination."""
        registrations = self._registrations
        assert registrations is not None
        hits = [False] * len(names)
        resized: list[int] = []
        damage = Damage()
        slots = self._slots(len(names))

        def attempt(pending: list[int]) -> list[int]:
            again: list[int] = []

            def read(group: list[int]) -> list[int]:
                read_codes: list[int] = self._store.batch_get_into_multi_buffers(
                    [names[i] for i in group],
                    [[slots[i].ptr, dests[i].data_ptr()] for i in group],
                    [[HEADER_REGION, dests[i].nbytes] for i in group],
                )
                return read_codes

            def check(group: list[int], read_codes: list[int]) -> None:
                for i, code in zip(group, read_codes, strict=True):
                    if code == HEADER_REGION + dests[i].nbytes:
                        try:
                            self._verify_into(names[i], slots[i], dests[i])
                            hits[i] = True
                        except CorruptObject as error:
                            if not damage.confirmed(names[i], error):
                                again.append(i)
                    elif code == codes.REPLICA_IS_NOT_READY:
                        again.append(i)
                    elif code in SIZE_MISMATCH:
                        resized.append(i)
                    elif code < 0 and code not in codes.MISSES:
                        self._check(code, "get", names[i])

            self._overlapped(groups_of(pending, dests), transfer=read, after=check)
            return again

        try:
            with registrations.holding_objects(dests):
                while_being_written(attempt, list(range(len(names))))
        finally:
            release_slots(slots)
        return hits, damage.found, resized

    def _verify_into(self, name: str, slot: HeaderSlot, dest: MemoryObj) -> None:
        """Check that ``dest`` now holds the payload the header region in ``slot`` describes;
        :class:`~kvplug.errors.CorruptObject` when it does not."""
        header = read_header_region(slot.view(), name, HEADER_REGION + dest.nbytes)
        verify_payload(header, dest.memoryview(), checksum)

    # -- contains, remove, damage ------------------------------------------------------------

    async def _contains(self, key: CacheKey) -> bool:
        return (await self._present([self._name(key)]))[0]

    async def _batched_exists(self, keys: Sequence[CacheKey]) -> list[bool]:
        return await self._present([self._name(key) for key in keys])

    async def _present(self, names: list[str]) -> list[bool]:
        return await self._run(lambda: self._present_now(names))

    def _present_now(self, names: list[str]) -> list[bool]:
        """``batch_is_exist``; with ``probe``, each no checked by :meth:`_probe` (it says no
        while a value is overwritten), a value being written counting as present, as ``get``
        waits for it."""
        found: list[int] = self._store.batch_is_exist(names)
        for name, code in zip(names, found, strict=True):
            if code < 0:
                raise self._error(code, "contains", name)
        present = [code == 1 for code in found]
        if self.options.probe:
            doubtful = [i for i, there in enumerate(present) if not there]
            for i, there in zip(doubtful, self._probe([names[i] for i in doubtful]), strict=True):
                present[i] = there
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


def _hand_over(future: concurrent.futures.Future[T], receiver: Callable[[T], None]) -> None:
    """Give the result of a call nobody waits for any more to ``receiver``."""
    if not future.cancelled() and future.exception() is None:
        receiver(future.result())


def _release_all(objs: Sequence[MemoryObj]) -> None:
    for obj in objs:
        obj.release()


def _release_found(result: tuple[Sequence[MemoryObj | None], Any]) -> None:
    for obj in result[0]:
        if obj is not None:
            obj.release()


__all__ = ["MooncakeBackend", "installed_version", "load_store_class"]
