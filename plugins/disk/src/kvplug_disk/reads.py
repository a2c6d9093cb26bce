"""The disk engine's read path (internal): an object file read into memory through the
backend's :class:`~kvplug_disk.fileio.FileIO` and verified (header block, key, length,
payload checksum) before anything is returned; a damaged file is a counted miss and is
removed."""

# File descriptors and str paths on the I/O path, as in kvplug_disk.backend.
# ruff: noqa: PTH108, PTH116, PTH118, PTH120

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import Any

from kvplug.errors import BackendError, CorruptObject, LayoutMismatch
from kvplug.frame import verify_payload
from kvplug.keys import CacheKey
from kvplug.lease import Lease
from kvplug.memory import MemoryObj, nbytes_of
from kvplug_disk import piecewise
from kvplug_disk.fileio.base import Payload, synchronize
from kvplug_disk.fileops import (
    O_DIRECT,
    Access,
    NotAnObject,
    byte_view,
    header_buffer,
    kind_of,
    open_object_sized,
    read_all,
    reason,
    unlink_quietly,
)
from kvplug_disk.index import IndexEntry
from kvplug_disk.layout import BLOCK, ObjectHeader, decode_block, padded, temp_name
from kvplug_disk.workers import FileWork

logger = logging.getLogger("kvplug.disk")


class _Replaced(Exception):
    """The file being read was replaced or removed meanwhile, and the FileIO refused it: cuFile
    refuses to register a descriptor of a deleted file (error 5031, GETNEWFD_FAILED), so the
    read starts over."""


def _computed(checksum: int, payload: Any) -> int:
    """A ``digest`` for :func:`~kvplug.frame.verify_payload` that answers the checksum
    already computed while the payload was read."""
    return checksum


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


class ObjectReader(FileWork):
    """Reads the objects of :attr:`backend` on its file I/O threads, keeping :attr:`catalog`
    up to date with what the files hold (:attr:`writer` names the links of
    :meth:`_read_once`)."""

    def read(self, key: CacheKey, entry: IndexEntry, into: Lease | None = None) -> MemoryObj | None:
        """The whole get (into a new object, or into the one ``into`` lends), on a worker
        thread."""
        self.backend.ensure_open()
        key_text = key.to_string()
        result: MemoryObj | None = None
        for _ in range(3):
            outcome = self._read_once(key, key_text, entry, into)
            if isinstance(outcome, ObjectHeader):
                entry = self.catalog.adopt(key, entry, outcome)
                continue
            result = outcome
            break
        if result is not None:
            with self.catalog.lock:
                self.catalog.index.hit(key)
        return result

    def _read_once(
        self, key: CacheKey, key_text: str, entry: IndexEntry, into: Lease | None
    ) -> MemoryObj | ObjectHeader | None:
        """Read ``entry`` into a new object, or into the caller's object ``into`` lends (never
        released here) when its size is the stored object's."""
        try:
            return self._read_path(key, key_text, entry, entry.path, into)
        except _Replaced:
            pass
        # A writer replaced the file between our open and the FileIO's, which refuses a
        # deleted file (cuFile does). Hold the file there now under a link of our own, which
        # no writer can delete, and read that: the old object or the new one.
        link = os.path.join(os.path.dirname(entry.path), temp_name(entry.stem, self.writer))
        try:
            os.link(entry.path, link, follow_symlinks=False)
        except FileNotFoundError:
            self.catalog.forget(key, entry)
            return None
        except OSError as error:
            try:
                mode = os.lstat(entry.path).st_mode
            except FileNotFoundError:
                self.catalog.forget(key, entry)
                return None
            except OSError:
                mode = stat.S_IFREG
            if not stat.S_ISREG(mode):
                self.catalog.forget_foreign(key, entry, NotAnObject(entry.path, kind_of(mode)))
                return None
            raise BackendError(
                f"{self.backend.url}: cannot link {entry.path} to read it: {error.strerror}."
            ) from None
        try:
            return self._read_path(key, key_text, entry, link, into)
        except _Replaced:  # pragma: no cover - our link keeps the file
            return None
        finally:
            unlink_quietly(link)

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
            payload = self.planner.plan(
                obj, padded(entry.payload_len), entry.directory.o_direct, False, access
            )
            try:
                fd, size = open_object_sized(path, O_DIRECT if payload.o_direct else 0)
            except FileNotFoundError:
                self.catalog.forget(key, entry)
                return None
            except NotAnObject as error:
                self.catalog.forget_foreign(key, entry, error)
                return None
            except OSError as error:
                raise BackendError(
                    f"{self.backend.url}: cannot open {path}: {reason(error)}. Check the "
                    f"{self.backend.scheme.medium} and the directory's permissions."
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

    def _allocate_for(self, key: CacheKey, entry: IndexEntry) -> MemoryObj | None:
        """An object to read ``entry`` into; None (counted) when the allocator is full."""
        obj = self.backend.allocator.allocate(entry.shape, entry.dtype, entry.fmt)
        if obj is None:
            with self.catalog.lock:
                self.catalog.allocation_failures += 1
            logger.debug("%s: allocator full; a hit on %s reads as a miss", self.backend.url, key)
        return obj

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
        io = self.backend.io
        try:
            if piecewise.reads_in_pieces(payload, io):
                count, checksum = piecewise.read_hashing(
                    fd, memoryview(head_block), payload, self.workers.readers
                )
            else:
                count = io.read_object(
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
            elif payload.tensor is not None and self.backend.scheme.checksums_device_memory:
                nbytes = header.frame.payload_len
                with payload.access():
                    host = payload.tensor[:nbytes].cpu()
                verify_payload(header.frame, byte_view(host))
        return None

    def _payload_handle(
        self, fd: int, path: str, key_text: str, o_direct: bool
    ) -> Callable[[], AbstractContextManager[Any]] | None:
        """How the FileIO opens the file ``fd`` (``path``, holding ``key_text``, opened with
        O_DIRECT or not) for a payload read: its own way
        (:meth:`~kvplug_disk.fileio.FileIO.open`, None here) unless it refuses the
        O_NOFOLLOW descriptor ``fd``; then on a second descriptor of the very file ``fd``
        holds, opened without it. A file replaced or removed meanwhile that the FileIO
        refuses raises :class:`_Replaced`; the library's own errors become
        :class:`~kvplug.errors.BackendError` (they say nothing about the file)."""
        io = self.backend.io
        if not io.refuses_nofollow:
            return None
        url = self.backend.url

        @contextlib.contextmanager
        def opened() -> Iterator[Any]:
            flags = os.O_RDONLY | os.O_CLOEXEC | (O_DIRECT if o_direct else 0)
            io_fd = _reopen(fd, flags)
            try:
                try:
                    handle = io.open(io_fd)
                except io.library_errors as error:
                    if _replaced(fd, path):
                        raise _Replaced from None
                    raise BackendError(
                        f"{url}: {io.library} cannot read {key_text!r}: {error.strerror}"
                    ) from None
                try:
                    yield handle
                except io.library_errors as error:
                    raise BackendError(
                        f"{url}: {io.library} failed reading {key_text!r}: {error.strerror}"
                    ) from None
                finally:
                    io.close(handle)
            finally:
                os.close(io_fd)

        return opened

    def _discard_corrupt(self, key: CacheKey, entry: IndexEntry, fd: int, error: Exception) -> None:
        catalog = self.catalog
        catalog.damaged_values.found(entry.path, error)
        with catalog.stripe(entry.stem):
            with catalog.lock:
                current = catalog.index.get(key)
                if current is not None and current.gen == entry.gen:
                    catalog.index.remove(key)
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
                    "%s: could not delete the damaged %s: %s",
                    self.backend.url,
                    entry.path,
                    reason(failure),
                )


__all__ = ["ObjectReader"]
