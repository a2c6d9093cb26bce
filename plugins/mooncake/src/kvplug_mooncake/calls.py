"""The Mooncake Store client a backend holds, and how its calls run: opened once (the master
and the wheel checked, the allocator's buffer and a header slab registered), closed after the
calls in flight, each blocking call on a worker thread that holds the memory it moves, and each
return code mapped to the kvplug error that names it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar

import torch

from kvplug.backend import Backend
from kvplug.damage import DamagedValues
from kvplug.errors import BackendError, BackendUnavailable, ConfigError
from kvplug.keys import CacheKey
from kvplug.memory import FreeListAllocator, MemoryObj
from kvplug.options import BackendOptions
from kvplug.url import BackendURL
from kvplug_mooncake import codes
from kvplug_mooncake.client import (
    check_master_answers,
    check_metadata_server,
    load_store_class,
    set_up_client,
)
from kvplug_mooncake.layout import SizeHints
from kvplug_mooncake.options import MooncakeOptions, merged_settings
from kvplug_mooncake.overlap import overlapped
from kvplug_mooncake.registration import HeaderSlab, HeaderSlot, Registrations

T = TypeVar("T")

LEASE_RETRY = 0.05
RECOVERY_WINDOW = 30.0
"""Seconds after the master was last unreachable during which a full store (-200) is taken
for one whose segments are being remounted (see :meth:`MooncakeCalls._error`)."""


class MooncakeCalls(Backend):
    """What every operation of :class:`~kvplug_mooncake.backend.MooncakeBackend` stands on:
    Mooncake's client, its registered memory, the worker threads its calls run on, and the
    mapping of its return codes to kvplug's errors."""

    Options: ClassVar[type[BackendOptions]] = MooncakeOptions
    options: MooncakeOptions

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
                release_all(held)

        try:
            future = pool.submit(run)
        except RuntimeError:  # the pool shut down: close() ran meanwhile
            release_all(held)
            self.ensure_open()
            raise
        future.add_done_callback(lambda done: release_all(held) if done.cancelled() else None)
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

    def _block(self, size: int) -> MemoryObj | None:
        """A host block of ``size`` bytes to read a value into: from the allocator, or (for a
        GPU allocator) from host memory."""
        allocator = self.allocator
        block = allocator.allocate((size,), torch.uint8)
        if block is not None and block.device.type != "cpu":
            block.release()
            return MemoryObj.from_tensor(torch.empty(size, dtype=torch.uint8))
        return block

    async def _remove_name(self, name: str, *, force: bool) -> bool:
        """Remove ``name`` (``force``: despite a reader's lease); whether it was there. A
        refusal for a reader's lease (-706) is waited out."""
        while True:
            code = await self._run(lambda: self._store.remove(name, force=force))
            if code == 0:
                return True
            if code == codes.OBJECT_NOT_FOUND:
                return False
            if code != codes.OBJECT_HAS_LEASE:
                raise self._error(code, "remove", name)
            await asyncio.sleep(LEASE_RETRY)  # a reader holds the lease: wait it out


def _hand_over(future: concurrent.futures.Future[T], receiver: Callable[[T], None]) -> None:
    """Give the result of a call nobody waits for any more to ``receiver``."""
    if not future.cancelled() and future.exception() is None:
        receiver(future.result())


def release_all(objs: Sequence[MemoryObj]) -> None:
    """Release each of ``objs``."""
    for obj in objs:
        obj.release()


__all__ = ["LEASE_RETRY", "RECOVERY_WINDOW", "MooncakeCalls", "release_all"]
