"""The GPUDirect Storage tier, ``gds:///dir`` and ``weka:///dir``: KV-cache chunks moved by
cuFile straight between GPU memory and files.

URL and options (query parameters or keyword options, keywords win)::

    gds:///mnt/nvme/kv?max_size=500GiB
    gds:///mnt/nvme0/kv,/mnt/nvme1/kv?shard=by_gpu      # one directory per GPU
    weka:///mnt/weka/kv                                  # a WekaFS mount, checked at open

Everything ``file://`` takes (``paths``, ``max_size``, ``eviction``, ``pin_ttl``, ``o_direct``,
``fsync``, ``workers``, ``queue_depth``, ``allow_shared_dir``, ``timeout``; see
:mod:`kvplug_disk.backend`), and:

* ``shard``: ``hash`` (default; by key digest, as ``file://``) or ``by_gpu`` (every object of
  this backend goes to directory ``device index % number of directories``, LMCache's
  ``gds_path_sharding``). Reads look in every directory, so either way all objects are found.
* ``device``: the GPU of the tier's own buffer and of ``shard=by_gpu``: ``cuda`` (the current
  device at open) or ``cuda:N``.
* ``buffer_size``: bytes of GPU memory ``get`` allocates results from when no allocator is
  given (default 1 GiB); the buffer is registered with cuFile once (LMCache's
  ``cufile_buffer_size``).
* ``gpu_checksum``: also checksum payloads that live in GPU memory (default false; see
  *Checksums* below).
* ``register_buffers``: register the memory objects come from with cuFile, once per
  allocator buffer (default true).
* ``weka://`` only: ``allow_non_weka`` (default false).

The file format, index, eviction, pins and crash safety are ``file://``'s (this class extends
:class:`~kvplug_disk.backend.DiskBackend`); only how payloads move differs. See
:class:`GdsBackend`.
"""

# File descriptors and str paths on the I/O path, as in kvplug_disk.backend.
# ruff: noqa: PTH116, PTH118, PTH120

from __future__ import annotations

import contextlib
import errno
import glob
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import torch
from pydantic import Field, field_validator

from kvplug.backend import Backend, Capabilities
from kvplug.errors import BackendError, ConfigError, NotSupported
from kvplug.keys import CacheKey
from kvplug.lease import Lease
from kvplug.memory import Allocator, FreeListAllocator, MemoryFormat, MemoryObj
from kvplug.options import BackendOptions
from kvplug.units import GiB, parse_size
from kvplug.url import BackendURL
from kvplug_disk.backend import DiskBackend
from kvplug_disk.directories import DirectIO, Directory
from kvplug_disk.fileio.base import FileIO, Payload, synchronize
from kvplug_disk.fileio.cufile import CuFileError, CuFileIO
from kvplug_disk.fileops import O_DIRECT, LiveWriters, NotAnObject, kind_of, unlink_quietly
from kvplug_disk.gds.environment import CuFileMode, detect_mode, mount_of
from kvplug_disk.index import IndexEntry
from kvplug_disk.layout import BLOCK, ObjectHeader, padded, probe_name, temp_name
from kvplug_disk.options import DiskOptions

logger = logging.getLogger("kvplug.gds")

DEFAULT_BUFFER_SIZE = 1 * GiB
STAGING_POOL_SIZE = 64 << 20
"""Pinned host memory for objects whose own memory cuFile cannot use (pageable host memory,
tensors not from a 4096-aligned allocator)."""
TEMP_GRACE = 3600.0
"""Seconds a temporary file of a process not running here is left alone at open: on a shared
mount it may belong to a writer on another host."""
_DEVICE = re.compile(r"cuda(?::([0-9]+))?")
_CREATE_FLAGS = os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
"""Files handed to cuFile are opened without O_NOFOLLOW, which cuFileHandleRegister refuses
(error 5019, INVALID_FILE_OPEN_FLAG); O_EXCL already refuses to follow a symbolic link."""
_reported: set[tuple[str, str]] = set()
_reported_lock = threading.Lock()


class _Replaced(Exception):
    """The file being read was replaced or removed meanwhile: cuFile refuses to register a
    descriptor of a deleted file (error 5031, GETNEWFD_FAILED), so the read starts over."""


class GdsUnavailable(ConfigError):
    """``gds://`` cannot run on this machine (no CUDA GPU, no cuFile, cuFile refuses I/O)."""


def _unavailable(url: BackendURL, cause: str) -> GdsUnavailable:
    return GdsUnavailable(
        f"{url} cannot open: {cause.rstrip('. ')}. {url.scheme}:// needs a CUDA GPU, "
        "NVIDIA's cuFile library (libcufile) and cufile-python (pip install "
        "'kvplug-disk[gds]'); see "
        "docs/gds.md. For a disk tier on a machine without a GPU, use file:///dir instead."
    )


class GdsOptions(DiskOptions):
    """Options of ``gds://`` (and ``weka://``): those of ``file://`` and the ones below."""

    shard: str = Field("hash", description="spread over directories by 'hash' or 'by_gpu'")
    device: str = Field("cuda", description="GPU of the tier's buffer: 'cuda' or 'cuda:N'")
    buffer_size: int = Field(
        DEFAULT_BUFFER_SIZE, description="bytes of the GPU buffer get allocates from: '8GiB'"
    )
    gpu_checksum: bool = Field(
        False, description="checksum payloads in GPU memory too (copies them to the host)"
    )
    register_buffers: bool = Field(True, description="register allocator buffers with cuFile")

    @field_validator("shard", mode="before")
    @classmethod
    def _check_shard(cls, value: object) -> str:
        if not isinstance(value, str) or value.strip().lower() not in ("hash", "by_gpu"):
            raise ConfigError(
                f"shard must be 'hash' (by key, the default) or 'by_gpu' (device index "
                f"modulo the number of directories), got {value!r}."
            )
        return value.strip().lower()

    @field_validator("device", mode="before")
    @classmethod
    def _check_device(cls, value: object) -> str:
        if not isinstance(value, str) or not _DEVICE.fullmatch(value.strip()):
            raise ConfigError(f"device must be 'cuda' or 'cuda:N' (a GPU), got {value!r}.")
        return value.strip()

    @field_validator("buffer_size", mode="before")
    @classmethod
    def _parse_buffer_size(cls, value: object) -> int:
        size = parse_size(value, what="gds buffer_size")
        if size < 2 * BLOCK:
            raise ConfigError(
                f"gds buffer_size is {size} bytes; it must hold objects, so give at least "
                f"{2 * BLOCK} bytes, typically several GiB ('8GiB')."
            )
        return size


class WekaOptions(GdsOptions):
    """Options of ``weka://``: those of ``gds://`` and ``allow_non_weka``."""

    allow_non_weka: bool = Field(
        False, description="accept directories that are not on a WekaFS mount"
    )


def _no_room(error: OSError) -> bool:
    """Whether ``error`` (cuFile's too, which carries the errno as its code) says that the
    disk is full or the user over its quota."""
    code = error.code if isinstance(error, CuFileError) else error.errno
    return code in (errno.ENOSPC, errno.EDQUOT)


def _device_index(text: str) -> int | None:
    match = _DEVICE.fullmatch(text)
    return int(match.group(1)) if match and match.group(1) is not None else None


def _udev_hint(path: str, error: CuFileError) -> str:
    hint = ""
    if error.code == 5027:
        try:
            device = os.stat(path).st_dev
            record = f"/run/udev/data/b{os.major(device)}:{os.minor(device)}"
        except OSError:
            record = "/run/udev/data/b<major>:<minor>"
        hint = (
            " cuFile looks the file's block device up in the udev database; on machines "
            "without one (containers, some VMs) it refuses every file. Give it the record "
            f"(as root): mkdir -p /run/udev/data && printf 'E:ID_FS_USAGE=filesystem\\n"
            f"E:ID_FS_TYPE=ext4\\n' > {record} (with the real filesystem type); see "
            "docs/gds.md."
        )
    return hint


def _libcufile_candidates() -> list[str]:
    """Versioned libcufile files in the usual places, to name in an error message."""
    patterns = [
        "/usr/local/cuda*/targets/*/lib/libcufile.so.*",
        "/usr/local/cuda*/lib64/libcufile.so.*",
        "/usr/lib/x86_64-linux-gnu/libcufile.so.*",
    ]
    try:
        import nvidia.cufile  # type: ignore[import-not-found, unused-ignore]

        patterns += [f"{p}/lib/libcufile.so.*" for p in nvidia.cufile.__path__]
    except ImportError:
        pass
    found: list[str] = []
    for pattern in patterns:
        found += sorted(glob.glob(pattern))  # noqa: PTH207 - absolute patterns
    return found[:3]


class GdsBackend(DiskBackend):
    """A persistent, shared store of memory objects in files, moved by cuFile (GPUDirect
    Storage) straight between GPU memory and the files.

    **Files** are ``file://``'s (:mod:`kvplug_disk.layout`): ``<dir>/<2 hex>/<xxh3-128 of the
    key>.kv``, a 4096-byte header block (kvplug's frame header: format, dtype, shape, payload
    length and checksum; the key; a checksum of the block) and the payload from offset 4096,
    padded to whole blocks. A put writes a temporary file and renames it into place, so no
    reader ever sees a half-written object under an object name. ``file://`` and ``gds://``
    read each other's files.

    **Data movement.** Payloads go through one :class:`~kvplug_disk.fileio.FileIO`, the real
    one being :class:`~kvplug_disk.fileio.CuFileIO` (cufile-python): ``cuFileWrite`` and
    ``cuFileRead`` at file offset 4096 straight from and into the object's own memory when it
    is GPU memory or pinned host memory in a 4096-aligned :class:`FreeListAllocator` block;
    each such allocator buffer is registered with cuFile once. By default ``get`` allocates its
    results in the tier's own GPU buffer (``buffer_size`` bytes on ``device``, registered), so
    the capability ``device_memory`` is declared. Anything else (pageable host memory, tensors
    not from an aligned allocator) is staged through a pinned, registered host pool. The
    header block is read and written with plain ``pread``/``pwrite``. cuFile does not follow
    CUDA streams, so a put or get waits for the object's GPU to finish its queued work
    (``torch.cuda.synchronize``) before cuFile touches the memory.

    **Checksums.** The frame header's payload checksum is xxh3 over host bytes.

    * Payloads in host memory (pinned objects, staged ones) are checksummed when written (the
      hash runs while cuFile writes) and verified on every read into host memory.
    * Payloads in GPU memory are written with header flag ``FLAG_NO_PAYLOAD_CHECKSUM`` and no
      checksum, unless ``gpu_checksum=true``, which copies each payload to the host to hash
      it on write and to verify it on read (slower).
    * Always checked, whatever the memory: the header block's checksum, the frame header's
      checksum, the key inside the file, the file length against the header's payload length,
      and that cuFile read exactly that many bytes. With the temporary-file-and-rename writes,
      a torn, truncated, renamed or half-written object is never served.
    * Not detected for GPU payloads without ``gpu_checksum``: payload bytes changed in place
      at the same length (media corruption, another program writing into the file, or blocks
      lost in a power failure when ``fsync`` is false).

    Damage found reads as a miss, is counted in :attr:`corrupt_objects` and the file is
    removed.

    **Sharing.** Several instances (processes, hosts on a shared mount) may use one directory:
    each rebuilds its index from the files at open, and ``get``, ``contains``, ``remove`` and
    ``pin`` of a key not in the index look for its file, so objects written by another instance
    after open are found; ``contains`` of an indexed key checks that its file is still there.
    A read whose file a writer replaced between its open and cuFile's registration (cuFile
    refuses deleted files) reads the file there now through a hard link of its own.
    Capability ``shared_across_processes`` is declared. ``max_size`` and eviction act on what
    this instance knows: give every instance on a directory the same ``max_size``. Temporary
    files of writers not running on this host are deleted at open only once they are older
    than :data:`TEMP_GRACE`.

    **Compatibility mode.** Without the nvidia-fs driver (or when ``cufile.json`` forces it)
    cuFile does POSIX I/O through host bounce buffers. :attr:`mode` (``"gds"`` or
    ``"compat"``) and :attr:`mode_reason` say which, detected once at open and logged once per
    process; ``kvplug check`` prints them.

    **Cancellation.** ``releases_on_cancel`` is declared, as for ``file://``: a put reaches
    the caller's memory only inside its lease (each ``cuFileWrite``, staging copy and checksum;
    cuFile's calls return once their bytes have moved), and ``get_into`` reads into the tier's
    own memory, then copies into the destination on the caller's event loop.

    Without a CUDA GPU or without cuFile, opening raises :class:`GdsUnavailable` (a
    :class:`~kvplug.errors.ConfigError`) naming what is missing. A disk too full at open to
    write the cuFile check's block is logged and opened anyway (that says nothing about
    cuFile).
    """

    capabilities = Capabilities(
        pin=True,
        persistent=True,
        shared_across_processes=True,
        remove=True,
        list_keys=True,
        device_memory=True,
        releases_on_cancel=True,
    )
    Options: ClassVar[type[BackendOptions]] = GdsOptions
    options: GdsOptions
    _medium: ClassVar[str] = "storage"

    def __init__(
        self,
        url: BackendURL | str,
        *,
        allocator: Allocator | None = None,
        file_io: FileIO | None = None,
        **options: Any,
    ) -> None:
        """``file_io`` replaces cuFile; only the CPU tests pass one (a POSIX FileIO that
        moves each payload on its own, as cuFile does)."""
        super().__init__(url, allocator=allocator, file_io=file_io, **options)
        self.mode = "not opened"
        """``"gds"``, ``"compat"`` (cuFile's compatibility mode), or the stand-in's name."""
        self.mode_reason = ""
        self.device_index: int | None = _device_index(self.options.device)
        """The GPU of the tier's own buffer and of ``shard=by_gpu`` (resolved at open)."""
        self.fstypes: dict[str, str] = {}
        """Filesystem type of each directory, from /proc/mounts."""
        self._setup_lock = threading.Lock()
        self._environment_checked = False
        self._allocator_lock = threading.Lock()
        self._staging: FreeListAllocator | None = None
        self._staging_lock = threading.Lock()
        self._seen_allocators: dict[int, FreeListAllocator] = {}
        self._released = False

    # -- memory -------------------------------------------------------------------------------

    @property
    def allocator(self) -> Allocator:
        """Where ``get`` allocates: the allocator given, else the tier's own GPU buffer of
        ``buffer_size`` bytes on ``device``, created on first use."""
        if self._allocator is None:
            with self._allocator_lock:
                if self._allocator is None:
                    self._allocator = FreeListAllocator(
                        self.options.buffer_size,
                        device=self._device(),
                        sized_by="gds:// buffer_size",
                    )
        return self._allocator

    def _device(self) -> torch.device:
        if not torch.cuda.is_available():
            raise _unavailable(self.url, "this machine has no CUDA GPU that torch can use")
        index = self.device_index
        return torch.device("cuda", torch.cuda.current_device() if index is None else index)

    def _pinnable(self) -> bool:
        return torch.cuda.is_available()

    def _staging_block(self, length: int) -> MemoryObj:
        """``length`` bytes of 4096-aligned host memory, pinned when CUDA is present: from
        the registered staging pool, or a one-off buffer when the pool is full."""
        with self._staging_lock:
            if self._staging is None:
                self._staging = FreeListAllocator(
                    STAGING_POOL_SIZE, alignment=BLOCK, pin=self._pinnable()
                )
                if self.options.register_buffers:
                    self._register(self._staging.buffer)
            pool = self._staging
        obj = pool.allocate((length,), torch.uint8, MemoryFormat.BINARY_BUFFER)
        if obj is None:
            one_off = FreeListAllocator(padded(length), alignment=BLOCK, pin=self._pinnable())
            obj = one_off.allocate((length,), torch.uint8, MemoryFormat.BINARY_BUFFER)
            if obj is None:  # pragma: no cover - a fresh allocator of that size has room
                raise BackendError(f"{self.url}: could not allocate {length} staging bytes")
        return obj

    def _default_file_io(self) -> FileIO | None:
        return None  # CuFileIO, made at open once the environment is checked

    def _checksums_device_memory(self) -> bool:
        return self.options.gpu_checksum

    def _using_block(self, obj: MemoryObj) -> None:
        allocator = obj.allocator
        if not self.options.register_buffers or not isinstance(allocator, FreeListAllocator):
            return
        with self._allocator_lock:
            if id(allocator) in self._seen_allocators:
                return
            self._seen_allocators[id(allocator)] = allocator
        self._register(allocator.buffer)

    def _register(self, buffer: torch.Tensor) -> None:
        """Register an allocator's buffer with cuFile; a refusal is logged, not an error:
        I/O on unregistered memory works, through cuFile's own bounce buffers."""
        if not self.io.accepts(buffer):
            return
        if isinstance(self.io, CuFileIO):
            # cuFile registers memory in this thread's CUDA context (5011, CUDA_DRIVER_ERROR
            # without one); a runtime call binds the device's primary context to the thread.
            index = buffer.device.index if buffer.is_cuda else self.device_index
            torch.cuda.synchronize(index or 0)
        if self.io.register(buffer):
            return
        logger.warning(
            "%s: cuFile did not register a %s buffer of %d bytes (%s); I/O on it works "
            "unregistered, through cuFile's bounce buffers.",
            self.url,
            buffer.device,
            buffer.numel(),
            self.io.register_error,
        )

    # -- open -------------------------------------------------------------------------------

    def _open_sync(self) -> None:
        if not self._directories_open:
            with self._setup_lock:
                if not self._environment_checked:
                    self._check_environment()
                    self._environment_checked = True
        super()._open_sync()

    def _check_environment(self) -> None:
        """cuFile loads and can do I/O, the GPU exists, the directories' mounts are right."""
        if self._io is None:
            if not torch.cuda.is_available():
                raise _unavailable(self.url, "this machine has no CUDA GPU that torch can use")
            try:
                self._io = CuFileIO()
            except ConfigError as error:
                cause = str(error)
                found = _libcufile_candidates()
                if "libcufile.so" in cause and found:
                    cause += f" Found here: {', '.join(found)}."
                raise _unavailable(self.url, cause) from None
            mode = detect_mode()
            if not mode.usable:
                raise _unavailable(self.url, mode.reason)
            self._set_mode(mode)
        else:
            self.mode = self._io.name
            self.mode_reason = "a stand-in for cuFile moves the payloads (CPU tests)"
        if self.device_index is None and torch.cuda.is_available():
            self.device_index = torch.cuda.current_device()
        if self.device_index is not None and isinstance(self._io, CuFileIO):
            count = torch.cuda.device_count()
            if self.device_index >= count:
                raise ConfigError(
                    f"{self.url}: device cuda:{self.device_index} does not exist; this machine "
                    f"has {count} GPU(s), cuda:0 to cuda:{count - 1}. Fix the device option."
                )
        for path in self.paths:
            mount = mount_of(path)
            if mount is not None:
                self.fstypes[path] = mount[1]
        self._check_mounts()

    def _set_mode(self, mode: CuFileMode) -> None:
        io = self._io
        version = io.driver_nvfs_version() if isinstance(io, CuFileIO) else None
        reason = mode.reason
        if version is not None:
            reason += f"; cuFile reports nvidia-fs version {version[0]}.{version[1]}"
        self.mode, self.mode_reason = mode.mode, reason

    def _check_mounts(self) -> None:
        """Refuse directories this scheme cannot use (``weka://`` checks the filesystem)."""

    def _prepared(self) -> None:
        try:
            if self.options.register_buffers:
                allocator = self.allocator
                if isinstance(allocator, FreeListAllocator):
                    with self._allocator_lock:
                        self._seen_allocators[id(allocator)] = allocator
                    self._register(allocator.buffer)
            for directory in self.directories:
                self._probe(directory)
        except BaseException:
            self.io.shutdown()  # a failed open keeps no memory registered (or alive)
            raise
        self._report_mode()

    def _report_mode(self) -> None:
        fstypes = ", ".join(f"{path} ({kind})" for path, kind in self.fstypes.items())
        with _reported_lock:
            first = (self.mode, self.mode_reason) not in _reported
            _reported.add((self.mode, self.mode_reason))
        if self.mode == "compat" and first:
            logger.warning(
                "%s: cuFile runs in compatibility mode (%s): payloads move by POSIX I/O "
                "through host bounce buffers inside cuFile, not by GPUDirect DMA. Directories: "
                "%s. Load the nvidia-fs driver, on a filesystem GDS supports, for direct "
                "transfers.",
                self.url,
                self.mode_reason,
                fstypes or "?",
            )
        else:
            logger.log(
                logging.INFO if first else logging.DEBUG,
                "%s: payloads move through %s, mode %s (%s); directories: %s",
                self.url,
                self.io.name,
                self.mode,
                self.mode_reason,
                fstypes or "?",
            )

    def _probe(self, directory: Directory) -> None:
        """Register a file of ``directory`` with cuFile and write and read back one block, so
        a machine where cuFile refuses files fails at open, with the fix, not at the first
        put."""
        name = os.path.join(directory.path, probe_name(self._writer))
        flags = os.O_RDWR | _CREATE_FLAGS
        flags |= O_DIRECT if directory.o_direct else 0
        try:
            fd = os.open(name, flags, 0o600)
        except OSError as error:
            if not _no_room(error):
                raise
            self._probe_skipped(directory, error)
            return
        try:
            try:
                handle = self.io.open(fd)
            except CuFileError as error:
                raise _unavailable(
                    self.url,
                    f"cuFile refused a file in {directory.path}: {error.strerror}."
                    + _udev_hint(directory.path, error),
                ) from None
            try:
                self._probe_round_trip(directory, handle)
            except OSError as error:
                if not _no_room(error):
                    raise
                self._probe_skipped(directory, error)
            finally:
                self.io.close(handle)
        finally:
            os.close(fd)
            unlink_quietly(name)

    def _probe_skipped(self, directory: Directory, error: OSError) -> None:
        logger.warning(
            "%s: cuFile I/O could not be tried in %s: %s: the disk is full or over its "
            "quota, which says nothing about cuFile. The tier opened anyway, and the first "
            "put there shows whether cuFile works. Free space on that disk.",
            self.url,
            directory.path,
            error.strerror,
        )

    def _probe_round_trip(self, directory: Directory, handle: Any) -> None:
        objs = self.allocator.batched_allocate((BLOCK,), torch.uint8, 2, MemoryFormat.BINARY)
        if objs is None:
            return  # the allocator is full; the first put will tell
        source, back = objs
        planned: list[Payload] = []
        try:
            source.raw.copy_(torch.arange(BLOCK, dtype=torch.int64).remainder_(251).byte())
            back.raw.zero_()
            out = self._plan(source, BLOCK, directory.o_direct, writing=True)
            planned.append(out)
            into = self._plan(back, BLOCK, directory.o_direct, writing=False)
            planned.append(into)
            if out.tensor is None or into.tensor is None:  # pragma: no cover - see _plan
                raise BackendError(f"{self.url}: {self.io.name} got no buffer for the probe")
            synchronize(out.tensor, into.tensor)
            written = self.io.write(handle, out.tensor, 0)
            read = self.io.read(handle, into.tensor, 0)
            if into.staging is not None:
                back.raw.copy_(into.staging)
            if (written, read) != (BLOCK, BLOCK) or not torch.equal(source.raw, back.raw):
                raise _unavailable(
                    self.url,
                    f"a {BLOCK}-byte cuFile write and read in {directory.path} moved "
                    f"{written} and {read} bytes or returned other bytes than written",
                )
        except CuFileError as error:
            if _no_room(error):
                raise  # a full disk says nothing about cuFile: _probe tells
            raise _unavailable(
                self.url, f"cuFile I/O in {directory.path} failed: {error.strerror}"
            ) from None
        finally:
            for payload in planned:
                payload.close()
            for obj in objs:
                obj.release()

    def describe(self) -> dict[str, str]:
        """What ``kvplug check`` prints: how payloads move and where."""
        return {
            "io": self._io.name if self._io is not None else "not opened",
            "mode": self.mode,
            "mode reason": self.mode_reason,
            "directories": "; ".join(
                f"{d.describe()} on {self.fstypes.get(d.path, '?')}" for d in self.directories
            ),
            "shard": self.options.shard,
            "device": f"cuda:{self.device_index}" if self.device_index is not None else "?",
        }

    # -- layout policy ------------------------------------------------------------------------

    def _shard(self, stem: str) -> Directory:
        if self.options.shard == "by_gpu":
            return self.directories[(self.device_index or 0) % len(self.directories)]
        return super()._shard(stem)

    def _temp_in_use(
        self, directory: Directory, pid: str, writer: str, mtime: float, writers: LiveWriters
    ) -> bool:
        """Kept while its writer holds its lock, and, since the lock of a writer on another
        host sharing the mount may not be visible here, while younger than TEMP_GRACE."""
        if time.time() - mtime < TEMP_GRACE:
            return True
        return super()._temp_in_use(directory, pid, writer, mtime, writers)

    # -- reads --------------------------------------------------------------------------------

    # Reads go through cuFile into memory this backend allocates (GPU or registered host
    # memory), then one copy into the caller's.
    _get_into = Backend._get_into

    def _read_once(
        self, key: CacheKey, key_text: str, entry: IndexEntry, into: Lease | None = None
    ) -> MemoryObj | ObjectHeader | None:
        if into is not None:
            raise NotSupported("gds:// reads into its own memory; get_into copies from there")
        try:
            return self._read_path(key, key_text, entry, entry.path)
        except _Replaced:
            pass
        # A writer replaced the file between our open and cuFile's registration, which
        # cuFile refuses for a deleted file. Hold the file there now under a link of our
        # own, which no writer can delete, and read that: the old object or the new one.
        link = os.path.join(os.path.dirname(entry.path), temp_name(entry.stem, self._writer))
        try:
            os.link(entry.path, link, follow_symlinks=False)
        except FileNotFoundError:
            self._forget(key, entry)
            return None
        except OSError as error:
            try:
                mode = os.lstat(entry.path).st_mode
            except FileNotFoundError:
                self._forget(key, entry)
                return None
            except OSError:
                mode = stat.S_IFREG
            if not stat.S_ISREG(mode):
                self._forget_foreign(key, entry, NotAnObject(entry.path, kind_of(mode)))
                return None
            raise BackendError(
                f"{self.url}: cannot link {entry.path} to read it: {error.strerror}."
            ) from None
        try:
            return self._read_path(key, key_text, entry, link)
        except _Replaced:  # pragma: no cover - our link keeps the file
            return None
        finally:
            unlink_quietly(link)

    def _payload_handle(
        self, fd: int, path: str, key_text: str, o_direct: bool
    ) -> Callable[[], AbstractContextManager[Any]]:
        """cuFile's handle for a payload read, on a second descriptor of the very file ``fd``
        holds, opened without O_NOFOLLOW (which cuFile refuses). A file replaced or removed
        meanwhile raises :class:`_Replaced` (cuFile refuses deleted files); cuFile errors
        become :class:`~kvplug.errors.BackendError`."""

        @contextlib.contextmanager
        def opened() -> Iterator[Any]:
            flags = os.O_RDONLY | os.O_CLOEXEC | (O_DIRECT if o_direct else 0)
            io_fd = _reopen(fd, flags)
            try:
                try:
                    handle = self.io.open(io_fd)
                except CuFileError as error:
                    if _replaced(fd, path):
                        raise _Replaced from None
                    raise BackendError(
                        f"{self.url}: cuFile cannot read {key_text!r}: {error.strerror}"
                    ) from None
                try:
                    yield handle
                except CuFileError as error:
                    raise BackendError(
                        f"{self.url}: cuFile failed reading {key_text!r}: {error.strerror}"
                    ) from None
                finally:
                    self.io.close(handle)
            finally:
                os.close(io_fd)

        return opened

    # -- close --------------------------------------------------------------------------------

    async def _close(self) -> None:
        """As ``file://``'s close, then drop this backend's cuFile buffer registrations (kept
        when file I/O is still running after the close deadline)."""
        await super()._close()
        with self._setup_lock:
            if self._released or self._io is None:
                return
            self._released = True
        busy = self._workers.busy
        if busy:
            logger.warning(
                "%s: closed with file I/O still running; its cuFile buffer registrations are "
                "kept until the process ends.",
                self.url,
            )
            return
        self._io.shutdown()


def _reopen(fd: int, flags: int) -> int:
    """A second descriptor of the very file ``fd`` holds (reopened through /proc/self/fd,
    whatever was renamed since), opened with ``flags``: object files are opened with
    O_NOFOLLOW, which cuFile refuses (error 5019, INVALID_FILE_OPEN_FLAG)."""
    again = os.open(f"/proc/self/fd/{fd}", flags)
    first, second = os.fstat(fd), os.fstat(again)
    if (first.st_dev, first.st_ino) != (second.st_dev, second.st_ino):  # pragma: no cover
        os.close(again)
        raise OSError(errno.EIO, "reopening an object file gave another file")
    return again


def _replaced(fd: int, path: str) -> bool:
    """Whether ``path`` no longer names the file open as ``fd`` (replaced or removed)."""
    try:
        now = os.stat(path, follow_symlinks=False)
    except OSError:
        return True
    opened = os.fstat(fd)
    return (now.st_dev, now.st_ino) != (opened.st_dev, opened.st_ino)


class WekaBackend(GdsBackend):
    """``weka:///dir``: :class:`GdsBackend` on a WekaFS mount.

    What differs from ``gds://``:

    * each directory must be on a filesystem of type ``wekafs`` (from ``/proc/mounts``, the
      longest mount point holding it); anything else is refused at open unless
      ``allow_non_weka=true`` (tests, staging machines);
    * O_DIRECT is required: WekaFS takes GPUDirect I/O on O_DIRECT files only, and buffered
      I/O there goes through the page cache, so ``o_direct=false`` or a directory refusing
      O_DIRECT is an error instead of a fallback;
    * the mode reports whether writes to WekaFS use cuFile's compatibility mode, which
      cufile.json's ``fs.weka.rdma_write_support`` (default false) decides.
    """

    Options: ClassVar[type[BackendOptions]] = WekaOptions
    options: WekaOptions

    def __init__(
        self,
        url: BackendURL | str,
        *,
        allocator: Allocator | None = None,
        file_io: FileIO | None = None,
        **options: Any,
    ) -> None:
        super().__init__(url, allocator=allocator, file_io=file_io, **options)
        if not self.options.o_direct:
            raise ConfigError(
                f"{self.url}: weka:// always uses O_DIRECT (WekaFS takes GPUDirect I/O on "
                "O_DIRECT files only); remove o_direct=false, or use gds:// for buffered I/O."
            )

    def _set_mode(self, mode: CuFileMode) -> None:
        super()._set_mode(mode)
        if self.mode == "gds" and mode.weka_write_compat:
            self.mode_reason += (
                "; writes to WekaFS use compatibility mode (cufile.json "
                "fs.weka.rdma_write_support is false)"
            )

    def _check_mounts(self) -> None:
        if self.options.allow_non_weka:
            return
        for path in self.paths:
            found = mount_of(path)
            if found is None:
                raise ConfigError(
                    f"{self.url}: cannot tell which filesystem holds {path} (/proc/mounts is "
                    "unreadable). Pass allow_non_weka=true to skip the WekaFS check."
                )
            point, kind = found
            if kind != "wekafs":
                raise ConfigError(
                    f"{self.url}: {path} is on a {kind} filesystem mounted at {point}, not on "
                    "WekaFS (type wekafs in /proc/mounts). Use a directory on a Weka mount, "
                    f"gds://{path} for other filesystems, or allow_non_weka=true to accept it."
                )

    def _prepared(self) -> None:
        refused = [d for d in self.directories if d.direct_io is DirectIO.REFUSED]
        if refused:
            problems = "; ".join(f"{d.path}: {d.o_direct_problem}" for d in refused)
            raise ConfigError(
                f"{self.url}: weka:// needs O_DIRECT, which the filesystems of these "
                f"directories refuse: {problems}. Put them on a WekaFS mount."
            )
        untested = [d for d in self.directories if not d.o_direct]
        if untested:
            problems = "; ".join(f"{d.path}: {d.o_direct_problem}" for d in untested)
            raise ConfigError(
                f"{self.url}: weka:// needs O_DIRECT, and the O_DIRECT probe could not run in "
                f"these directories: {problems}. That says nothing about O_DIRECT support "
                "(file:// would write buffered meanwhile; weka:// cannot). Fix the cause "
                "(free space on that disk, raise the quota, check the disk) and open again."
            )
        super()._prepared()


__all__ = [
    "DEFAULT_BUFFER_SIZE",
    "STAGING_POOL_SIZE",
    "TEMP_GRACE",
    "GdsBackend",
    "GdsOptions",
    "GdsUnavailable",
    "WekaBackend",
    "WekaOptions",
]
