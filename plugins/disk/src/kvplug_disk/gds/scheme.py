"""What ``gds://`` and ``weka://`` add to the disk engine, declared through its
:class:`~kvplug_disk.scheme.DiskScheme` seam: :class:`GdsScheme` and :class:`WekaScheme`.

* At open, before the directories: the machine has a CUDA GPU and cuFile loads and can do I/O
  (then :class:`~kvplug_disk.fileio.CuFileIO` moves the payloads), cuFile's mode, the GPU
  named by ``device``, the directories' filesystems (``weka://``: WekaFS).
* Once the directories are open: the tier's own GPU buffer registered with cuFile, and one
  block written and read back through cuFile in each directory, so that a machine where
  cuFile refuses files fails at open, with the fix.
* Memory: payloads outside memory cuFile takes are staged in a pinned pool registered with
  cuFile; allocator buffers moved as they are get registered once
  (``register_buffers=true``); ``gpu_checksum`` checksums payloads in GPU memory too.
* Policy: ``shard=by_gpu``, temporary files of writers on other hosts kept for
  :data:`TEMP_GRACE`, ``get_into`` through the tier's own memory.
"""

# File descriptors and str paths, as in kvplug_disk.backend.
# ruff: noqa: PTH118

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from kvplug.errors import BackendError, ConfigError
from kvplug.memory import FreeListAllocator, MemoryFormat, MemoryObj
from kvplug_disk.directories import DirectIO, Directory
from kvplug_disk.fileio.base import FileIO, Payload, synchronize
from kvplug_disk.fileio.cufile import CuFileError, CuFileIO
from kvplug_disk.fileops import O_DIRECT, unlink_quietly
from kvplug_disk.gds.environment import (
    CuFileMode,
    detect_mode,
    libcufile_candidates,
    mount_of,
    udev_hint,
    unavailable,
)
from kvplug_disk.gds.options import GdsOptions, WekaOptions, device_index
from kvplug_disk.layout import BLOCK, padded, probe_name
from kvplug_disk.payloads import PayloadPlanner
from kvplug_disk.scheme import DiskScheme

if TYPE_CHECKING:
    from kvplug_disk.backend import DiskBackend

logger = logging.getLogger("kvplug.gds")

STAGING_POOL_SIZE = 64 << 20
"""Pinned host memory for objects whose own memory cuFile cannot use (pageable host memory,
tensors not from a 4096-aligned allocator)."""
TEMP_GRACE = 3600.0
"""Seconds a temporary file of a process not running here is left alone at open: on a shared
mount it may belong to a writer on another host."""
_CREATE_FLAGS = os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
"""Files handed to cuFile are opened without O_NOFOLLOW, which cuFileHandleRegister refuses
(error 5019, INVALID_FILE_OPEN_FLAG); O_EXCL already refuses to follow a symbolic link."""
_reported: set[tuple[str, str]] = set()
_reported_lock = threading.Lock()


def _no_room(error: OSError) -> bool:
    """Whether ``error`` (cuFile's too, which carries the errno as its code) says that the
    disk is full or the user over its quota."""
    code = error.code if isinstance(error, CuFileError) else error.errno
    return code in (errno.ENOSPC, errno.EDQUOT)


class GdsScheme(DiskScheme):
    """``gds://``: cuFile (or the FileIO given in its place), checked at open; registered,
    pinned staging memory; ``shard=by_gpu``; see the module's docstring."""

    medium: ClassVar[str] = "storage"
    temp_grace: ClassVar[float] = TEMP_GRACE
    reads_into_callers_memory: ClassVar[bool] = False  # through its own registered memory

    def __init__(self, backend: DiskBackend) -> None:
        super().__init__(backend)
        options = backend.options
        if not isinstance(options, GdsOptions):  # pragma: no cover - Options says so
            raise TypeError(f"{type(self).__name__} needs GdsOptions, got {type(options)}")
        self._backend = backend
        self._options = options
        self.mode = "not opened"
        """``"gds"``, ``"compat"`` (cuFile's compatibility mode), or the stand-in's name."""
        self.mode_reason = ""
        self.device_index: int | None = device_index(options.device)
        """The GPU of the tier's own buffer and of ``shard=by_gpu`` (resolved at open)."""
        self.fstypes: dict[str, str] = {}
        """Filesystem type of each directory, from /proc/mounts."""
        self._setup_lock = threading.Lock()
        self._io: FileIO | None = None
        self._buffer: FreeListAllocator | None = None
        self._buffers_lock = threading.Lock()
        self._seen_allocators: dict[int, FreeListAllocator] = {}
        self._staging: FreeListAllocator | None = None
        self._staging_lock = threading.Lock()
        self._released = False

    @property
    def checksums_device_memory(self) -> bool:
        return self._options.gpu_checksum

    def home_directory(self) -> int | None:
        return (self.device_index or 0) if self._options.shard == "by_gpu" else None

    # -- the GPU and its memory -----------------------------------------------------------

    def device(self) -> torch.device:
        """The GPU of the tier's own buffer; :class:`GdsUnavailable` without one."""
        if not torch.cuda.is_available():
            raise unavailable(self._backend.url, "this machine has no CUDA GPU that torch can use")
        index = self.device_index
        return torch.device("cuda", torch.cuda.current_device() if index is None else index)

    def own_buffer(self) -> FreeListAllocator:
        """The tier's own GPU buffer, ``buffer_size`` bytes on :meth:`device`, made on first
        use: where ``get`` allocates when no allocator was given."""
        with self._buffers_lock:
            if self._buffer is None:
                self._buffer = FreeListAllocator(
                    self._options.buffer_size, device=self.device(), sized_by="gds:// buffer_size"
                )
            return self._buffer

    def _pinnable(self) -> bool:
        return torch.cuda.is_available()

    def staging_block(self, length: int) -> MemoryObj:
        """``length`` bytes of 4096-aligned host memory, pinned when CUDA is present: from
        the registered staging pool, or a one-off buffer when the pool is full."""
        with self._staging_lock:
            if self._staging is None:
                self._staging = FreeListAllocator(
                    STAGING_POOL_SIZE, alignment=BLOCK, pin=self._pinnable()
                )
                if self._options.register_buffers:
                    self._register(self._staging.buffer)
            pool = self._staging
        obj = pool.allocate((length,), torch.uint8, MemoryFormat.BINARY_BUFFER)
        if obj is None:
            one_off = FreeListAllocator(padded(length), alignment=BLOCK, pin=self._pinnable())
            obj = one_off.allocate((length,), torch.uint8, MemoryFormat.BINARY_BUFFER)
            if obj is None:  # pragma: no cover - a fresh allocator of that size has room
                raise BackendError(
                    f"{self._backend.url}: could not allocate {length} staging bytes"
                )
        return obj

    def using_block(self, obj: MemoryObj) -> None:
        """Register ``obj``'s allocator buffer with cuFile, once (``register_buffers``)."""
        allocator = obj.allocator
        if not self._options.register_buffers or not isinstance(allocator, FreeListAllocator):
            return
        with self._buffers_lock:
            if id(allocator) in self._seen_allocators:
                return
            self._seen_allocators[id(allocator)] = allocator
        self._register(allocator.buffer)

    def _register(self, buffer: torch.Tensor) -> None:
        """Register an allocator's buffer with cuFile; a refusal is logged, not an error:
        I/O on unregistered memory works, through cuFile's own bounce buffers."""
        io = self._backend.io
        if not io.accepts(buffer):
            return
        if isinstance(io, CuFileIO):
            # cuFile registers memory in this thread's CUDA context (5011, CUDA_DRIVER_ERROR
            # without one); a runtime call binds the device's primary context to the thread.
            index = buffer.device.index if buffer.is_cuda else self.device_index
            torch.cuda.synchronize(index or 0)
        if io.register(buffer):
            return
        logger.warning(
            "%s: cuFile did not register a %s buffer of %d bytes (%s); I/O on it works "
            "unregistered, through cuFile's bounce buffers.",
            self._backend.url,
            buffer.device,
            buffer.numel(),
            io.register_error,
        )

    # -- open -------------------------------------------------------------------------------

    def default_file_io(self) -> FileIO | None:
        return None  # CuFileIO, made at open once the environment is checked

    def open_file_io(self, io: FileIO | None) -> FileIO:
        """Check the environment once (see :meth:`_check_environment`); the FileIO."""
        with self._setup_lock:
            if self._io is None:
                self._io = self._check_environment(io)
            return self._io

    def _check_environment(self, io: FileIO | None) -> FileIO:
        """cuFile loads and can do I/O (unless ``io`` stands in for it), the GPU exists, the
        directories' mounts are right; the FileIO payloads move through."""
        url = self._backend.url
        if io is None:
            if not torch.cuda.is_available():
                raise unavailable(url, "this machine has no CUDA GPU that torch can use")
            try:
                io = CuFileIO()
            except ConfigError as error:
                cause = str(error)
                found = libcufile_candidates()
                if "libcufile.so" in cause and found:
                    cause += f" Found here: {', '.join(found)}."
                raise unavailable(url, cause) from None
            mode = detect_mode()
            if not mode.usable:
                raise unavailable(url, mode.reason)
            self._set_mode(mode, io)
        else:
            self.mode = io.name
            self.mode_reason = "a stand-in for cuFile moves the payloads (CPU tests)"
        if self.device_index is None and torch.cuda.is_available():
            self.device_index = torch.cuda.current_device()
        if self.device_index is not None and isinstance(io, CuFileIO):
            count = torch.cuda.device_count()
            if self.device_index >= count:
                raise ConfigError(
                    f"{url}: device cuda:{self.device_index} does not exist; this machine "
                    f"has {count} GPU(s), cuda:0 to cuda:{count - 1}. Fix the device option."
                )
        for path in self._backend.paths:
            mount = mount_of(path)
            if mount is not None:
                self.fstypes[path] = mount[1]
        self._check_mounts()
        return io

    def _set_mode(self, mode: CuFileMode, io: CuFileIO) -> None:
        version = io.driver_nvfs_version()
        reason = mode.reason
        if version is not None:
            reason += f"; cuFile reports nvidia-fs version {version[0]}.{version[1]}"
        self.mode, self.mode_reason = mode.mode, reason

    def _check_mounts(self) -> None:
        """Refuse directories this scheme cannot use (``weka://`` checks the filesystem)."""

    def directories_opened(self, directories: Sequence[Directory]) -> None:
        """Register the tier's buffer and try cuFile I/O in each directory."""
        io = self._backend.io
        try:
            if self._options.register_buffers:
                allocator = self._backend.allocator
                if isinstance(allocator, FreeListAllocator):
                    with self._buffers_lock:
                        self._seen_allocators[id(allocator)] = allocator
                    self._register(allocator.buffer)
            for directory in directories:
                self._probe(directory)
        except BaseException:
            io.shutdown()  # a failed open keeps no memory registered (or alive)
            raise
        self._report_mode(io)

    def _report_mode(self, io: FileIO) -> None:
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
                self._backend.url,
                self.mode_reason,
                fstypes or "?",
            )
        else:
            logger.log(
                logging.INFO if first else logging.DEBUG,
                "%s: payloads move through %s, mode %s (%s); directories: %s",
                self._backend.url,
                io.name,
                self.mode,
                self.mode_reason,
                fstypes or "?",
            )

    def _probe(self, directory: Directory) -> None:
        """Register a file of ``directory`` with cuFile and write and read back one block, so
        a machine where cuFile refuses files fails at open, with the fix, not at the first
        put."""
        io = self._backend.io
        name = os.path.join(directory.path, probe_name(directory.writer))
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
                handle = io.open(fd)
            except CuFileError as error:
                raise unavailable(
                    self._backend.url,
                    f"cuFile refused a file in {directory.path}: {error.strerror}."
                    + udev_hint(directory.path, error),
                ) from None
            try:
                self._probe_round_trip(directory, io, handle)
            except OSError as error:
                if not _no_room(error):
                    raise
                self._probe_skipped(directory, error)
            finally:
                io.close(handle)
        finally:
            os.close(fd)
            unlink_quietly(name)

    def _probe_skipped(self, directory: Directory, error: OSError) -> None:
        logger.warning(
            "%s: cuFile I/O could not be tried in %s: %s: the disk is full or over its "
            "quota, which says nothing about cuFile. The tier opened anyway, and the first "
            "put there shows whether cuFile works. Free space on that disk.",
            self._backend.url,
            directory.path,
            error.strerror,
        )

    def _probe_round_trip(self, directory: Directory, io: FileIO, handle: Any) -> None:
        url = self._backend.url
        allocator = self._backend.allocator
        objs = allocator.batched_allocate((BLOCK,), torch.uint8, 2, MemoryFormat.BINARY)
        if objs is None:
            return  # the allocator is full; the first put will tell
        source, back = objs
        planner = PayloadPlanner(lambda: io, self)
        planned: list[Payload] = []
        try:
            source.raw.copy_(torch.arange(BLOCK, dtype=torch.int64).remainder_(251).byte())
            back.raw.zero_()
            out = planner.plan(source, BLOCK, directory.o_direct, writing=True)
            planned.append(out)
            into = planner.plan(back, BLOCK, directory.o_direct, writing=False)
            planned.append(into)
            if out.tensor is None or into.tensor is None:  # pragma: no cover - see plan
                raise BackendError(f"{url}: {io.name} got no buffer for the probe")
            synchronize(out.tensor, into.tensor)
            written = io.write(handle, out.tensor, 0)
            read = io.read(handle, into.tensor, 0)
            if into.staging is not None:
                back.raw.copy_(into.staging)
            if (written, read) != (BLOCK, BLOCK) or not torch.equal(source.raw, back.raw):
                raise unavailable(
                    url,
                    f"a {BLOCK}-byte cuFile write and read in {directory.path} moved "
                    f"{written} and {read} bytes or returned other bytes than written",
                )
        except CuFileError as error:
            if _no_room(error):
                raise  # a full disk says nothing about cuFile: _probe tells
            raise unavailable(
                url, f"cuFile I/O in {directory.path} failed: {error.strerror}"
            ) from None
        finally:
            for payload in planned:
                payload.close()
            for obj in objs:
                obj.release()

    # -- close ----------------------------------------------------------------------------

    def closed(self, io: FileIO | None, busy: bool) -> None:
        """Drop this backend's cuFile buffer registrations (kept when file I/O is still
        running after the close deadline)."""
        with self._setup_lock:
            if self._released or io is None:
                return
            self._released = True
        if busy:
            logger.warning(
                "%s: closed with file I/O still running; its cuFile buffer registrations are "
                "kept until the process ends.",
                self._backend.url,
            )
            return
        io.shutdown()


class WekaScheme(GdsScheme):
    """``weka://``: :class:`GdsScheme` on WekaFS, where O_DIRECT is required (see
    :class:`~kvplug_disk.gds.backend.WekaBackend`)."""

    def __init__(self, backend: DiskBackend) -> None:
        super().__init__(backend)
        if not isinstance(self._options, WekaOptions):  # pragma: no cover - Options says so
            raise TypeError(f"WekaScheme needs WekaOptions, got {type(self._options)}")
        self._weka_options = self._options
        if not self._options.o_direct:
            raise ConfigError(
                f"{backend.url}: weka:// always uses O_DIRECT (WekaFS takes GPUDirect I/O on "
                "O_DIRECT files only); remove o_direct=false, or use gds:// for buffered I/O."
            )

    def _set_mode(self, mode: CuFileMode, io: CuFileIO) -> None:
        super()._set_mode(mode, io)
        if self.mode == "gds" and mode.weka_write_compat:
            self.mode_reason += (
                "; writes to WekaFS use compatibility mode (cufile.json "
                "fs.weka.rdma_write_support is false)"
            )

    def _check_mounts(self) -> None:
        if self._weka_options.allow_non_weka:
            return
        url = self._backend.url
        for path in self._backend.paths:
            found = mount_of(path)
            if found is None:
                raise ConfigError(
                    f"{url}: cannot tell which filesystem holds {path} (/proc/mounts is "
                    "unreadable). Pass allow_non_weka=true to skip the WekaFS check."
                )
            point, kind = found
            if kind != "wekafs":
                raise ConfigError(
                    f"{url}: {path} is on a {kind} filesystem mounted at {point}, not on "
                    "WekaFS (type wekafs in /proc/mounts). Use a directory on a Weka mount, "
                    f"gds://{path} for other filesystems, or allow_non_weka=true to accept it."
                )

    def directories_opened(self, directories: Sequence[Directory]) -> None:
        url = self._backend.url
        refused = [d for d in directories if d.direct_io is DirectIO.REFUSED]
        if refused:
            problems = "; ".join(f"{d.path}: {d.o_direct_problem}" for d in refused)
            raise ConfigError(
                f"{url}: weka:// needs O_DIRECT, which the filesystems of these "
                f"directories refuse: {problems}. Put them on a WekaFS mount."
            )
        untested = [d for d in directories if not d.o_direct]
        if untested:
            problems = "; ".join(f"{d.path}: {d.o_direct_problem}" for d in untested)
            raise ConfigError(
                f"{url}: weka:// needs O_DIRECT, and the O_DIRECT probe could not run in "
                f"these directories: {problems}. That says nothing about O_DIRECT support "
                "(file:// would write buffered meanwhile; weka:// cannot). Fix the cause "
                "(free space on that disk, raise the quota, check the disk) and open again."
            )
        super().directories_opened(directories)


__all__ = ["STAGING_POOL_SIZE", "TEMP_GRACE", "GdsScheme", "WekaScheme"]
