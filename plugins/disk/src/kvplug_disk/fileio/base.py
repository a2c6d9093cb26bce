"""The seam between the disk engine and the library that moves payload bytes: :class:`FileIO`.

Every object file is a 4096-byte header block at offset 0 and the payload, padded to whole
blocks, from offset 4096 (:mod:`kvplug_disk.layout`). The engine decides what is written and
checks what is read; a :class:`FileIO` only moves bytes between memory and an open file.
"""

from __future__ import annotations

import abc
import contextlib
import errno
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from kvplug.memory import MemoryObj
from kvplug_disk.fileops import Access, read_all, write_all
from kvplug_disk.layout import BLOCK


@dataclass
class Payload:
    """One object's payload on its way between memory and a file (``length`` bytes at file
    offset 4096, block-padded), as the engine planned it."""

    buffers: list[memoryview]
    """The payload as host memory, in file order (what vectored POSIX I/O moves); empty when
    the payload is in device memory."""
    o_direct: bool
    """Whether the file is opened with O_DIRECT."""
    host: memoryview | None
    """The payload's bytes in host memory (what the checksum covers); None in device memory."""
    tensor: torch.Tensor | None = None
    """The whole padded payload as one flat ``uint8`` tensor, when it is one buffer."""
    staging: torch.Tensor | None = None
    """After a read: bytes still to be copied into the object."""
    bounce: MemoryObj | None = field(default=None, repr=False)
    """Staging memory this payload borrowed, released by :meth:`close`."""
    access: Access = field(default=nullcontext, repr=False)
    """Wraps every step that reads or writes the payload's memory (see
    :data:`~kvplug_disk.fileops.Access`): the caller's lease when that memory is the caller's
    object, lent to the I/O thread; ``nullcontext`` when it is kvplug's own."""

    @property
    def length(self) -> int:
        """Bytes the payload occupies in the file."""
        if self.tensor is not None:
            return self.tensor.numel()
        return sum(view.nbytes for view in self.buffers)

    def close(self) -> None:
        """Give back the staging memory, if any."""
        if self.bounce is not None:
            self.bounce.release()
            self.bounce = None


def synchronize(*buffers: torch.Tensor | None) -> None:
    """Wait for queued work on the GPUs of ``buffers``: cuFile reads and writes GPU memory
    outside CUDA's stream order."""
    devices = {b.device.index or 0 for b in buffers if b is not None and b.is_cuda}
    for index in sorted(devices):
        torch.cuda.synchronize(index)


_NO_TENSOR = (
    "{} moves each payload as one tensor, but the engine planned host memory views for it: "
    "only a FileIO that overrides write_object and read_object may set moves_host_views."
)


@dataclass
class _Region:
    buffer: torch.Tensor
    start: int
    end: int
    users: int


class FileIO(abc.ABC):
    """Moves payload bytes between memory (flat ``uint8`` tensors) and open files.

    An implementation provides :meth:`accepts`, :meth:`open`, :meth:`close`, :meth:`_read`
    and :meth:`_write` (pointer-based: the library sees a base address and an offset), and
    optionally :meth:`_register_region` and :meth:`_deregister_region` when the library wants
    memory registered. The engine calls :meth:`write_object` and :meth:`read_object` once per
    object; their defaults move the payload through :meth:`open`/:meth:`write`/:meth:`read`
    at offset 4096 and the header block with ``pwrite``/``pread``. An implementation that
    moves host memory itself may override them to move header and payload in one call
    (:class:`~kvplug_disk.fileio.PosixFileIO` does) and set :attr:`moves_host_views`.

    **Alignment.** File offsets and lengths are whole 4096-byte blocks (:data:`BLOCK`): the
    header block at 0, the payload from 4096, zero-padded to a block boundary. Memory the
    engine hands over is a flat ``uint8`` tensor; when the file is opened with O_DIRECT
    (:attr:`Payload.o_direct`) it starts on a 4096-byte boundary and spans whole blocks (the
    object's own allocator block, or aligned staging memory when :meth:`accepts` refuses the
    object's memory).

    Implementations must be thread-safe: the engine calls them from its worker threads.
    Failures are ``OSError`` (the engine turns them into kvplug errors): one that is not of
    :attr:`library_errors` and has errno EIO or EINVAL while an object is read means a
    damaged file (a counted miss, the file removed).

    Every call that reads or writes a payload's memory runs inside ``payload.access()``, one
    call at a time, and lets what it raises propagate: the payload may be a caller's buffer
    lent to the I/O thread (:mod:`kvplug.lease`), which the caller takes back when its
    operation is cancelled; :meth:`write` and :meth:`read` are wrapped so by the defaults of
    :meth:`write_object` and :meth:`read_object`, and an override does the same.
    """

    name: str = "?"
    """Shown by ``kvplug check`` and in logs."""
    moves_host_views: ClassVar[bool] = False
    """True when :meth:`write_object` and :meth:`read_object` move
    :attr:`Payload.buffers` (any host memory), so that without O_DIRECT a payload needs no
    aligned staging; False when they need :attr:`Payload.tensor` in memory :meth:`accepts`."""
    refuses_nofollow: ClassVar[bool] = False
    """True when :meth:`open` refuses a descriptor opened with ``O_NOFOLLOW`` (cuFile does):
    the engine then creates files without that flag (``O_EXCL`` refuses links anyway) and
    reads a payload through a second descriptor of the file it checked, opened without it."""
    library: ClassVar[str] = "the I/O library"
    """What error messages call the library behind this FileIO."""
    library_errors: ClassVar[tuple[type[OSError], ...]] = ()
    """Errors of the library itself (cuFile's, whatever their errno), which say nothing about
    the file's bytes: a read failing with one is a :class:`~kvplug.errors.BackendError`,
    never a damaged file. When :meth:`open` refuses a file with one and the file was replaced
    or removed meanwhile, the engine reads the file there now instead."""
    _shared_table: ClassVar[dict[int, _Region] | None] = None
    """Set on a subclass whose registrations are process-wide (cuFile's are)."""
    _shared_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self) -> None:
        if self._shared_table is not None:
            self._table, self._table_lock = self._shared_table, self._shared_lock
        else:
            self._table, self._table_lock = {}, threading.Lock()
        self._mine: dict[int, int] = {}
        self.register_error: str | None = None
        """Why the last :meth:`register` that returned False was refused."""

    # -- what a subclass provides ---------------------------------------------------------

    @abc.abstractmethod
    def accepts(self, buffer: torch.Tensor) -> bool:
        """Whether I/O can go straight to and from ``buffer``'s memory."""

    @abc.abstractmethod
    def open(self, fd: int) -> Any:
        """A handle for I/O on the open file ``fd`` (``fd`` stays the caller's to close)."""

    @abc.abstractmethod
    def close(self, handle: Any) -> None:
        """Release a handle of :meth:`open`."""

    @abc.abstractmethod
    def _read(self, handle: Any, base: int, size: int, file_offset: int, offset: int) -> int:
        """Read ``size`` bytes at ``file_offset`` into ``base + offset``; bytes read."""

    @abc.abstractmethod
    def _write(self, handle: Any, base: int, size: int, file_offset: int, offset: int) -> int:
        """Write ``size`` bytes from ``base + offset`` at ``file_offset``; bytes written."""

    def _register_region(self, pointer: int, size: int) -> None:
        """Register memory with the I/O library (default: nothing to do). Raises an
        ``OSError`` when the library refuses it."""

    def _deregister_region(self, pointer: int) -> None:
        """Undo :meth:`_register_region` (default: nothing to do)."""

    # -- whole objects: what the engine calls ---------------------------------------------

    def write_object(self, fd: int, payload: Payload, header: Callable[[], memoryview]) -> None:
        """Write one object file: the payload at offset 4096, then the header block at 0.
        ``header()`` builds the header block once the payload's checksum is known (it may
        be computed while the payload is written). Raises ``OSError`` on any failure,
        short writes included."""
        if payload.length:
            if payload.tensor is None:
                raise ValueError(_NO_TENSOR.format(self.name))
            handle = self.open(fd)
            try:
                with payload.access():
                    written = self.write(handle, payload.tensor, BLOCK)
                if written != payload.length:
                    raise OSError(errno.EIO, f"wrote {written} of {payload.length} payload bytes")
                if write_all(fd, [header()], 0) != BLOCK:
                    raise OSError(errno.EIO, "short write of the header block")
            finally:
                self.close(handle)
        elif write_all(fd, [header()], 0) != BLOCK:
            raise OSError(errno.EIO, "short write of the header block")

    def read_object(
        self,
        fd: int,
        header: memoryview,
        payload: Payload,
        handle: Callable[[], AbstractContextManager[Any]] | None = None,
    ) -> int:
        """Read one object file: the header block into ``header`` and the payload into
        ``payload``; the count of bytes read (short at the end of the file). ``handle``, when
        given, opens the handle the payload is read through (the engine's hook for libraries
        that need the file opened their own way)."""
        count = read_all(fd, [header], 0)
        if count != BLOCK or not payload.length:
            return count
        if payload.tensor is None:
            raise ValueError(_NO_TENSOR.format(self.name))
        opener = handle if handle is not None else default_payload_handle(self, fd)
        with opener() as opened, payload.access():
            return count + self.read(opened, payload.tensor, BLOCK)

    # -- registration ---------------------------------------------------------------------

    def register(self, buffer: torch.Tensor) -> bool:
        """Register ``buffer`` (a whole allocator buffer) for I/O. Counted: several backends
        may register the same buffer, and it stays registered until the last lets go. False if
        the library refused it (I/O on it still works, unregistered)."""
        pointer, size = buffer.data_ptr(), buffer.numel()
        with self._table_lock:
            region = self._table.get(pointer)
            if region is not None and region.end - region.start >= size:
                region.users += 1
            elif region is not None:
                self.register_error = "a smaller buffer at that address is registered"
                return False
            else:
                try:
                    self._register_region(pointer, size)
                except OSError as error:
                    self.register_error = error.strerror
                    return False
                self._table[pointer] = _Region(buffer, pointer, pointer + size, 1)
            self._mine[pointer] = self._mine.get(pointer, 0) + 1
            return True

    def deregister(self, buffer: torch.Tensor) -> None:
        """Drop one registration this instance made of ``buffer``; the last user's drop
        deregisters it."""
        self._drop(buffer.data_ptr(), 1)

    def _drop(self, pointer: int, count: int) -> None:
        with self._table_lock:
            held = self._mine.get(pointer, 0)
            count = min(count, held)
            if not count:
                return
            if held == count:
                del self._mine[pointer]
            else:
                self._mine[pointer] = held - count
            region = self._table[pointer]
            region.users -= count
            if region.users:
                return
            del self._table[pointer]
        self._deregister_region(pointer)

    def registered(self, buffer: torch.Tensor) -> bool:
        """Whether ``buffer`` lies inside registered memory."""
        return self._locate(buffer)[1] is not None

    def _locate(self, buffer: torch.Tensor) -> tuple[int, int | None]:
        """``(base, offset)`` for I/O on ``buffer``: inside a registered region, its start
        and the offset in it; else the buffer's own pointer and None."""
        start = buffer.data_ptr()
        end = start + buffer.numel()
        with self._table_lock:
            for region in self._table.values():
                if region.start <= start and end <= region.end:
                    return region.start, start - region.start
        return start, None

    def read(self, handle: Any, buffer: torch.Tensor, file_offset: int) -> int:
        """Fill ``buffer`` from the file at ``file_offset``; the count read (short at EOF)."""
        base, offset = self._locate(buffer)
        return self._read(handle, base, buffer.numel(), file_offset, offset or 0)

    def write(self, handle: Any, buffer: torch.Tensor, file_offset: int) -> int:
        """Write all of ``buffer`` to the file at ``file_offset``; the count written."""
        base, offset = self._locate(buffer)
        return self._write(handle, base, buffer.numel(), file_offset, offset or 0)

    def shutdown(self) -> None:
        """Drop every registration this instance still holds (its backend is closing)."""
        with self._table_lock:
            held = dict(self._mine)
        for pointer, count in held.items():
            self._drop(pointer, count)


def default_payload_handle(io: FileIO, fd: int) -> Callable[[], AbstractContextManager[Any]]:
    """The default payload handle of :meth:`FileIO.read_object`: ``io.open(fd)``, closed
    after the read."""

    @contextlib.contextmanager
    def opened() -> Iterator[Any]:
        handle = io.open(fd)
        try:
            yield handle
        finally:
            io.close(handle)

    return opened


__all__ = ["FileIO", "Payload", "default_payload_handle", "synchronize"]
