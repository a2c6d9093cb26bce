"""File-system operations of the disk layout that trust nothing found on disk.

``file://`` and ``gds://`` share them:

* :func:`open_object` opens an object file for reading only when it is a regular file: never
  through a symbolic link, never blocking on a FIFO, never opening a device node. Anything else
  under an object's name raises :class:`NotAnObject`, which the backends turn into a counted
  miss.
* :func:`clear_the_way` moves a foreign directory (or anything in the way of a subdirectory)
  aside, so a put can store its key again.
* :class:`WriterLock` and :class:`LiveWriters` tell a temporary file of a live writer from
  one of a writer that died, by a lock the kernel releases when its holder dies, not by pid.
* :func:`classify_os_error` turns an ``OSError`` of the write or delete path into the kvplug
  error that says what happened, what it means for the tier and what to do.

Example::

    >>> import os, tempfile
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     os.mkfifo(os.path.join(tmp, "x.kv"))
    ...     try:
    ...         open_object(os.path.join(tmp, "x.kv"))
    ...     except NotAnObject as error:
    ...         print(error.kind)
    FIFO
"""

# File descriptors and str paths, as in kvplug_disk.backend.
# ruff: noqa: PTH104, PTH106, PTH108, PTH116, PTH118, PTH119, PTH120

from __future__ import annotations

import enum
import errno
import fcntl
import logging
import mmap
import os
import stat
import threading
import weakref
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, cast

import torch

from kvplug.errors import BackendError, BackendUnavailable, CapacityExceeded
from kvplug_disk.layout import BLOCK, moved_aside_name, writer_lock_name

logger = logging.getLogger("kvplug.disk")

_READ_FLAGS = (
    os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0)
)
_LOCK_FLAGS = os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
_KINDS = (
    (stat.S_ISDIR, "directory"),
    (stat.S_ISLNK, "symbolic link"),
    (stat.S_ISFIFO, "FIFO"),
    (stat.S_ISSOCK, "socket"),
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
)


class WriteRefused(CapacityExceeded):
    """The tier's storage refused to store or delete one object: the directory is read-only,
    not writable by this user, immutable, or something foreign is in the way. The operation
    did not happen; reads and other keys keep working.

    It is a :class:`~kvplug.errors.CapacityExceeded` because a caller handles it the same
    way: this object was not stored (or not deleted), and the tier itself is not failing. A
    :class:`~kvplug.runtime.store.Store` counts a put refused this way as a dropped put and keeps
    serving the tier, instead of skipping it for every key; the backend logs the cause once
    per directory.
    """


class NotAnObject(Exception):
    """What is at an object file's name is not a regular file."""

    def __init__(self, path: str, kind: str) -> None:
        super().__init__(f"{path} is a {kind}, not an object file")
        self.path = path
        self.kind = kind


def kind_of(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, in words: ``directory``, ``FIFO``, ..."""
    for test, kind in _KINDS:
        if test(mode):
            return kind
    return "regular file" if stat.S_ISREG(mode) else "file of an unknown type"


def reason(error: OSError) -> str:
    """``strerror [ENAME]`` of an OSError, for messages."""
    name = errno.errorcode.get(error.errno, str(error.errno)) if error.errno else "?"
    return f"{error.strerror or error} [{name}]"


def open_object_sized(path: str, flags: int = 0) -> tuple[int, int]:
    """A read-only descriptor of the object file ``path`` with ``flags`` (``O_DIRECT``) set
    once it is known to be a regular file, and the file's size.

    Raises :class:`NotAnObject` for anything else there, found by ``lstat`` before the open
    (a device is never opened) and by ``fstat`` after it (it may have been replaced meanwhile;
    the open never follows a symbolic link and never blocks on a FIFO), and
    ``FileNotFoundError`` when nothing is there (also when a parent is not a directory).
    Four system calls, as few as that takes (the size comes from the ``fstat`` that checks the
    type, and ``F_SETFL`` sets every flag it can change at once): each one waits for the GIL on
    return, up to the interpreter's switch interval while an engine thread runs Python.
    """
    try:
        mode = os.lstat(path).st_mode
    except NotADirectoryError:
        raise FileNotFoundError(errno.ENOENT, "a parent is not a directory", path) from None
    if not stat.S_ISREG(mode):
        raise NotAnObject(path, kind_of(mode))
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):  # replaced since lstat
            raise NotAnObject(path, "symbolic link, socket or directory") from None
        if error.errno == errno.ENOTDIR:
            raise FileNotFoundError(errno.ENOENT, "a parent is not a directory", path) from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotAnObject(path, kind_of(info.st_mode))
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)  # O_NONBLOCK off (a FileIO may honour it)
    except BaseException:
        os.close(fd)
        raise
    return fd, info.st_size


def open_object(path: str, flags: int = 0) -> int:
    """:func:`open_object_sized` without the size."""
    return open_object_sized(path, flags)[0]


def move_aside(path: str) -> str:
    """Rename the foreign ``path`` to a name of its own in the same directory (which the
    index rebuild leaves alone) and return that name. Raises the OSError of the rename."""
    moved = os.path.join(os.path.dirname(path), moved_aside_name(os.path.basename(path)))
    os.rename(path, moved)
    return moved


def clear_the_way(path: str) -> str | None:
    """Make room at ``path`` for an object file that a rename will put there: an empty
    directory is removed, a directory with anything in it is moved aside (never deleted: it
    is not kvplug's). Returns where it was moved, or None when it was removed or nothing had
    to move. Raises the OSError when neither works."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(mode):
        return None  # a rename replaces anything but a directory
    try:
        os.rmdir(path)
        return None
    except OSError as error:
        if error.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
    return move_aside(path)


def classify_os_error(
    error: OSError, what: str, where: str, consequence: str
) -> BackendError | BackendUnavailable:
    """The kvplug error for ``error``, raised while ``what`` (``"writing an object file of
    8192 bytes"``) in ``where`` (a directory or file); ``consequence`` says what that left
    (``"Nothing was stored; reads keep working."``).

    * disk full, over quota, file too large: :class:`~kvplug.errors.CapacityExceeded`;
    * read-only filesystem, no permission, not permitted (immutable), busy:
      :class:`WriteRefused` (a ``CapacityExceeded``: the object was not stored, the tier is
      not failing);
    * out of file descriptors or memory: :class:`~kvplug.errors.BackendUnavailable`
      (retryable);
    * an I/O error and anything else: :class:`~kvplug.errors.BackendError`.
    """
    code = error.errno
    fact = f"{what} in {where} failed: {reason(error)}"
    if code == errno.ENOSPC:
        return CapacityExceeded(
            f"{fact}: the disk is full. {consequence} Free space on that disk, lower max_size "
            "below what the disk can hold, or add a directory on another disk."
        )
    if code == errno.EDQUOT:
        return CapacityExceeded(
            f"{fact}: this user is over its disk quota. {consequence} Raise the quota, lower "
            "max_size below it, or add a directory on another disk."
        )
    if code == errno.EFBIG:
        return CapacityExceeded(
            f"{fact}: the file is too large for the filesystem or for this process's file "
            f"size limit (ulimit -f). {consequence} Raise the limit or store smaller chunks."
        )
    if code == errno.EROFS:
        return WriteRefused(
            f"{fact}: the filesystem is mounted read-only (the kernel does that after disk "
            f"errors: check dmesg). {consequence} Remount it read-write (mount -o "
            "remount,rw <mount point>) or point the tier at a writable directory."
        )
    if code == errno.EACCES:
        return WriteRefused(
            f"{fact}: this user (uid {os.geteuid()}) has no write permission there. "
            f"{consequence} Give the user write permission (chown it to the user, chmod "
            "u+rwx), or point the tier at a directory the user owns."
        )
    if code == errno.EPERM:
        return WriteRefused(
            f"{fact}: the operation is not permitted; the file or directory is probably "
            f"immutable or append-only (lsattr -d {where}; chattr -i -a clears that) or a "
            f"security policy forbids it. {consequence} Lift the restriction or point the "
            "tier at another directory."
        )
    if code == errno.EBUSY:
        return WriteRefused(
            f"{fact}: the target is in use (a mount point?). {consequence} Unmount or move "
            "what is mounted there."
        )
    if code in (errno.EMFILE, errno.ENFILE):
        return BackendUnavailable(
            f"{fact}: too many open files (EMFILE: this process's limit, ulimit -n; ENFILE: "
            f"the system's). {consequence} Raise the limit, or lower workers and queue_depth."
        )
    if code == errno.ENOMEM:
        return BackendUnavailable(
            f"{fact}: the kernel is out of memory. {consequence} Free memory on this machine."
        )
    if code == errno.EIO:
        return BackendError(
            f"{fact}: the disk reported an I/O error. {consequence} Check the kernel log "
            "(dmesg) and the disk's health; move the tier to a healthy disk."
        )
    return BackendError(f"{fact}. {consequence} Check the directory and the disk it is on.")


# -- writers: live or dead --------------------------------------------------------------------


class WriterLock:
    """The claim of one writer (a backend instance) on one directory: the lock file
    ``.kvplug-writer.<pid>.<writer>.lock``, held with an exclusive ``flock`` from open to
    close. The kernel drops the lock when the process dies however it dies, so a held lock
    means a live writer, whatever pid it had."""

    def __init__(self, directory: str, writer: str) -> None:
        self.path = os.path.join(directory, writer_lock_name(writer))
        for _ in range(8):
            # Read-only: flock needs no write access, and an idle backend then never keeps its
            # filesystem from being remounted read-only. Readable by all, so that cleaners of
            # other users of a shared directory can tell whether its writer is alive.
            fd = os.open(self.path, _LOCK_FLAGS, 0o644)
            # A cleaner may take and delete a lock file between its creation and our flock:
            # keep it only if the name still leads to the file we locked.
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                now = os.stat(self.path, follow_symlinks=False)
            except FileNotFoundError:
                os.close(fd)
                continue
            opened = os.fstat(fd)
            if (now.st_dev, now.st_ino) == (opened.st_dev, opened.st_ino):
                self._fd = fd
                self._finalizer = weakref.finalize(self, os.close, fd)
                return
            os.close(fd)  # pragma: no cover - the name was reused within our creation
        raise OSError(errno.EAGAIN, "could not hold a writer lock file", self.path)

    def release(self) -> None:
        """Delete the lock file and drop the lock. Idempotent."""
        if not self._finalizer.alive:
            return
        try:
            os.unlink(self.path)
        except OSError as error:
            if not isinstance(error, FileNotFoundError):
                logger.warning("could not remove the lock file %s: %s", self.path, reason(error))
        self._finalizer()


def _lock_is_free(path: str) -> bool | None:
    """Whether the writer lock file ``path`` is not held; when it is free, the file is deleted
    (its writer is gone). None when ``path`` is not a lock file (missing, or a foreign type);
    False (held) when it cannot be looked at: a file is never deleted on a guess."""
    try:
        fd = open_object(path)
    except (FileNotFoundError, NotAnObject):
        return None
    except OSError as error:
        logger.debug("cannot look at the writer lock %s: %s", path, reason(error))
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        except OSError as error:
            logger.debug("cannot test the writer lock %s: %s", path, reason(error))
            return False
        try:
            now = os.stat(path, follow_symlinks=False)
            opened = os.fstat(fd)
            if (now.st_dev, now.st_ino) == (opened.st_dev, opened.st_ino):
                os.unlink(path)
        except OSError:
            pass
        return True
    finally:
        os.close(fd)


class LiveWriters:
    """Answers "is the writer of this temporary file alive?" during one cleanup pass, looking
    at each writer's lock once, and removes the lock files of writers that are gone."""

    def __init__(self) -> None:
        self._alive: dict[str, bool] = {}
        self.stale_locks = 0
        """Lock files of dead writers removed."""

    def alive(self, directory: str, pid: str, writer: str) -> bool:
        """Whether the writer ``writer`` (of pid ``pid`` when it started) holds its lock in
        ``directory``. A writer without a lock file (it died, or an older kvplug that took
        none) is not alive."""
        path = os.path.join(directory, f".kvplug-writer.{pid}.{writer}.lock")
        known = self._alive.get(path)
        if known is None:
            free = _lock_is_free(path)
            known = free is False
            self.stale_locks += free is True
            self._alive[path] = known
        return known

    def check_lock(self, directory: str, name: str) -> bool | None:
        """Look at the lock file ``name`` found in ``directory``: True when its writer is
        alive, False when it was gone (the file was removed), None when it is not a lock
        file."""
        path = os.path.join(directory, name)
        known = self._alive.get(path)
        if known is not None:
            return known
        free = _lock_is_free(path)
        if free is None:
            return None
        self.stale_locks += free
        self._alive[path] = not free
        return not free


# -- reading and writing object files -------------------------------------------------------

O_DIRECT: int = getattr(os, "O_DIRECT", 0)
"""``os.O_DIRECT`` where the platform has it, else 0."""
Access = Callable[[], AbstractContextManager[object]]
"""How one step of file I/O (a system call, a copy, a hash) gets at the memory it moves: each
step runs inside ``access()``. ``contextlib.nullcontext`` for memory of kvplug's own; for a
caller's memory lent to the I/O threads, :meth:`kvplug.lease.Lease.use`, which raises
:class:`kvplug.lease.Revoked` instead once the caller's operation was cancelled."""
_thread_state = threading.local()


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous host uint8 tensor."""
    if tensor.numel() == 0:
        return memoryview(bytearray())
    return memoryview(cast(Any, tensor.numpy())).cast("B")


def _advance(views: list[memoryview], count: int) -> list[memoryview]:
    while count and views:
        first = views[0]
        if count >= first.nbytes:
            count -= first.nbytes
            views = views[1:]
        else:
            views = [first[count:], *views[1:]]
            count = 0
    return views


def write_all(
    fd: int, buffers: Sequence[memoryview], offset: int, access: Access = nullcontext
) -> int:
    """Write every byte of ``buffers`` at ``offset`` (``pwritev`` until done); the count.
    Each system call runs inside ``access()`` (see :data:`Access`)."""
    views = [view for view in buffers if view.nbytes]
    total = 0
    while views:
        with access():
            count = os.pwritev(fd, views, offset + total)
        if count <= 0:
            raise OSError(errno.EIO, "the file system accepted no bytes")
        total += count
        views = _advance(views, count)
    return total


def read_all(
    fd: int, buffers: Sequence[memoryview], offset: int, access: Access = nullcontext
) -> int:
    """Fill ``buffers`` from ``offset`` (``preadv`` until done or end of file); the count.
    Each system call runs inside ``access()`` (see :data:`Access`)."""
    views = [view for view in buffers if view.nbytes]
    total = 0
    while views:
        with access():
            count = os.preadv(fd, views, offset + total)
        if count <= 0:
            break
        total += count
        views = _advance(views, count)
    return total


def header_buffer() -> mmap.mmap:
    """This thread's page-aligned header block buffer (O_DIRECT needs aligned memory)."""
    buffer: mmap.mmap | None = getattr(_thread_state, "header", None)
    if buffer is None:
        buffer = mmap.mmap(-1, BLOCK)
        _thread_state.header = buffer
    return buffer


class Deleted(enum.Enum):
    """What deleting an object file did."""

    DONE = "deleted"
    ABSENT = "nothing was there"
    FOREIGN = "a directory is there, not an object file; left alone"


def delete_object_file(path: str) -> Deleted:
    """Delete the object file ``path``; raises the OSError when the file stays."""
    try:
        os.unlink(path)
        return Deleted.DONE
    except (FileNotFoundError, NotADirectoryError):
        return Deleted.ABSENT
    except (IsADirectoryError, PermissionError):
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return Deleted.ABSENT
        if stat.S_ISDIR(mode):
            return Deleted.FOREIGN
        raise


def unlink_quietly(path: str) -> None:
    """Remove ``path``; a missing file is fine, any other failure is logged."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as error:
        logger.warning("could not remove %s: %s", path, reason(error))


def fsync_dir(path: str) -> None:
    """Make the entries of directory ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = [
    "O_DIRECT",
    "Access",
    "Deleted",
    "LiveWriters",
    "NotAnObject",
    "WriteRefused",
    "WriterLock",
    "byte_view",
    "classify_os_error",
    "clear_the_way",
    "delete_object_file",
    "fsync_dir",
    "header_buffer",
    "kind_of",
    "move_aside",
    "open_object",
    "open_object_sized",
    "read_all",
    "reason",
    "unlink_quietly",
    "write_all",
]
