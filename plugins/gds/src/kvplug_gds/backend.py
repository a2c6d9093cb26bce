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

import concurrent.futures
import contextlib
import errno
import glob
import logging
import os
import re
import stat
import threading
import time
from typing import Any, ClassVar

import numpy as np
import torch
from pydantic import Field, field_validator

from kvplug.backend import Backend, Capabilities
from kvplug.errors import BackendError, ConfigError, CorruptObject, NotSupported
from kvplug.frame import encode_header, payload_checksum, verify_payload
from kvplug.keys import CacheKey
from kvplug.memory import Allocator, FreeListAllocator, MemoryFormat, MemoryObj
from kvplug.options import BackendOptions
from kvplug.units import GiB, parse_size
from kvplug.url import BackendURL
from kvplug_disk.backend import Directory, DiskBackend, DiskOptions, IndexEntry
from kvplug_disk.fileops import (
    O_DIRECT,
    LiveWriters,
    NotAnObject,
    byte_view,
    fsync_dir,
    header_buffer,
    kind_of,
    open_object,
    unlink_quietly,
    write_all,
)
from kvplug_disk.layout import (
    BLOCK,
    FLAG_NO_PAYLOAD_CHECKSUM,
    SERDE,
    SUFFIX,
    ObjectHeader,
    encode_block,
    padded,
    probe_name,
    temp_name,
)
from kvplug_gds.environment import CuFileMode, detect_mode, mount_of
from kvplug_gds.fileio import CuFileError, CuFileIO, FileIO

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
        "'kvplug-gds[cufile]'); see "
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


def _device_index(text: str) -> int | None:
    match = _DEVICE.fullmatch(text)
    return int(match.group(1)) if match and match.group(1) is not None else None


def _allocator_block(obj: MemoryObj, length: int) -> torch.Tensor | None:
    """The first ``length`` bytes of ``obj``'s allocator block (host or GPU) when it is a
    4096-aligned block of a :class:`FreeListAllocator` at least that long, else None: such a
    block moves to and from the file as it is, its tail being the block's own padding."""
    allocator = obj.allocator
    if not isinstance(allocator, FreeListAllocator) or allocator.alignment % BLOCK:
        return None
    if obj.phy_size < length:
        return None
    buffer = allocator.buffer
    start = buffer.data_ptr() + obj.offset
    if start % BLOCK or (obj.nbytes and start != obj.data_ptr()):
        return None
    return buffer[obj.offset : obj.offset + length]


def _length_only(nbytes: int) -> Any:
    """A zero-copy buffer that is ``nbytes`` long and holds nothing: encode_header reads only
    the payload's length when its checksum is given, and a GPU payload has no host bytes."""
    return np.broadcast_to(np.zeros(1, np.uint8), (nbytes,))


def _gpu_checksum(payload: torch.Tensor) -> int:
    return payload_checksum(byte_view(payload.cpu()))


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

    **Data movement.** Payloads go through one :class:`~kvplug_gds.fileio.FileIO`, the real
    one being :class:`~kvplug_gds.fileio.CuFileIO` (cufile-python): ``cuFileWrite`` and
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

    Without a CUDA GPU or without cuFile, opening raises :class:`GdsUnavailable` (a
    :class:`~kvplug.errors.ConfigError`) naming what is missing.
    """

    capabilities = Capabilities(
        pin=True,
        persistent=True,
        shared_across_processes=True,
        remove=True,
        list_keys=True,
        device_memory=True,
    )
    Options: ClassVar[type[BackendOptions]] = GdsOptions
    options: GdsOptions

    def __init__(
        self,
        url: BackendURL | str,
        *,
        allocator: Allocator | None = None,
        file_io: FileIO | None = None,
        **options: Any,
    ) -> None:
        """``file_io`` replaces cuFile; only the CPU tests pass one
        (:class:`kvplug_gds.standin.PosixStandIn`)."""
        super().__init__(url, allocator=allocator, **options)
        self._io: FileIO | None = file_io
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
    def io(self) -> FileIO:
        """The :class:`~kvplug_gds.fileio.FileIO` payloads move through (set at open)."""
        if self._io is None:
            raise BackendError(f"{self.url} is not open yet; await open() first.")
        return self._io

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

    def _ensure_registered(self, obj: MemoryObj) -> None:
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

    def _target(
        self, obj: MemoryObj, length: int, *, writing: bool
    ) -> tuple[torch.Tensor, MemoryObj | None]:
        """Where the ``length`` payload bytes of the file go to or come from: ``obj``'s own
        allocator block when the I/O seam takes that memory (no copy), else a staging block
        (filled from ``obj`` when writing). Returns the buffer and the staging object to
        release, if any."""
        nbytes = obj.nbytes
        block = _allocator_block(obj, length)
        if block is not None and self.io.accepts(block):
            self._ensure_registered(obj)
            if writing and length > nbytes:
                block[nbytes:].zero_()  # the block's padding: never write stale memory
            return block, None
        staging = self._staging_block(length)
        raw = staging.raw
        if writing:
            raw[:nbytes].copy_(obj.raw.reshape(-1))
            raw[nbytes:].zero_()
        return raw, staging

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
        fd = os.open(name, flags, 0o600)
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
            finally:
                self.io.close(handle)
        finally:
            os.close(fd)
            unlink_quietly(name)

    def _probe_round_trip(self, directory: Directory, handle: Any) -> None:
        objs = self.allocator.batched_allocate((BLOCK,), torch.uint8, 2, MemoryFormat.BINARY)
        if objs is None:
            return  # the allocator is full; the first put will tell
        source, back = objs
        staged: list[MemoryObj] = []
        try:
            source.raw.copy_(torch.arange(BLOCK, dtype=torch.int64).remainder_(251).byte())
            back.raw.zero_()
            out, stage_out = self._target(source, BLOCK, writing=True)
            into, stage_in = self._target(back, BLOCK, writing=False)
            staged = [s for s in (stage_out, stage_in) if s is not None]
            _synchronize(out, into)
            written = self.io.write(handle, out, 0)
            read = self.io.read(handle, into, 0)
            if stage_in is not None:
                back.raw.copy_(into)
            if (written, read) != (BLOCK, BLOCK) or not torch.equal(source.raw, back.raw):
                raise _unavailable(
                    self.url,
                    f"a {BLOCK}-byte cuFile write and read in {directory.path} moved "
                    f"{written} and {read} bytes or returned other bytes than written",
                )
        except CuFileError as error:
            raise _unavailable(
                self.url, f"cuFile I/O in {directory.path} failed: {error.strerror}"
            ) from None
        finally:
            for obj in (*objs, *staged):
                obj.release()

    def describe(self) -> dict[str, str]:
        """What ``kvplug check`` prints: how payloads move and where."""
        return {
            "io": self._io.name if self._io is not None else "not opened",
            "mode": self.mode,
            "mode reason": self.mode_reason,
            "directories": ", ".join(
                f"{d.path} ({self.fstypes.get(d.path, '?')}, "
                f"{'O_DIRECT' if d.o_direct else 'buffered'})"
                for d in self.directories
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

    # -- writes -------------------------------------------------------------------------------

    def _write_file(
        self, directory: Directory, stem: str, key_text: str, obj: MemoryObj, length: int
    ) -> str:
        """Write ``obj`` to a temporary file (payload by the I/O seam, header block by
        pwrite) and rename it into place; the final path."""
        subdir = os.path.join(directory.path, stem[:2])
        final = os.path.join(subdir, stem + SUFFIX)
        temp = os.path.join(subdir, temp_name(stem, self._writer))
        payload_len = length - BLOCK
        nbytes = obj.nbytes
        source: torch.Tensor | None = None
        staging: MemoryObj | None = None
        checksum: concurrent.futures.Future[int] | None = None
        fd = -1
        created = False
        handle: Any = None
        try:
            self._subdir(directory, stem[:2])
            flags_value = 0
            known: int | None = None
            if payload_len:
                source, staging = self._target(obj, payload_len, writing=True)
                _synchronize(source)
                if not source.is_cuda:
                    checksum = self._hashers.submit(payload_checksum, byte_view(source[:nbytes]))
                elif self.options.gpu_checksum:
                    checksum = self._hashers.submit(_gpu_checksum, source[:nbytes])
                else:
                    flags_value, known = FLAG_NO_PAYLOAD_CHECKSUM, 0
            else:
                known = payload_checksum(b"")
            open_flags = os.O_WRONLY | _CREATE_FLAGS
            open_flags |= O_DIRECT if directory.o_direct else 0
            try:
                fd = os.open(temp, open_flags, 0o600)
            except (FileNotFoundError, NotADirectoryError):  # removed or replaced meanwhile
                self._subdir(directory, stem[:2], create=True)
                fd = os.open(temp, open_flags, 0o600)
            created = True
            if source is not None:
                handle = self.io.open(fd)
                written = self.io.write(handle, source, BLOCK)
                if written != payload_len:
                    raise OSError(errno.EIO, f"wrote {written} of {payload_len} payload bytes")
            value = checksum.result() if checksum is not None else known
            frame = encode_header(obj.shape, obj.dtype, obj.fmt, SERDE, _length_only(nbytes), value)
            header = header_buffer()
            header[:] = encode_block(frame, key_text, flags_value)
            if write_all(fd, [memoryview(header)], 0) != BLOCK:
                raise OSError(errno.EIO, "short write of the header block")
            if self.options.fsync:
                os.fsync(fd)
            if handle is not None:
                self.io.close(handle)
                handle = None
            os.close(fd)
            fd = -1
            self._publish(temp, final)
            if self.options.fsync:
                fsync_dir(subdir)
        except BaseException as error:
            if handle is not None:
                with contextlib.suppress(Exception):
                    self.io.close(handle)
            if fd >= 0:
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
            if staging is not None:
                staging.release()
        return final

    # -- reads --------------------------------------------------------------------------------

    # Reads go through cuFile into memory this backend allocates (GPU or registered host
    # memory), then one copy into the caller's.
    _get_into = Backend._get_into

    def _read_once(
        self, key: CacheKey, key_text: str, entry: IndexEntry, into: MemoryObj | None = None
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

    def _read_path(
        self, key: CacheKey, key_text: str, entry: IndexEntry, path: str
    ) -> MemoryObj | ObjectHeader | None:
        """Read ``entry``'s object from ``path`` (its file, or a link to it)."""
        obj = self._allocate_for(key, entry)
        if obj is None:
            return None
        keep = False
        staging: MemoryObj | None = None
        try:
            try:
                fd = open_object(path, O_DIRECT if entry.directory.o_direct else 0)
            except FileNotFoundError:
                self._forget(key, entry)
                return None
            except NotAnObject as error:
                self._forget_foreign(key, entry, error)
                return None
            except OSError as error:
                raise BackendError(
                    f"{self.url}: cannot open {path}: {error.strerror}. Check the "
                    "storage and the directory's permissions."
                ) from None
            try:
                try:
                    header = self._read_header(fd)
                    if header.key_text != key_text:
                        raise CorruptObject(
                            f"file holds key {header.key_text!r}, not {key_text!r}."
                        )
                    if not entry.describes(header):
                        return header  # replaced by another object: read that one instead
                    staging = self._read_payload(fd, obj, header, entry, path)
                except CorruptObject as error:
                    self._discard_corrupt(key, entry, fd, error)
                    return None
            finally:
                os.close(fd)
            keep = True
            return obj
        finally:
            if staging is not None:
                staging.release()
            if not keep:
                obj.release()

    def _read_payload(
        self, fd: int, obj: MemoryObj, header: ObjectHeader, entry: IndexEntry, path: str
    ) -> MemoryObj | None:
        """Read and check the payload into ``obj``; the staging object used, if any."""
        length = padded(obj.nbytes)
        if not length:
            return None
        target, staging = self._target(obj, length, writing=False)
        try:
            self._read_into(fd, obj, target, header, entry, path)
        except BaseException:
            if staging is not None:
                staging.release()
            raise
        if staging is not None:
            obj.raw.copy_(target[: obj.nbytes])
        return staging

    def _read_into(
        self,
        fd: int,
        obj: MemoryObj,
        target: torch.Tensor,
        header: ObjectHeader,
        entry: IndexEntry,
        path: str,
    ) -> None:
        nbytes = obj.nbytes
        length = target.numel()
        _synchronize(target)
        flags = os.O_RDONLY | os.O_CLOEXEC | (O_DIRECT if entry.directory.o_direct else 0)
        io_fd = _reopen(fd, flags)
        try:
            try:
                handle = self.io.open(io_fd)
            except CuFileError as error:
                if _replaced(fd, path):
                    raise _Replaced from None
                raise BackendError(
                    f"{self.url}: cuFile cannot read {header.key_text!r}: {error.strerror}"
                ) from None
            try:
                count = self.io.read(handle, target, BLOCK)
            except CuFileError as error:
                raise BackendError(
                    f"{self.url}: cuFile failed reading {header.key_text!r}: {error.strerror}"
                ) from None
            finally:
                self.io.close(handle)
        finally:
            os.close(io_fd)
        if count != length:
            raise CorruptObject(f"read {count} of {length} payload bytes: the file was truncated.")
        if header.payload_checksummed:
            if not target.is_cuda:
                verify_payload(header.frame, byte_view(target[:nbytes]))
            elif self.options.gpu_checksum:
                verify_payload(header.frame, byte_view(target[:nbytes].cpu()))

    # -- close --------------------------------------------------------------------------------

    async def _close(self) -> None:
        """As ``file://``'s close, then drop this backend's cuFile buffer registrations (kept
        when file I/O is still running after the close deadline)."""
        await super()._close()
        with self._setup_lock:
            if self._released or self._io is None:
                return
            self._released = True
        with self._inflight_lock:
            busy = bool(self._inflight)
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


def _synchronize(*buffers: torch.Tensor) -> None:
    """Wait for queued work on the GPUs of ``buffers``: cuFile reads and writes GPU memory
    outside CUDA's stream order."""
    for index in sorted({b.device.index or 0 for b in buffers if b.is_cuda}):
        torch.cuda.synchronize(index)


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
        refused = [d for d in self.directories if not d.o_direct]
        if refused:
            problems = "; ".join(f"{d.path}: {d.o_direct_problem}" for d in refused)
            raise ConfigError(
                f"{self.url}: weka:// needs O_DIRECT, which these directories refuse: "
                f"{problems}. Put them on a WekaFS mount."
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
