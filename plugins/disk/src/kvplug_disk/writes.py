"""The disk engine's write path (internal): a put writes its object through the backend's
:class:`~kvplug_disk.fileio.FileIO` into a temporary file, renames it into place and indexes
it; a remove deletes the file. Every ``OSError`` becomes a kvplug error that names the
directory, the cause and the fix."""

# File descriptors and str paths on the I/O path, as in kvplug_disk.backend.
# ruff: noqa: PTH102, PTH105, PTH118, PTH120

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import logging
import os
import shutil
import stat
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from kvplug.errors import BackendError, CapacityExceeded
from kvplug.frame import encode_header, payload_checksum
from kvplug.index import Reservation
from kvplug.keys import CacheKey
from kvplug.lease import Lease, Revoked
from kvplug_disk.directories import OPEN_FLAGS, Claim, Directory, shard_of
from kvplug_disk.fileio.base import synchronize
from kvplug_disk.fileops import (
    O_DIRECT,
    Access,
    Deleted,
    WriteRefused,
    byte_view,
    classify_os_error,
    clear_the_way,
    delete_object_file,
    fsync_dir,
    header_buffer,
    kind_of,
    move_aside,
    reason,
    unlink_quietly,
)
from kvplug_disk.index import IndexEntry
from kvplug_disk.layout import (
    BLOCK,
    FLAG_NO_PAYLOAD_CHECKSUM,
    SERDE,
    SUFFIX,
    digest,
    encode_block,
    temp_name,
)
from kvplug_disk.workers import FileWork

logger = logging.getLogger("kvplug.disk")

_WRITE_LEFT = "This object was not stored and no partial file of it was left; reads keep working."
_DELETE_LEFT = (
    "The object is still stored and still served, and its bytes still count against max_size."
)


def _length_only(nbytes: int) -> Any:
    """A zero-copy buffer that is ``nbytes`` long and holds nothing: encode_header reads only
    the payload's length when its checksum is given, and a GPU payload has no host bytes."""
    return np.broadcast_to(np.zeros(1, np.uint8), (nbytes,))


def _checksum(access: Access, host: memoryview) -> int:
    with access():
        return payload_checksum(host)


def _device_checksum(access: Access, payload: torch.Tensor) -> int:
    with access():
        host = payload.cpu()
    return payload_checksum(byte_view(host))


class ObjectWriter(FileWork):
    """Writes and deletes the object files of :attr:`backend` on its file I/O threads,
    keeping :attr:`catalog` up to date (:attr:`writer` names its temporary files)."""

    # -- puts -----------------------------------------------------------------------------

    def put(self, key: CacheKey, key_text: str, length: int, source: Lease) -> None:
        """The whole put of the object ``source`` lends, on a worker thread; ends the lease."""
        backend = self.backend
        try:
            backend.ensure_open()
            if source.revoked:  # cancelled while queued: make no room for it
                raise Revoked("the put was cancelled before it started")
            stem = digest(key_text)
            directory = shard_of(backend.directories, stem, backend.scheme.home_directory())
            with self.catalog.stripe(stem):
                reservation = self.catalog.reserve(key, length, backend.ensure_open)
                try:
                    with self._room_on_disk(directory, length) as room:
                        self._write_file(key, key_text, directory, stem, source, reservation, room)
                except BaseException:
                    with self.catalog.lock:
                        self.catalog.index.cancel(reservation)
                    raise
        finally:
            source.end()

    @contextlib.contextmanager
    def _room_on_disk(self, directory: Directory, length: int) -> Iterator[Claim]:
        """Claim ``length`` bytes of the free space of ``directory``'s disk while a write of
        that size runs there (the part the file has not been allocated yet). Raises
        CapacityExceeded, before anything is written, when the free space less what the
        writes in flight there still need is short: writes that start together never all
        begin on room for some of them and all run out of it half-way."""
        url = self.backend.url

        def free_space() -> int:
            try:
                return shutil.disk_usage(directory.path).free
            except OSError as error:
                raise BackendError(
                    f"{url}: cannot check the free space of {directory.path}: "
                    f"{reason(error)}. Check that the directory still exists."
                ) from None

        claim = directory.claim(length, free_space)
        if not isinstance(claim, Claim):
            free, pending = claim
            writing = f", {pending} of them needed by writes in flight there," if pending else ""
            raise CapacityExceeded(
                f"the disk holding {directory.path} has {free} bytes free{writing} and an "
                f"object file needs {length}; this object was not stored and reads keep "
                f"working. Free space on that disk, lower max_size (now "
                f"{self.backend.max_size}) below what the disk can hold, or add a directory "
                "on another disk."
            )
        try:
            yield claim
        finally:
            directory.unclaim(claim)

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
        """Write the object ``source`` lends to a temporary file (through the FileIO), then
        rename it into place and index it under ``reservation``; ``room`` follows the file's
        allocation.

        Every read of the caller's memory happens inside ``source.use()``; so do the rename
        and the index update, together, after the last read: a put cancelled before that
        point leaves no file and no index entry (its temporary file is deleted here when the
        next access raises :class:`~kvplug.lease.Revoked`), and the cancellation of one that
        has reached it waits for it, so the object is then stored whole."""
        backend, catalog = self.backend, self.catalog
        fsync = backend.options.fsync
        obj = source.obj
        length = reservation.nbytes
        subdir = os.path.join(directory.path, stem[:2])
        final = os.path.join(subdir, stem + SUFFIX)
        temp = os.path.join(subdir, temp_name(stem, self.writer))
        nbytes = obj.nbytes
        payload = self.planner.plan(
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
            checksum = self.workers.hashers.submit(_checksum, payload.access, payload.host)
        elif payload.tensor is not None and backend.scheme.checksums_device_memory:
            checksum = self.workers.hashers.submit(
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
            backend.io.write_object(fd, payload, header)
            if fsync:
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
                catalog.next_generation(),
            )
            with source.use():  # the point of no return (see above)
                self._publish(temp, final)
                created = False
                with catalog.lock:
                    old = catalog.index.commit(reservation, key, entry)
            if fsync:
                try:
                    fsync_dir(subdir)
                except OSError:
                    catalog.forget(key, entry)  # not durable as promised: not stored at all
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
        """Flags of every object file opened for the FileIO (O_NOFOLLOW unless it refuses
        such descriptors; O_EXCL already refuses to follow a link when creating)."""
        return os.O_CLOEXEC if self.backend.io.refuses_nofollow else OPEN_FLAGS

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
                    self.backend.url,
                    path,
                    kind_of(mode),
                    moved,
                )
                os.mkdir(path, 0o700)
            if self.backend.options.fsync:
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
                self.backend.url,
                final,
                moved,
            )
        os.replace(temp, final)

    def _write_failed(self, error: OSError, subdir: str, length: int) -> BackendError:
        """The kvplug error for ``error`` of a put writing into ``subdir``; a refused write is
        also logged, once per directory and cause (a Store only counts it)."""
        where = os.path.dirname(os.fsdecode(error.filename)) if error.filename else subdir
        failure = classify_os_error(
            error,
            f"{self.backend.url}: writing an object file of {length} bytes",
            where,
            _WRITE_LEFT,
        )
        if isinstance(failure, WriteRefused) and self.catalog.first_report(where, error):
            logger.warning("%s", failure)
        return failure

    # -- removals -------------------------------------------------------------------------

    def delete(self, key: CacheKey, stem: str) -> bool:
        """Delete ``key``'s file: True when this deleted it, False when it was not there;
        raises when the file stays (the key stays indexed, readable and counted)."""
        catalog = self.catalog
        self.backend.ensure_open()
        with catalog.stripe(stem):
            with catalog.lock:
                entry = catalog.index.get(key)
            if entry is None:
                return False
            try:
                deleted = delete_object_file(entry.path)
            except OSError as error:
                raise classify_os_error(
                    error,
                    f"{self.backend.url}: deleting the object file of {key}",
                    entry.path,
                    _DELETE_LEFT,
                ) from error
            with catalog.lock:
                current = catalog.index.get(key)
                if current is not None and current.gen == entry.gen:
                    catalog.index.remove(key)
                if deleted is Deleted.FOREIGN:
                    catalog.foreign_files += 1
        return deleted is Deleted.DONE


__all__ = ["ObjectWriter"]
