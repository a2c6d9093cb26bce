"""The local-disk tier, ``file:///dir``: KV-cache chunks in files, found again after a restart.

URL and options (query parameters or keyword options, keywords win)::

    file:///var/cache/kvplug?max_size=100GiB&eviction=lru
    file:///nvme0/kv,/nvme1/kv?fsync=true            # several directories, sharded by key hash

* the URL path names one absolute directory, or several separated by commas; the option
  ``paths`` (a list, or a comma-separated string) adds more. Each is created (mode 700) when
  missing. Objects are spread over the directories by a hash of their key.
* ``max_size``: bytes of object files the tier may hold over all directories (an int or a size
  string, ``512MiB``, ``100GiB``); default 10 GiB. Past it, keys are evicted by ``eviction``.
* ``eviction``: ``lru`` (default), ``lfu`` or ``fifo`` (see :mod:`kvplug.eviction`).
* ``pin_ttl``: seconds a pin lasts before it expires by itself. Default 300.
* ``o_direct``: use O_DIRECT where the filesystem supports it (default true; probed per
  directory at open, with one warning per directory that refuses it or whose probe could not
  run, such as on a full disk: puts there probe again until one succeeds); false: never.
* ``fsync``: fsync each file and its directory before a put returns, so objects survive a
  power loss (default false: a crashed *process* never loses or tears an object either way).
* ``workers``: threads doing file I/O (default 4). ``queue_depth``: operations in flight at
  most (default 64); further callers wait their turn.
* ``allow_shared_dir``: accept a directory that another user owns or can write to (default
  false: such a directory is refused, since another user could plant or alter cached data).
* ``timeout``: common to every backend, the deadline of one operation in seconds. Opening,
  which rebuilds the index from the files on disk, has none.

Example::

    >>> import asyncio, tempfile, torch, kvplug
    >>> async def main(path):
    ...     disk = await kvplug.open_backend(f"file://{path}/kv?max_size=64MiB")
    ...     key = kvplug.CacheKey("llama", 1, 0, 42)
    ...     obj = disk.allocator.allocate((2, 4, 16, 8), torch.float16)
    ...     obj.tensor.fill_(1.0)
    ...     await disk.put(key, obj)            # written with O_DIRECT from obj's own memory
    ...     obj.release()                       # put never takes the caller's reference
    ...     await disk.close()
    ...     again = await kvplug.open_backend(f"file://{path}/kv")   # persistent
    ...     hit = await again.get(key)
    ...     total = hit.tensor.sum().item()
    ...     hit.release()
    ...     await again.close()
    ...     return total
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     asyncio.run(main(tmp))
    1024.0
"""

# File descriptors and str paths on the I/O path: os.* is the syscall itself, pathlib would add
# an object per call and hide which call ran.
# ruff: noqa: PTH102, PTH105, PTH108, PTH116, PTH118, PTH120

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import itertools
import logging
import os
import shutil
import stat
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, ClassVar, TypeVar, cast

import numpy as np
import torch
import xxhash

from kvplug.backend import Backend, Capabilities, gather_all
from kvplug.damage import DamagedValues
from kvplug.errors import (
    BackendClosed,
    BackendError,
    BackendTimeout,
    CapacityExceeded,
    ConfigError,
    CorruptObject,
    InvalidBackendURL,
    LayoutMismatch,
)
from kvplug.frame import encode_header, payload_checksum, verify_payload
from kvplug.index import EvictableIndex, PinsInIndex, Reservation
from kvplug.keys import CacheKey, InvalidKey
from kvplug.lease import Lease, Revoked
from kvplug.memory import Allocator, FreeListAllocator, MemoryFormat, MemoryObj, nbytes_of
from kvplug.options import BackendOptions
from kvplug.url import BackendURL
from kvplug_disk.directories import (
    OPEN_FLAGS,
    Claim,
    Directory,
    _directory_paths,
    _prepare_directory,
    open_directory,
)
from kvplug_disk.fileio.base import FileIO, Payload, synchronize
from kvplug_disk.fileio.posix import PosixFileIO
from kvplug_disk.fileops import (
    O_DIRECT,
    Access,
    Deleted,
    LiveWriters,
    NotAnObject,
    WriteRefused,
    WriterLock,
    byte_view,
    classify_os_error,
    clear_the_way,
    delete_object_file,
    fsync_dir,
    header_buffer,
    kind_of,
    move_aside,
    open_object,
    open_object_sized,
    read_all,
    reason,
    unlink_quietly,
)
from kvplug_disk.index import IndexEntry, shared_length
from kvplug_disk.layout import (
    BLOCK,
    FLAG_NO_PAYLOAD_CHECKSUM,
    MAX_KEY_BYTES,
    SERDE,
    SUFFIX,
    ObjectHeader,
    checked_header,
    decode_block,
    digest,
    encode_block,
    file_length,
    new_writer_id,
    padded,
    temp_name,
)
from kvplug_disk.options import (
    DEFAULT_MAX_SIZE,
    DEFAULT_QUEUE_DEPTH,
    DEFAULT_WORKERS,
    DiskOptions,
)
from kvplug_disk.rebuild import DiskScan, KeptTemp, log_rebuild
from kvplug_disk.workers import READ_HELPERS, Workers, release_read

T = TypeVar("T")
logger = logging.getLogger("kvplug.disk")

CLOSE_WAIT = 4.0
"""Seconds ``close`` waits for file I/O in flight before it returns anyway."""
BOUNCE_POOL_SIZE = 64 << 20
"""Aligned staging memory for objects that do not live in 4096-aligned host memory."""
RETRY_UNDELETABLE = 30.0
"""Seconds eviction leaves a file it could not delete alone before it tries again."""
TEMP_RECHECK = 60.0
"""Seconds between looks at temporary files of other live writers (also done whenever a put
needs the room they hold)."""
_WRITE_LEFT = "This object was not stored and no partial file of it was left; reads keep working."
_DELETE_LEFT = (
    "The object is still stored and still served, and its bytes still count against max_size."
)
READ_PIECE = 4 << 20
"""Bytes of one read request when a payload is read in pieces, all in flight at once on the
reader threads, and hashed as they arrive (a multiple of the block size, so every piece keeps
O_DIRECT's alignment); pieces are larger when a payload would need more than one per reader
thread. Payloads up to this size are read in one call and hashed after."""
_STRIPES = 64
_ZEROS = bytes(BLOCK)


def _aligned_block(obj: MemoryObj, length: int, *, own_memory: bool) -> torch.Tensor | None:
    """The first ``length`` bytes of ``obj``'s allocator block, when that block is 4096-aligned
    memory of a :class:`FreeListAllocator` and at least that long; or, with ``own_memory``,
    ``obj``'s own bytes when they are 4096-aligned host memory of exactly ``length`` bytes (an
    engine's buffer, whatever owns it); else None.

    Such a block can go to and from the file with O_DIRECT as it is: the bytes after the
    object's end up to ``length`` are the block's own padding.
    """
    if (
        own_memory
        and obj.device.type == "cpu"
        and obj.nbytes == length
        and obj.data_ptr() % BLOCK == 0
    ):
        return obj.raw
    allocator = obj.allocator
    if not isinstance(allocator, FreeListAllocator) or allocator.alignment % BLOCK:
        return None
    buffer = allocator.buffer
    if obj.phy_size < length:
        return None
    start = buffer.data_ptr() + obj.offset
    if start % BLOCK or (obj.nbytes and start != obj.data_ptr()):
        return None
    return buffer[obj.offset : obj.offset + length]


def _whole(buffer: torch.Tensor, nbytes: int, o_direct: bool) -> Payload:
    """A payload that is the one flat buffer ``buffer`` (its first ``nbytes`` the object's)."""
    if buffer.device.type != "cpu":
        return Payload([], o_direct, None, buffer)
    view = byte_view(buffer)
    return Payload([view], o_direct, view[:nbytes], buffer)


def _length_only(nbytes: int) -> Any:
    """A zero-copy buffer that is ``nbytes`` long and holds nothing: encode_header reads only
    the payload's length when its checksum is given, and a GPU payload has no host bytes."""
    return np.broadcast_to(np.zeros(1, np.uint8), (nbytes,))


def _computed(checksum: int, payload: Any) -> int:
    """A ``digest`` for :func:`~kvplug.frame.verify_payload` that answers the checksum
    already computed while the payload was read."""
    return checksum


def _checksum(access: Access, host: memoryview) -> int:
    with access():
        return payload_checksum(host)


def _device_checksum(access: Access, payload: torch.Tensor) -> int:
    with access():
        host = payload.cpu()
    return payload_checksum(byte_view(host))


def _positions(indexes: Sequence[int]) -> str:
    """``positions 0, 2 and 3`` (at most 8 named), for messages about a batch."""
    if not indexes:
        return "none"
    shown = [str(i) for i in indexes[:8]]
    if len(indexes) > len(shown):
        return f"positions {', '.join(shown)} and {len(indexes) - len(shown)} more"
    if len(shown) == 1:
        return f"position {shown[0]}"
    return f"positions {', '.join(shown[:-1])} and {shown[-1]}"


# -- the backend ----------------------------------------------------------------------------


class DiskBackend(PinsInIndex, Backend):
    """A size-capped, persistent store of memory objects in files on local disks.

    **Files.** One file per object, ``<dir>/<2 hex>/<xxh3-128 of the key>.kv``: a 4096-byte
    header block (kvplug's frame header with the payload checksum, then the key, then a
    checksum of the whole block) and the payload from offset 4096, zero-padded to whole blocks
    (see :mod:`kvplug_disk.layout`). File names never contain key contents.

    **Atomicity and crashes.** A put writes a temporary file in the same subdirectory and
    renames it over the object's name, so readers see the old object or the new one, never a
    mix, and a crash leaves no half-written object under an object name. With ``fsync=true``
    the file and its directory are fsynced before the put returns. At open the index is rebuilt
    from the files: objects of earlier runs are found again, damaged object files are deleted,
    foreign files are left alone; one summary line is logged. Each backend holds a lock file
    in each directory while it is open (see :mod:`kvplug_disk.layout`); temporary files whose
    writer's lock is free (the writer died, whatever its pid) are deleted, those of live
    writers are left alone and count against ``max_size`` until they are gone.

    **Foreign things.** Anything that is not a regular file under an object's name (a
    directory, a symbolic link, a FIFO, a socket, a device node) reads as a miss, counted in
    :attr:`foreign_files`, and leaves the index; it is never followed, opened as a device or
    waited on, and it is left where it is. A put of that key replaces it (a directory that is
    not empty is moved aside, never deleted). Something other than a directory where a
    subdirectory should be is moved aside when a put needs the subdirectory.

    **Reads** verify the header block, the key inside it, the file length and the payload
    checksum; anything damaged reads as a miss, is counted in :attr:`corrupt_objects` and its
    file is removed (clause 6). A payload read with O_DIRECT into host memory, larger than
    :data:`READ_PIECE`, is read in pieces, all in flight at once, and its checksum computed as
    the pieces arrive, so that hashing overlaps the read; nothing is returned before the
    checksum matched.

    **Data movement.** Payload bytes go through one :class:`~kvplug_disk.fileio.FileIO`,
    :attr:`io` (``file_io=``; default :class:`~kvplug_disk.fileio.PosixFileIO`): the engine
    plans where each payload lives in memory and checks what is read, the FileIO only moves
    bytes. :class:`~kvplug_disk.gds.backend.GdsBackend` is this class with
    :class:`~kvplug_disk.fileio.CuFileIO`.

    **O_DIRECT.** Probed per directory at open. Objects in a 4096-aligned
    :class:`~kvplug.memory.FreeListAllocator` (the core's default) go straight between their
    allocator block and the file with ``preadv``/``pwritev``; ``get`` allocates its result in
    :attr:`allocator` and reads into it the same way. Other objects are staged through an
    internal aligned bounce pool. A directory that refuses O_DIRECT (tmpfs) uses buffered I/O.

    **Capacity.** ``max_size`` caps the bytes of object files (header and padding included)
    and of other writers' temporary files; keys are evicted by policy, never a pinned one, to
    make room. A file that eviction cannot delete keeps counting (it is still on disk and
    still served) and is tried again after :data:`RETRY_UNDELETABLE` seconds; each failure is
    counted in :attr:`eviction_failures` and the first one per directory and cause is logged.
    A disk with less free space than an object needs, or a write that fails with ENOSPC or
    EDQUOT, raises :class:`~kvplug.errors.CapacityExceeded`, leaves no temporary file and does
    not affect reads. Each write claims its size of the disk's free space while it runs (less
    what the disk has already allocated to its file), so writes that start together never all
    begin on room for some of them. A ``batched_put`` that stores some of its objects says
    which, in ``stored`` and in its message.

    **Cancellation** (``releases_on_cancel``). ``put`` and ``get_into`` lend the caller's
    object to the file I/O threads in a :class:`~kvplug.lease.Lease`: every system call, copy
    and hash touching it runs inside the lease, and a cancelled operation takes it back before
    its cancellation finishes, waiting only for the access in progress. The thread abandons
    the work at its next access: a cancelled put leaves no file and no index entry (the rename
    into place and the index update run inside the lease, after the last read), a cancelled
    get_into writes nothing more into the destination.

    **Errors.** Every ``OSError`` of a put or a remove becomes a kvplug error naming the
    directory, the cause and the fix (:func:`kvplug_disk.fileops.classify_os_error`). A
    directory that refuses writes (read-only filesystem, no permission, immutable) raises
    :class:`~kvplug_disk.fileops.WriteRefused`, a ``CapacityExceeded``: that object was not
    stored (or not removed), and reads and other keys keep working, so a Store drops the put
    instead of skipping the tier. ``remove`` returns True only when it deleted the file.

    **Concurrency.** File I/O runs on ``workers`` threads with at most ``queue_depth``
    operations in flight; the index is guarded by a thread lock never held across an
    ``await``, so one backend serves several event loops and threads. Writes, removals and
    evictions of one key are serialized; reads are not (an open file stays readable when it is
    replaced or removed).

    **Sharing.** Several instances (processes, an engine's tensor-parallel ranks) may use one
    directory, and ``shared_across_processes`` is declared: each rebuilds its index from the
    files at open, and ``get``, ``get_into``, ``contains``, ``remove`` and ``pin`` of a key
    not in the index look for its file, so objects written by another instance after open are
    found; ``contains`` of an indexed key checks that its file is still there (another
    instance may have evicted it). ``max_size`` and eviction act on what this instance knows:
    give every instance on a directory the same ``max_size``.

    Counters: hits, misses, bytes and latency per operation in
    :meth:`~kvplug.backend.Backend.operation_stats` (as for every backend); what is the tier's
    own in :attr:`evictions`, :attr:`corrupt_objects`, :attr:`foreign_files`,
    :attr:`eviction_failures`, :attr:`bytes_held`, :attr:`rebuild_stats` and :meth:`stats`.
    """

    capabilities = Capabilities(
        pin=True,
        persistent=True,
        shared_across_processes=True,
        remove=True,
        list_keys=True,
        releases_on_cancel=True,
    )
    Options: ClassVar[type[BackendOptions]] = DiskOptions
    # What the contract suite opens to fill the store (clauses 8, 9).
    contract_small_options: ClassVar[dict[str, Any]] = {"max_size": "4MiB"}
    # The clause the contract suite cannot run here, and why (its verdict says "waived").
    contract_waivers: ClassVar[dict[int, str]] = {
        10: "local files: there is no server to pause or stop"
    }
    options: DiskOptions
    _medium: ClassVar[str] = "disk"
    """What error messages call the tier's storage."""

    def __init__(
        self,
        url: BackendURL | str,
        *,
        allocator: Allocator | None = None,
        file_io: FileIO | None = None,
        **options: Any,
    ) -> None:
        """``file_io`` moves the payloads (default: :class:`~kvplug_disk.fileio.PosixFileIO`);
        see :mod:`kvplug_disk.fileio`."""
        super().__init__(url, allocator=allocator, **options)
        self._io: FileIO | None = file_io if file_io is not None else self._default_file_io()
        if self.url.hosts or self.url.username or self.url.password:
            raise InvalidBackendURL(
                f"{self.url} names a host or user, but {self.url.scheme}:// takes local "
                "directories. Write the absolute path after three slashes: "
                f"{self.url.scheme}:///var/cache/kvplug"
            )
        self.paths: tuple[str, ...] = _directory_paths(self.url, self.options.paths)
        """The configured directories, in sharding order."""
        self.max_size: int = self.options.max_size
        self.directories: list[Directory] = []
        """The directories in use, with their O_DIRECT state (filled by :meth:`open`)."""
        self._lock = threading.Lock()
        self._stripes = [threading.RLock() for _ in range(_STRIPES)]
        self._index: EvictableIndex[CacheKey, IndexEntry] = EvictableIndex(
            self.max_size, self.options.eviction, pin_ttl=self.options.pin_ttl
        )
        self._generations = itertools.count(1)
        self._open_lock = threading.Lock()
        self._directories_open = False
        self._workers = Workers(
            self.options.workers, self.options.queue_depth, self._closed_error, self._idle
        )
        self._bounce: FreeListAllocator | None = None
        self._bounce_lock = threading.Lock()
        self._writer = new_writer_id()
        self._writer_locks: list[WriterLock] = []
        self._kept_temps: dict[str, KeptTemp] = {}
        self._temps_checked_at = 0.0
        self._reported: set[tuple[str, str]] = set()
        self._report_lock = threading.Lock()
        self.evictions = 0
        self.damaged_values = DamagedValues[str](self.url)
        """Damaged objects found (at open or on read), counted, logged and removed."""
        self.allocation_failures = 0
        """Hits that read as misses because :attr:`allocator` had no room."""
        self.foreign_files = 0
        """Object names found holding something other than a regular file (read as misses)."""
        self.discovered = 0
        """Objects found on demand: written by another instance after this one opened."""
        self.eviction_failures = 0
        """Files eviction tried to delete and could not (they still count in bytes_held)."""
        self.rebuild_stats: dict[str, int] = {}
        """What the last open found on disk: objects, bytes, corrupt, temp_removed, ..."""

    # -- counters ---------------------------------------------------------------------------

    @property
    def bytes_held(self) -> int:
        """Bytes of the stored object files (header blocks and padding included)."""
        return self._index.bytes_held

    @property
    def corrupt_objects(self) -> int:
        """:class:`~kvplug.backend.CountsCorruptObjects`: damaged objects found so far."""
        return self.damaged_values.count

    def stats(self) -> dict[str, int]:
        """A consistent snapshot of the counters. ``temp_bytes`` and ``temp_files``: other
        live writers' temporary files, which count against ``max_size``."""
        with self._lock:
            return {
                "evictions": self.evictions,
                "corrupt_objects": self.corrupt_objects,
                "allocation_failures": self.allocation_failures,
                "foreign_files": self.foreign_files,
                "discovered": self.discovered,
                "eviction_failures": self.eviction_failures,
                "bytes_held": self._index.bytes_held,
                "temp_bytes": self._index.external_bytes,
                "temp_files": len(self._kept_temps),
                "keys": len(self._index),
                "pinned_keys": self._index.pinned_keys,
                "max_size": self.max_size,
            }

    def __len__(self) -> int:
        return len(self._index)

    def describe(self) -> dict[str, str]:
        """What ``kvplug check`` prints: each directory and how its files move now."""
        return {"directories": "; ".join(d.describe() for d in self.directories)}

    # -- open -------------------------------------------------------------------------------

    def deadline(self) -> float | None:
        """``options.timeout`` once the directories are open; none before. Opening rebuilds
        the index from every file on disk, which takes as long as the tier's contents need;
        an operation that finds the directories not yet open opens them first and keeps the
        deadline for its own work (see :meth:`_run`)."""
        return self.options.timeout if self._directories_open else None

    async def _open(self) -> None:
        """Check and create the directories, probe O_DIRECT in each, and rebuild the index
        from the files on disk. Operations do it themselves when ``open`` was not awaited."""
        await self._ready()

    async def _ready(self) -> None:
        if not self._directories_open:
            await asyncio.to_thread(self._open_sync)

    def _open_sync(self) -> None:
        with self._open_lock:
            if self._directories_open:
                return
            self.ensure_open()
            try:
                self._open_directories()
            except BaseException:
                self._release_writer_locks()
                raise
            self._directories_open = True

    def _open_directories(self) -> None:
        directories: list[Directory] = []
        seen: set[tuple[int, int]] = set()
        for path in self.paths:
            _prepare_directory(path, self.url, self.options.allow_shared_dir)
            info = os.stat(path)
            if (info.st_dev, info.st_ino) in seen:
                continue  # two names of one directory
            seen.add((info.st_dev, info.st_ino))
            self._hold_writer_lock(path)
            directories.append(open_directory(self.url, path, self._writer, self.options.o_direct))
        self.directories = directories
        self._prepared()
        self._rebuild()

    def _hold_writer_lock(self, path: str) -> None:
        try:
            self._writer_locks.append(WriterLock(path, self._writer))
        except OSError as error:
            raise ConfigError(
                f"{self.url}: cannot create this backend's lock file in {path}: "
                f"{reason(error)}. The cache directory must be writable by this user; fix its "
                "permissions or choose another directory."
            ) from None

    def _release_writer_locks(self) -> None:
        """Give up this backend's claim on its directories: its temporary files are gone."""
        locks, self._writer_locks = self._writer_locks, []
        for lock in locks:
            lock.release()

    def _prepared(self) -> None:
        """Called by open once the directories exist and were probed, before the index is
        rebuilt: the place for a subclass (``gds://``) to check more. Default: nothing."""

    def _rebuild(self) -> None:
        scan = DiskScan(self.url, self.options.allow_shared_dir, self._temp_in_use, self._entry)
        scan.run(self.directories)
        stats = scan.stats
        with self._lock:
            for path, temp in scan.kept_temps.items():
                if path not in self._kept_temps:
                    self._kept_temps[path] = temp
                    self._index.external_bytes += temp.size
            for key, (_, entry) in sorted(scan.found.items(), key=lambda item: item[1][0]):
                self._index.put(key, entry, entry.size)
            stats["objects"] = len(self._index)
            stats["bytes"] = self._index.bytes_held
            while self._index.used > self.max_size and self._index.evict_one(self._evicted):
                stats["evicted"] += 1
            self.damaged_values.tally(stats["corrupt"])
            self._temps_checked_at = time.monotonic()
        self.rebuild_stats = stats
        log_rebuild(self.url, len(self.directories), stats)

    def _temp_in_use(
        self, directory: Directory, pid: str, writer: str, mtime: float, writers: LiveWriters
    ) -> bool:
        """Whether a temporary file of ``writer`` (pid ``pid``) last written at ``mtime``
        must be kept: its writer holds its lock."""
        return writers.alive(directory.path, pid, writer)

    def _recheck_temps(self) -> None:
        """Look at the other writers' temporary files found at open again: forget those that
        are gone, delete those whose writer has died since."""
        with self._lock:
            kept = list(self._kept_temps.items())
            self._temps_checked_at = time.monotonic()
        writers = LiveWriters()
        for path, temp in kept:
            try:
                info = os.lstat(path)
                if stat.S_ISREG(info.st_mode) and self._temp_in_use(
                    temp.directory, temp.pid, temp.writer, info.st_mtime, writers
                ):
                    continue
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as error:
                logger.debug("%s: cannot remove %s: %s", self.url, path, reason(error))
                continue
            with self._lock:
                if self._kept_temps.pop(path, None) is not None:
                    self._index.external_bytes -= temp.size

    # -- internals (callers hold self._lock) ------------------------------------------------

    def _entry(self, stem: str, directory: Directory, header: ObjectHeader) -> IndexEntry:
        frame = header.frame
        return IndexEntry(
            stem,
            directory,
            header.file_length,
            frame.shape,
            frame.dtype,
            frame.fmt,
            frame.payload_len,
            next(self._generations),
        )

    def _stripe(self, stem: str) -> threading.RLock:
        return self._stripes[int(stem[-4:], 16) % _STRIPES]

    def _shard(self, stem: str) -> Directory:
        return self.directories[int(stem[2:10], 16) % len(self.directories)]

    def _probe_order(self, stem: str) -> list[Directory]:
        first = self._shard(stem)
        return [first, *(d for d in self.directories if d is not first)]

    def _evicted(self, key: CacheKey, entry: IndexEntry) -> bool:
        """The index's eviction callback (self._lock held): delete the victim's file."""
        stripe = self._stripe(entry.stem)
        # Never wait here (the index lock is held): a key being written is skipped.
        if not stripe.acquire(blocking=False):
            return False
        try:
            deleted = delete_object_file(entry.path)
        except OSError as error:
            self._index.hold_off(key, RETRY_UNDELETABLE)
            self.eviction_failures += 1
            self._report_undeletable(entry, error)
            return False
        finally:
            stripe.release()
        if deleted is Deleted.FOREIGN:
            self.foreign_files += 1
        else:
            self.evictions += 1
        return True

    def _report_undeletable(self, entry: IndexEntry, error: OSError) -> None:
        first = self._first_report(entry.directory.path, error)
        logger.log(
            logging.WARNING if first else logging.DEBUG,
            "%s: eviction could not delete %s: %s. Its %d bytes still count against max_size "
            "(%d), so the tier holds fewer objects until it can be deleted; it stays readable "
            "and is tried again in %.0f s. %s",
            self.url,
            entry.path,
            reason(error),
            entry.size,
            self.max_size,
            RETRY_UNDELETABLE,
            "Make the directory writable for this user (permissions, a read-only mount, an "
            "immutable attribute: lsattr -d).",
        )

    def _first_report(self, where: str, cause: OSError | str) -> bool:
        """True the first time this backend sees ``cause`` (an OSError's errno, or words) in
        ``where`` (callers log at WARNING then and at DEBUG after)."""
        with self._report_lock:
            report = (where, cause if isinstance(cause, str) else str(cause.errno))
            if report in self._reported:
                return False
            self._reported.add(report)
            return True

    def _closed_error(self) -> BackendClosed:
        return BackendClosed(f"{self.url} is closed; open a new backend with open_backend().")

    def _check_open_worker(self) -> None:
        if self._closed:
            raise self._closed_error()

    # -- the worker pool ----------------------------------------------------------------------

    def _idle(self) -> None:
        if self._closed:
            self._release_writer_locks()  # the last file I/O after close is done

    async def _run(
        self,
        what: str,
        work: Callable[[], T],
        *,
        not_run: Callable[[], None] | None = None,
        abandoned: Callable[[T], None] | None = None,
    ) -> T:
        """Run ``work`` on the pool within a queue slot, after opening the directories if
        that was not done yet.

        The deadline is the template's (:meth:`deadline`); an operation that had to open the
        directories first ran without it, and keeps ``options.timeout`` for ``work`` itself
        (``what``, such as ``"get of <key>"``, names it in the :class:`BackendTimeout`).
        Cancelled while waiting (a deadline), ``work`` may still run or be running on its
        thread: ``not_run`` is called when ``work`` never runs (no slot, closed, cancelled in
        the queue), so that memory retained for it is released; ``abandoned`` gets the
        result of a ``work`` whose caller stopped waiting.
        """
        if self._directories_open:
            return await self._workers.submit(work, not_run, abandoned, self.ensure_open)
        try:
            await self._ready()
        except BaseException:
            if not_run is not None:
                not_run()
            raise
        try:
            async with asyncio.timeout(self.options.timeout):
                return await self._workers.submit(work, not_run, abandoned, self.ensure_open)
        except TimeoutError:
            raise BackendTimeout(
                f"{what} on {self.url} took longer than {self.options.timeout} s; the disk is "
                "slow or its file I/O threads are busy. Raise the 'timeout' option or check "
                "the disk."
            ) from None

    # -- memory -------------------------------------------------------------------------------

    @property
    def io(self) -> FileIO:
        """The :class:`~kvplug_disk.fileio.FileIO` payloads move through."""
        if self._io is None:
            raise BackendError(f"{self.url} is not open yet; await open() first.")
        return self._io

    def _default_file_io(self) -> FileIO | None:
        """The FileIO of a backend given none (None: chosen at open)."""
        return PosixFileIO()

    def _staging_block(self, length: int) -> MemoryObj | None:
        """``length`` bytes of 4096-aligned memory the I/O seam takes, for a payload whose own
        memory it cannot use; None when there is none to spare (then buffered I/O)."""
        with self._bounce_lock:
            if self._bounce is None:
                self._bounce = FreeListAllocator(BOUNCE_POOL_SIZE, alignment=BLOCK, pin=False)
            bounce = self._bounce
        return bounce.allocate((length,), torch.uint8, MemoryFormat.BINARY_BUFFER)

    def _using_block(self, obj: MemoryObj) -> None:
        """``obj``'s allocator block is about to be moved as it is (``gds://`` registers the
        allocator's buffer with cuFile here). Default: nothing."""

    def _checksums_device_memory(self) -> bool:
        """Whether payloads in device memory are checksummed too (copied to the host)."""
        return False

    def _plan(
        self,
        obj: MemoryObj,
        length: int,
        o_direct: bool,
        writing: bool,
        access: Access = nullcontext,
    ) -> Payload:
        """How ``obj``'s payload (``length`` bytes on disk, block-padded) moves. ``access``
        wraps each step that touches ``obj``'s memory (the copies here, and the payload's
        :attr:`~kvplug_disk.fileio.Payload.access` when it moves that memory itself)."""
        nbytes = obj.nbytes
        io = self.io
        if not length:
            return Payload([], o_direct, memoryview(b""))
        if o_direct or not io.moves_host_views:
            block = _aligned_block(obj, length, own_memory=io.moves_host_views)
            if block is not None and io.accepts(block):  # the fast path: no copy at all
                self._using_block(obj)
                if writing and length > nbytes:
                    with access():
                        block[nbytes:].zero_()  # the block's padding: never leak stale memory
                payload = _whole(block, nbytes, o_direct)
                payload.access = access
                return payload
            bounce = self._staging_block(length)
            if bounce is None and not io.moves_host_views:  # it takes no host views: a copy
                bounce = FreeListAllocator(length, alignment=BLOCK, pin=False).allocate(
                    (length,), torch.uint8, MemoryFormat.BINARY_BUFFER
                )
            if bounce is not None:
                raw = bounce.raw
                if writing:
                    try:
                        with access():
                            raw[:nbytes].copy_(obj.raw.reshape(-1))
                    except BaseException:
                        bounce.release()
                        raise
                    raw[nbytes:].zero_()
                payload = _whole(raw, nbytes, o_direct)
                payload.bounce = bounce
                if not writing:
                    payload.staging = raw[:nbytes]
                return payload
        # Buffered I/O takes any host memory; device memory goes through a host copy.
        staging: torch.Tensor | None = None
        moves: Access = nullcontext
        if obj.device.type == "cpu":
            view = byte_view(obj.raw)
            moves = access
        elif writing:
            with access():
                view = byte_view(obj.raw.cpu())
        else:
            staging = torch.empty(nbytes, dtype=torch.uint8)
            view = byte_view(staging)
        buffers = [view]
        if writing and length > nbytes:
            buffers.append(memoryview(_ZEROS)[: length - nbytes])
        return Payload(buffers, False, view, staging=staging, access=moves)

    # -- writes -------------------------------------------------------------------------------

    def _subdir(self, directory: Directory, name: str, *, create: bool = False) -> str:
        """The subdirectory ``name`` of ``directory``, made when missing; anything else found
        under its name (a file, a FIFO, a symbolic link, even to a directory) is moved aside
        first. Raises the OSError when that fails."""
        path = os.path.join(directory.path, name)
        if name in directory.subdirs and not create:
            return path
        with directory.lock:
            try:
                os.mkdir(path, 0o700)
            except FileExistsError:
                mode = os.lstat(path).st_mode
                if stat.S_ISDIR(mode):
                    directory.subdirs.add(name)
                    return path
                moved = move_aside(path)
                logger.warning(
                    "%s: %s was a %s, not a subdirectory of the cache; it was moved aside to "
                    "%s and a subdirectory made in its place. Remove it when you no longer "
                    "need it.",
                    self.url,
                    path,
                    kind_of(mode),
                    moved,
                )
                os.mkdir(path, 0o700)
            if self.options.fsync:
                fsync_dir(directory.path)
            directory.subdirs.add(name)
        return path

    def _publish(self, temp: str, final: str) -> None:
        """Rename the written temporary file over the object's name. A directory there (not
        kvplug's) is removed when empty or moved aside, so the key can be stored again."""
        try:
            os.replace(temp, final)
            return
        except OSError as error:
            if error.errno not in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST):
                raise
        moved = clear_the_way(final)
        if moved is not None:
            logger.warning(
                "%s: a directory with files in it was where %s should be; it was moved aside "
                "to %s and the object stored. Remove it when you no longer need it.",
                self.url,
                final,
                moved,
            )
        os.replace(temp, final)

    def _reserve(self, key: CacheKey, length: int) -> Reservation:
        """Make room for a file of ``length`` bytes (evicting by policy) and reserve it."""
        if self._kept_temps and (
            self._index.used + length > self.max_size
            or time.monotonic() - self._temps_checked_at > TEMP_RECHECK
        ):
            self._recheck_temps()
        with self._lock:
            self._check_open_worker()
            reservation = self._index.reserve(length, self._evicted, replacing=key)
            if reservation is None:
                raise CapacityExceeded(self._full_message(length))
            return reservation

    def _full_message(self, length: int) -> str:
        """Why an object file of ``length`` bytes does not fit (the index lock is held)."""
        stuck = self._index.held_off()
        parts = [
            f"{self._index.bytes_held} of {self.max_size} bytes are held in {len(self._index)} "
            f"objects and {self._index.reserved} more are being written"
        ]
        if self._index.external_bytes:
            parts.append(
                f"{self._index.external_bytes} bytes are temporary files of "
                f"{len(self._kept_temps)} writes of other running processes"
            )
        if stuck:
            parts.append(
                f"{sum(self._index.nbytes(k) for k in stuck)} bytes are in {len(stuck)} files "
                "that could not be deleted (see the warning logged)"
            )
        return (
            f"cannot make room for an object file of {length} bytes in {self.url}: "
            f"{'; '.join(parts)}; every object that could go is pinned, being written or "
            "cannot be deleted. Unpin keys, raise max_size, or add a directory."
        )

    @contextlib.contextmanager
    def _room_on_disk(self, directory: Directory, length: int) -> Iterator[Claim]:
        """Claim ``length`` bytes of the free space of ``directory``'s disk while a write of
        that size runs there (the part the file has not been allocated yet). Raises
        CapacityExceeded, before anything is written, when the free space less what the
        writes in flight there still need is short: writes that start together never all
        begin on room for some of them and all run out of it half-way."""

        def free_space() -> int:
            try:
                return shutil.disk_usage(directory.path).free
            except OSError as error:
                raise BackendError(
                    f"{self.url}: cannot check the free space of {directory.path}: "
                    f"{reason(error)}. Check that the directory still exists."
                ) from None

        claim = directory.claim(length, free_space)
        if not isinstance(claim, Claim):
            free, pending = claim
            writing = f", {pending} of them needed by writes in flight there," if pending else ""
            raise CapacityExceeded(
                f"the disk holding {directory.path} has {free} bytes free{writing} and an "
                f"object file needs {length}; this object was not stored and reads keep "
                f"working. Free space on that disk, lower max_size (now {self.max_size}) below "
                "what the disk can hold, or add a directory on another disk."
            )
        try:
            yield claim
        finally:
            directory.unclaim(claim)

    def _write_failed(self, error: OSError, subdir: str, length: int) -> BackendError:
        """The kvplug error for ``error`` of a put writing into ``subdir``; a refused write is
        also logged, once per directory and cause (a Store only counts it)."""
        where = os.path.dirname(os.fsdecode(error.filename)) if error.filename else subdir
        failure = classify_os_error(
            error, f"{self.url}: writing an object file of {length} bytes", where, _WRITE_LEFT
        )
        if isinstance(failure, WriteRefused) and self._first_report(where, error):
            logger.warning("%s", failure)
        return failure

    def _write_file(
        self,
        key: CacheKey,
        key_text: str,
        directory: Directory,
        stem: str,
        source: Lease,
        reservation: Reservation,
        room: Claim,
    ) -> None:
        """Write the object ``source`` lends to a temporary file (through :attr:`io`), then
        rename it into place and index it under ``reservation``; ``room`` follows the file's
        allocation.

        Every read of the caller's memory happens inside ``source.use()``; so do the rename
        and the index update, together, after the last read: a put cancelled before that
        point leaves no file and no index entry (its temporary file is deleted here when the
        next access raises :class:`~kvplug.lease.Revoked`), and the cancellation of one that
        has reached it waits for it, so the object is then stored whole."""
        obj = source.obj
        length = reservation.nbytes
        subdir = os.path.join(directory.path, stem[:2])
        final = os.path.join(subdir, stem + SUFFIX)
        temp = os.path.join(subdir, temp_name(stem, self._writer))
        nbytes = obj.nbytes
        payload = self._plan(
            obj, length - BLOCK, directory.o_direct_for_write(), writing=True, access=source.use
        )
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | self._open_flags()
        flags |= O_DIRECT if payload.o_direct else 0
        fd = -1
        created = False
        synchronize(payload.tensor)
        header_flags = 0
        checksum: concurrent.futures.Future[int] | None = None
        if payload.host is not None:
            checksum = self._workers.hashers.submit(_checksum, payload.access, payload.host)
        elif payload.tensor is not None and self._checksums_device_memory():
            checksum = self._workers.hashers.submit(
                _device_checksum, payload.access, payload.tensor[:nbytes]
            )
        else:
            header_flags = FLAG_NO_PAYLOAD_CHECKSUM

        def header() -> memoryview:
            block = header_buffer()
            frame = encode_header(
                obj.shape,
                obj.dtype,
                obj.fmt,
                SERDE,
                payload.host if payload.host is not None else _length_only(nbytes),
                checksum.result() if checksum is not None else 0,
            )
            block[:] = encode_block(frame, key_text, header_flags)
            return memoryview(block)

        try:
            self._subdir(directory, stem[:2])
            try:
                fd = os.open(temp, flags, 0o600)
            except (FileNotFoundError, NotADirectoryError):  # removed or replaced meanwhile
                self._subdir(directory, stem[:2], create=True)
                fd = os.open(temp, flags, 0o600)
            created = True
            directory.writing(room, fd)
            self.io.write_object(fd, payload, header)
            if self.options.fsync:
                os.fsync(fd)
            directory.written(room, whole=True)
            os.close(fd)
            fd = -1
            entry = IndexEntry(
                stem,
                directory,
                length,
                obj.shape,
                obj.dtype,
                obj.fmt,
                nbytes,
                next(self._generations),
            )
            with source.use():  # the point of no return (see above)
                self._publish(temp, final)
                created = False
                with self._lock:
                    old = self._index.commit(reservation, key, entry)
            if self.options.fsync:
                try:
                    fsync_dir(subdir)
                except OSError:
                    self._forget(key, entry)  # not durable as promised: not stored at all
                    unlink_quietly(final)
                    raise
        except BaseException as error:
            if fd >= 0:
                directory.written(room, whole=False)
                with contextlib.suppress(OSError):
                    os.close(fd)
            if created:
                unlink_quietly(temp)
            if isinstance(error, OSError):
                raise self._write_failed(error, subdir, length) from error
            raise
        finally:
            if checksum is not None:
                checksum.cancel()
                concurrent.futures.wait([checksum])  # never release memory it still reads
            payload.close()
        if old is not None and old.path != final:
            unlink_quietly(old.path)  # it lived in another directory

    def _open_flags(self) -> int:
        """Flags of every object file opened for :attr:`io` (O_NOFOLLOW unless it refuses
        such descriptors; O_EXCL already refuses to follow a link when creating)."""
        return os.O_CLOEXEC if self.io.refuses_nofollow else OPEN_FLAGS

    def _write(self, key: CacheKey, key_text: str, length: int, source: Lease) -> None:
        """The whole put of the object ``source`` lends, on a worker thread; ends the lease."""
        try:
            self._check_open_worker()
            if source.revoked:  # cancelled while queued: make no room for it
                raise Revoked("the put was cancelled before it started")
            stem = digest(key_text)
            directory = self._shard(stem)
            with self._stripe(stem):
                reservation = self._reserve(key, length)
                try:
                    with self._room_on_disk(directory, length) as room:
                        self._write_file(key, key_text, directory, stem, source, reservation, room)
                except BaseException:
                    with self._lock:
                        self._index.cancel(reservation)
                    raise
        finally:
            source.end()

    # -- reads --------------------------------------------------------------------------------

    def _forget(self, key: CacheKey, entry: IndexEntry) -> None:
        """The file of ``entry`` is gone (removed outside kvplug): drop it from the index."""
        with self._stripe(entry.stem), self._lock:
            current = self._index.get(key)
            if current is not None and current.gen == entry.gen:
                self._index.remove(key)

    def _forget_foreign(self, key: CacheKey, entry: IndexEntry, error: NotAnObject) -> None:
        """A foreign thing is under ``entry``'s name: a counted miss; drop the key from the
        index and leave the thing where it is (a put of the key replaces it)."""
        with self._stripe(entry.stem), self._lock:
            current = self._index.get(key)
            if current is None or current.gen != entry.gen:
                return
            self._index.remove(key)
            self.foreign_files += 1
        first = self._first_report(entry.directory.path, "foreign")
        logger.log(
            logging.WARNING if first else logging.DEBUG,
            "%s: %s is a %s, not an object file; key %s reads as a miss and left the index "
            "(counted in foreign_files; further ones in this directory are logged at DEBUG). "
            "It was not touched; a put of the key replaces it (a directory is moved aside).",
            self.url,
            entry.path,
            error.kind,
            key,
        )

    def _discard_corrupt(self, key: CacheKey, entry: IndexEntry, fd: int, error: Exception) -> None:
        self.damaged_values.found(entry.path, error)
        with self._stripe(entry.stem):
            with self._lock:
                current = self._index.get(key)
                if current is not None and current.gen == entry.gen:
                    self._index.remove(key)
            try:
                on_disk = os.stat(entry.path, follow_symlinks=False)
                opened = os.fstat(fd)
                # Only the file that was read: a put may have renamed a new one into place.
                if (on_disk.st_dev, on_disk.st_ino) == (opened.st_dev, opened.st_ino):
                    os.unlink(entry.path)
            except FileNotFoundError:
                pass
            except OSError as failure:
                logger.warning(
                    "%s: could not delete the damaged %s: %s", self.url, entry.path, reason(failure)
                )

    def _adopt(self, key: CacheKey, entry: IndexEntry, header: ObjectHeader) -> IndexEntry:
        """The file holds a valid object other than ``entry`` describes (replaced behind the
        index's back): describe it as it is, in the index too."""
        frame = header.frame
        adopted = replace(
            entry,
            size=header.file_length,
            shape=frame.shape,
            dtype=frame.dtype,
            fmt=frame.fmt,
            payload_len=frame.payload_len,
        )
        with self._lock:
            current = self._index.get(key)
            if current is not None and current.gen == entry.gen:
                self._index.update(key, adopted, adopted.size)
        return adopted

    def _verify(
        self,
        fd: int,
        size: int,
        key_text: str,
        entry: IndexEntry,
        payload: Payload,
        path: str,
    ) -> ObjectHeader | None:
        """Read and verify the file (``size`` bytes) into ``payload``. Returns None when the
        object is complete, or the header of a different valid object the file holds; raises
        CorruptObject when the file is damaged."""
        head_block = header_buffer()
        if size != entry.size:
            # Never read the payload past a short file with O_DIRECT: check the header first.
            count = read_all(fd, [memoryview(head_block)], 0)
            header = decode_block(memoryview(head_block)[:count])
            if header.key_text == key_text and header.file_length == size:
                return header
            raise CorruptObject(
                f"file is {size} bytes, its header says {header.file_length} (truncated or torn)."
            )
        synchronize(payload.tensor)
        checksum: int | None = None
        try:
            if self._reads_in_pieces(payload):
                count, checksum = self._read_hashing(fd, memoryview(head_block), payload)
            else:
                count = self.io.read_object(
                    fd,
                    memoryview(head_block),
                    payload,
                    self._payload_handle(fd, path, key_text, payload.o_direct),
                )
        except OSError as error:
            if error.errno in (errno.EIO, errno.EINVAL):
                raise CorruptObject(f"reading the file failed: {reason(error)}.") from None
            raise
        expected = BLOCK + payload.length
        if count != expected:
            raise CorruptObject(f"read {count} of {expected} bytes: the file was truncated.")
        header = decode_block(memoryview(head_block))
        if header.key_text != key_text:
            raise CorruptObject(f"file holds key {header.key_text!r}, not {key_text!r}.")
        if not entry.describes(header):
            return header
        if header.payload_checksummed:  # else written from GPU memory by gds://: length only
            if payload.host is not None:
                if checksum is not None:  # hashed while it was read
                    verify_payload(header.frame, payload.host, partial(_computed, checksum))
                else:
                    with payload.access():
                        verify_payload(header.frame, payload.host)
            elif payload.tensor is not None and self._checksums_device_memory():
                nbytes = header.frame.payload_len
                with payload.access():
                    host = payload.tensor[:nbytes].cpu()
                verify_payload(header.frame, byte_view(host))
        return None

    def _reads_in_pieces(self, payload: Payload) -> bool:
        """Whether :meth:`_read_hashing` reads ``payload``: with O_DIRECT, into host memory in
        one buffer whose start is the checksummed bytes, longer than a piece, moved by plain
        ``preadv`` (the :class:`~kvplug_disk.fileio.PosixFileIO` way, which that method does
        piece by piece). A buffered read is a copy out of the page cache, work for the CPU
        like the hash: splitting it gains nothing on a busy host."""
        return (
            payload.o_direct
            and payload.host is not None
            and payload.host.nbytes > READ_PIECE
            and len(payload.buffers) == 1
            and type(self.io).read_object is PosixFileIO.read_object
        )

    def _read_hashing(self, fd: int, head: memoryview, payload: Payload) -> tuple[int, int | None]:
        """Read the header block into ``head`` and the payload into its one buffer, in pieces
        of :data:`READ_PIECE` bytes or more, and hash the payload as the pieces arrive.

        The later pieces are read on the reader threads, all at once, while this thread reads
        the header block and the first piece and then hashes each piece, in file order, as
        soon as it is in: the checksum is computed while the rest is still being read, and
        the disk sees as many requests in flight as one large read gives it (one piece after
        another would wait a round trip per piece). Returns the count of bytes read and the
        payload's checksum, the same xxh3-64 as :func:`kvplug.frame.payload_checksum`; None
        for the checksum when the file came up short. Returns or raises only once no other
        thread touches the payload's memory."""
        (buffer,) = payload.buffers
        host = payload.host
        assert host is not None
        nbytes = host.nbytes  # the read plans put the checksummed bytes first in the buffer
        length = buffer.nbytes
        # At most one piece per reader thread and this one: more would wait for a thread.
        piece = max(READ_PIECE, padded(-(-length // (READ_HELPERS + 1))))
        access = payload.access
        later: list[tuple[int, int, concurrent.futures.Future[int] | None]] = []
        try:
            for start in range(piece, length, piece):
                end = min(start + piece, length)
                later.append((start, end, self._read_piece(fd, buffer[start:end], start, access)))
            first = min(piece, length)
            total = read_all(fd, [head, buffer[:first]], 0, access)
            short = total != BLOCK + first
            hasher = xxhash.xxh3_64()
            if not short:
                with access():
                    hasher.update(host[: min(first, nbytes)])
            for start, end, future in later:
                count = (
                    future.result()
                    if future is not None
                    else read_all(fd, [buffer[start:end]], BLOCK + start, access)
                )
                total += count
                short = short or count != end - start
                if not short and start < nbytes:
                    with access():
                        hasher.update(host[start : min(end, nbytes)])
            return total, None if short else hasher.intdigest()
        finally:
            pending = [future for _, _, future in later if future is not None]
            for future in pending:
                future.cancel()
            concurrent.futures.wait(pending)  # never release memory a reader still fills

    def _read_piece(
        self, fd: int, view: memoryview, start: int, access: Access
    ) -> concurrent.futures.Future[int] | None:
        """Read ``view`` from payload offset ``start`` on a reader thread; None when the
        readers are shut down (by close): the caller reads it itself."""
        try:
            return self._workers.readers.submit(read_all, fd, [view], BLOCK + start, access)
        except RuntimeError:
            return None

    def _payload_handle(
        self, fd: int, path: str, key_text: str, o_direct: bool
    ) -> Callable[[], AbstractContextManager[Any]] | None:
        """How :attr:`io` opens the file ``fd`` (``path``, holding ``key_text``, opened with
        O_DIRECT or not) for a payload read; None: its own way
        (:meth:`~kvplug_disk.fileio.FileIO.open`)."""
        return None

    def _allocate_for(self, key: CacheKey, entry: IndexEntry) -> MemoryObj | None:
        """An object to read ``entry`` into; None (counted) when the allocator is full."""
        obj = self.allocator.allocate(entry.shape, entry.dtype, entry.fmt)
        if obj is None:
            with self._lock:
                self.allocation_failures += 1
            logger.debug("%s: allocator full; a hit on %s reads as a miss", self.url, key)
        return obj

    def _read_once(
        self, key: CacheKey, key_text: str, entry: IndexEntry, into: Lease | None
    ) -> MemoryObj | ObjectHeader | None:
        """Read ``entry`` into a new object, or into the caller's object ``into`` lends (never
        released here) when its size is the stored object's."""
        return self._read_path(key, key_text, entry, entry.path, into)

    def _read_path(
        self,
        key: CacheKey,
        key_text: str,
        entry: IndexEntry,
        path: str,
        into: Lease | None = None,
    ) -> MemoryObj | ObjectHeader | None:
        """Read ``entry``'s object from ``path`` (its file, or a link to it), into a new
        object or into the one ``into`` lends, every write there inside ``into.use()``."""
        access: Access = nullcontext
        if into is not None:
            stored = nbytes_of(entry.shape, entry.dtype)
            if stored != into.obj.nbytes:
                dest = into.obj
                raise LayoutMismatch.between(
                    key, (entry.shape, entry.dtype, stored), (dest.shape, dest.dtype, dest.nbytes)
                )
            obj: MemoryObj | None = into.obj
            access = into.use
        else:
            obj = self._allocate_for(key, entry)
        if obj is None:
            return None
        keep = into is not None
        payload: Payload | None = None
        try:
            payload = self._plan(
                obj, padded(entry.payload_len), entry.directory.o_direct, False, access
            )
            try:
                fd, size = open_object_sized(path, O_DIRECT if payload.o_direct else 0)
            except FileNotFoundError:
                self._forget(key, entry)
                return None
            except NotAnObject as error:
                self._forget_foreign(key, entry, error)
                return None
            except OSError as error:
                raise BackendError(
                    f"{self.url}: cannot open {path}: {reason(error)}. Check the "
                    f"{self._medium} and the directory's permissions."
                ) from None
            try:
                try:
                    other = self._verify(fd, size, key_text, entry, payload, path)
                except CorruptObject as error:
                    self._discard_corrupt(key, entry, fd, error)
                    return None
            finally:
                os.close(fd)
            if other is not None:
                return other
            if payload.staging is not None:
                with access():
                    obj.raw.copy_(payload.staging)
            keep = True
            return obj
        finally:
            if payload is not None:
                payload.close()
            if not keep:
                obj.release()

    def _read(
        self, key: CacheKey, entry: IndexEntry, into: Lease | None = None
    ) -> MemoryObj | None:
        """The whole get (into a new object, or into the one ``into`` lends), on a worker
        thread."""
        self._check_open_worker()
        key_text = key.to_string()
        result: MemoryObj | None = None
        for _ in range(3):
            outcome = self._read_once(key, key_text, entry, into)
            if isinstance(outcome, ObjectHeader):
                entry = self._adopt(key, entry, outcome)
                continue
            result = outcome
            break
        if result is not None:
            with self._lock:
                self._index.hit(key)
        return result

    def _read_header(self, fd: int) -> ObjectHeader:
        """The verified header block of the open file ``fd``, whose length must match it."""
        size = os.fstat(fd).st_size
        buffer = header_buffer()
        count = read_all(fd, [memoryview(buffer)], 0)
        return checked_header(memoryview(buffer)[:count], size)

    def _discover(self, key: CacheKey) -> IndexEntry | None:
        """Look for ``key``'s file in every directory (another instance may have written it)
        and add it to the index; None when there is none."""
        key_text = key.to_string()
        stem = digest(key_text)
        for directory in self._probe_order(stem):
            path = os.path.join(directory.path, stem[:2], stem + SUFFIX)
            try:
                fd = open_object(path)
            except NotAnObject as error:
                logger.debug("%s: %s; not an object of another instance", self.url, error)
                continue
            except OSError:
                continue
            try:
                try:
                    header = self._read_header(fd)
                    if header.key_text != key_text:
                        raise CorruptObject("the key inside does not match the file name.")
                except CorruptObject as error:
                    self._discard_found(path, fd, error)
                    continue
            finally:
                os.close(fd)
            with self._stripe(stem), self._lock:
                current = self._index.get(key)
                if current is not None:
                    return current
                entry = self._entry(stem, directory, header)
                self._index.put(key, entry, entry.size)
                self.discovered += 1
            return entry
        return None

    def _discard_found(self, path: str, fd: int, error: Exception) -> None:
        self.damaged_values.found(path, error)
        try:
            on_disk = os.stat(path, follow_symlinks=False)
            opened = os.fstat(fd)
            if (on_disk.st_dev, on_disk.st_ino) == (opened.st_dev, opened.st_ino):
                os.unlink(path)  # only the file that was read, never a newer one
        except OSError:
            pass

    def _known(self, key: CacheKey) -> IndexEntry | None:
        with self._lock:
            entry = self._index.get(key)
        return entry if entry is not None else self._discover(key)

    def _present(self, key: CacheKey) -> bool:
        self._check_open_worker()
        with self._lock:
            entry = self._index.get(key)
        if entry is not None:
            try:
                mode = os.lstat(entry.path).st_mode
            except (FileNotFoundError, NotADirectoryError):
                self._forget(key, entry)  # removed or evicted by another instance
                return self._discover(key) is not None
            except OSError:
                return True  # cannot tell: get will
            if stat.S_ISREG(mode):
                return True
            self._forget_foreign(key, entry, NotAnObject(entry.path, kind_of(mode)))
        return self._discover(key) is not None

    def _read_key(self, key: CacheKey) -> MemoryObj | None:
        """The whole get, on a worker thread: a new object, or None (counted as a miss)."""
        self._check_open_worker()
        entry = self._known(key)
        if entry is None:
            return None
        return self._read(key, entry)

    def _read_key_into(self, key: CacheKey, dest: Lease) -> bool:
        """The whole get_into of the object ``dest`` lends, on a worker thread; ends the
        lease."""
        try:
            entry = self._known(key)
            if entry is None:
                return False
            return self._read(key, entry, dest) is not None
        finally:
            dest.end()

    def _remove_key(self, key: CacheKey) -> bool:
        """The whole remove, on a worker thread (a key not indexed is looked for on disk)."""
        self._check_open_worker()
        entry = self._known(key)
        return False if entry is None else self._delete_file(key, entry.stem)

    def _delete_file(self, key: CacheKey, stem: str) -> bool:
        """Delete ``key``'s file: True when this deleted it, False when it was not there;
        raises when the file stays (the key stays indexed, readable and counted)."""
        self._check_open_worker()
        with self._stripe(stem):
            with self._lock:
                entry = self._index.get(key)
            if entry is None:
                return False
            try:
                deleted = delete_object_file(entry.path)
            except OSError as error:
                raise classify_os_error(
                    error,
                    f"{self.url}: deleting the object file of {key}",
                    entry.path,
                    _DELETE_LEFT,
                ) from error
            with self._lock:
                current = self._index.get(key)
                if current is not None and current.gen == entry.gen:
                    self._index.remove(key)
                if deleted is Deleted.FOREIGN:
                    self.foreign_files += 1
        return deleted is Deleted.DONE

    # -- the contract's hooks -------------------------------------------------------------

    async def _lend(self, what: str, obj: MemoryObj, work: Callable[[Lease], T]) -> T:
        """Run ``work`` on the pool (see :meth:`_run`) with the caller's ``obj`` lent to it
        in a :class:`~kvplug.lease.Lease`: ``work`` reads and writes ``obj``'s memory only
        inside ``lease.use()`` and ends the lease when it is done. Cancelled (a deadline),
        this takes the memory back before it raises: it waits for the access in progress, if
        any (one system call, copy or hash), never for the rest of the work, which finds the
        lease revoked at its next access and abandons (the ``releases_on_cancel``
        capability)."""
        lease = Lease(obj)
        try:
            return await self._run(what, partial(work, lease), not_run=lease.end)
        except BaseException:
            await lease.revoke()
            raise

    async def _get(self, key: CacheKey) -> MemoryObj | None:
        """The stored object, read into a new object of :attr:`allocator` (the caller owns it),
        or ``None``: absent, damaged (counted and removed) or no room in the allocator. A key
        not in the index is looked for on disk (another instance may have written it)."""
        return await self._run(
            f"get of {key}", partial(self._read_key, key), abandoned=release_read
        )

    async def _get_into(self, key: CacheKey, dest: MemoryObj) -> bool:
        """The stored bytes read straight into ``dest`` (with O_DIRECT when ``dest`` is
        block-aligned), checksum verified there; see :meth:`kvplug.backend.Backend.get_into`.
        Cancelled, nothing is written into ``dest`` once the cancellation has finished."""
        return await self._lend(f"get_into of {key}", dest, partial(self._read_key_into, key))

    async def _batched_get_into(
        self, keys: Sequence[CacheKey], dests: Sequence[MemoryObj]
    ) -> list[bool]:
        """:meth:`_get_into` of each pair, concurrently on the file I/O threads."""
        return await gather_all(self._get_into(k, d) for k, d in zip(keys, dests, strict=True))

    async def _put(self, key: CacheKey, obj: MemoryObj) -> None:
        """Write ``obj`` to its file, evicting by policy to make room. The caller keeps its
        reference; the write holds one more until it is done."""
        key_text = key.to_string()
        key_bytes = len(key_text.encode("utf-8"))
        if key_bytes > MAX_KEY_BYTES:
            raise InvalidKey(
                f"key {key_text[:80]!r}... is {key_bytes} bytes long in UTF-8; "
                f"{self.url.scheme}:// keeps each key in its file's {BLOCK}-byte header block, "
                "which holds at most "
                f"{MAX_KEY_BYTES}. Use a shorter model name or fewer tags."
            )
        length = shared_length(file_length(obj.nbytes))  # the index keeps it per key
        if length > self.max_size:
            raise CapacityExceeded(
                f"cannot store an object of {obj.nbytes} bytes in {self.url}: its file of "
                f"{length} bytes is larger than the tier's max_size of {self.max_size} bytes. "
                "Raise max_size or store smaller chunks."
            )
        await self._lend(f"put of {key}", obj, partial(self._write, key, key_text, length))

    async def _batched_put(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]) -> None:
        """:meth:`_put` of each pair, concurrently on the file I/O threads. When some fail,
        the error (of the first failure's kind) tells which keys were stored, in its message
        and in ``stored`` (aligned with ``keys``); those stay stored."""
        results = await asyncio.gather(
            *(self._put(k, o) for k, o in zip(keys, objs, strict=True)), return_exceptions=True
        )
        failures = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
        if not failures:
            return
        for _, failure in failures:
            if not isinstance(failure, Exception):
                raise failure  # cancelled, or the process is going down
        index, first = failures[0]
        error = self.translate_error("put", cast(Exception, first), [keys[index]])
        if error is not first:
            error.__cause__ = first
        if not isinstance(error, BackendError):
            raise error
        stored = tuple(not isinstance(r, BaseException) for r in results)
        if len(keys) == 1:
            error.stored = stored
            raise error
        kept = [i for i, done in enumerate(stored) if done]
        lost = [i for i, done in enumerate(stored) if not done]
        summary = type(error)(
            f"batched_put of {len(keys)} objects into {self.url}: {len(kept)} stored "
            f"({_positions(kept)}) and {len(lost)} not ({_positions(lost)}); the stored ones "
            f"stay stored and readable. The first failure, of {keys[index]} (position "
            f"{index}): {error}"
        )
        summary.stored = stored
        raise summary from error

    async def _contains(self, key: CacheKey) -> bool:
        """Whether the key's file is there (also one another instance wrote after open)."""
        return await self._run(f"contains of {key}", partial(self._present, key))

    async def _batched_exists(self, keys: Sequence[CacheKey]) -> list[bool]:
        """Whether each key's file is there, in one trip to a worker thread."""
        return await self._run(
            f"batched_exists of {len(keys)} keys", lambda: [self._present(key) for key in keys]
        )

    async def _remove(self, key: CacheKey) -> bool:
        """Delete ``key`` and its file even when pinned (its pins go with it), also a file
        another instance wrote. True when this deleted the file; False when the key or its
        file was absent. A file that cannot be deleted raises
        (:class:`~kvplug_disk.fileops.WriteRefused` for a directory that refuses it) and the
        key stays stored."""
        if self._directories_open and not self._may_hold(key):
            return False
        return await self._run(f"remove of {key}", partial(self._remove_key, key))

    def _may_hold(self, key: CacheKey) -> bool:
        """Whether ``key`` is indexed or has a file (another instance's) in some directory:
        a lookup and a ``stat`` or two, so that removing an absent key (every put through a
        Store of several tiers does, to drop an older value) never waits behind file I/O."""
        with self._lock:
            if self._index.get(key) is not None:
                return True
        stem = digest(key.to_string())
        return any(
            os.path.lexists(os.path.join(directory.path, stem[:2], stem + SUFFIX))
            for directory in self._probe_order(stem)
        )

    async def _pin(self, key: CacheKey) -> bool:
        """Keep ``key`` from eviction for ``pin_ttl`` seconds or until :meth:`unpin`; pins
        count. False if ``key`` is absent (a key another instance wrote is found first). Pins
        are not kept across a reopen."""
        with self._lock:
            known = key in self._index
        if not known and await self._run(f"pin of {key}", partial(self._known, key)) is None:
            return False
        with self._lock:
            return self._index.pin(key)

    def stored_files(self, key: CacheKey) -> list[Path]:
        """:class:`~kvplug.backend.StoredFiles`: the path of the file holding ``key`` (empty
        when absent). The contract suite's default ``damage_stored`` fixture damages these
        files to check clause 6."""
        with self._lock:
            entry = self._index.get(key)
        return [Path(entry.path)] if entry is not None else []

    async def _list_keys(self) -> AsyncIterator[CacheKey]:
        """The keys stored when iteration starts (a snapshot), in no particular order."""
        await self._ready()
        with self._lock:
            snapshot = list(self._index)
        for key in snapshot:
            yield key

    async def _close(self) -> None:
        """Stop taking operations, wait for file I/O in flight (up to :data:`CLOSE_WAIT`
        seconds, and less than half the deadline, so that what follows runs within it), and
        stop the workers. The files stay (the tier is persistent)."""
        self._workers.close()
        try:
            give_up = time.monotonic() + min(CLOSE_WAIT, self.options.timeout / 2)
            while time.monotonic() < give_up and self._workers.busy:
                await asyncio.sleep(0.005)
        finally:
            if not self._workers.busy:
                self._release_writer_locks()  # else the last file I/O in flight releases them
            self._workers.shutdown()
            with self._lock:
                self._index.clear()
                self._kept_temps.clear()


__all__ = [
    "BOUNCE_POOL_SIZE",
    "DEFAULT_MAX_SIZE",
    "DEFAULT_QUEUE_DEPTH",
    "DEFAULT_WORKERS",
    "RETRY_UNDELETABLE",
    "TEMP_RECHECK",
    "Directory",
    "DiskBackend",
    "DiskOptions",
    "IndexEntry",
    "WriteRefused",
    "release_read",
]
