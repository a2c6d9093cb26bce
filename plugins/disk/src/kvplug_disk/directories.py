"""The tier's directories (internal): which ones, their security, their O_DIRECT support.

O_DIRECT is probed in each directory at open (:func:`open_directory`): an aligned block
written and read back. EINVAL (or EOPNOTSUPP) means the filesystem refuses it, for good. Any
other failure (a full disk, a quota, an I/O error, too many open files) means the probe could
not run: the directory is read and written buffered and probed again by puts, at most every
:data:`O_DIRECT_RETRY` seconds, until a probe succeeds.
"""

# File descriptors and str paths on the I/O path, as in kvplug_disk.backend.
# ruff: noqa: PTH103, PTH116, PTH117, PTH118

from __future__ import annotations

import enum
import errno
import logging
import mmap
import os
import stat
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvplug.errors import ConfigError, InvalidBackendURL
from kvplug.url import BackendURL
from kvplug_disk.fileops import O_DIRECT, WriterLock, classify_os_error, reason, unlink_quietly
from kvplug_disk.layout import BLOCK, probe_name
from kvplug_disk.options import DiskOptions

logger = logging.getLogger("kvplug.disk")

OPEN_FLAGS = os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
"""Flags of every object file the engine opens (never through a symbolic link)."""


O_DIRECT_RETRY = 10.0
"""Seconds between two O_DIRECT probes of a directory whose probe could not run (a full disk,
say): the first put into it after that long probes again."""

_REFUSALS = frozenset({errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP})
"""Errors of an aligned O_DIRECT open, write or read that say the filesystem refuses it."""


class DirectIO(enum.Enum):
    """How the files of a directory move, and why (:attr:`Directory.direct_io`)."""

    ON = "O_DIRECT"
    OFF = "buffered, o_direct=false"
    REFUSED = "buffered: the filesystem refuses O_DIRECT"
    RETRYING = "buffered for now: the O_DIRECT probe could not run; retried on puts"


@dataclass(eq=False)
class Claim:
    """The free disk space one write in flight needs: its file's ``length``, less what the
    disk has allocated to the file so far (``fd``, while it is open)."""

    length: int
    fd: int = -1
    whole: bool = False

    def unallocated(self) -> int:
        """Bytes of the claim the disk has not given the file yet (the disk's free space
        still counts them)."""
        if self.whole:
            return 0
        if self.fd < 0:
            return self.length
        try:
            allocated = os.fstat(self.fd).st_blocks * 512
        except OSError:
            return self.length
        return max(0, self.length - allocated)


@dataclass(frozen=True)
class ProbeFailure:
    """Why the O_DIRECT probe of a directory failed; its text is the reason."""

    step: str
    """What failed, or what went wrong when no error was raised."""
    error: OSError | None
    refused: bool
    """True: the filesystem refuses O_DIRECT, for good. False: the probe could not run now (a
    full disk, a quota, an I/O error, too many open files, ...), which says nothing about
    O_DIRECT."""

    def __str__(self) -> str:
        return self.step if self.error is None else f"{self.step} failed: {reason(self.error)}"


@dataclass
class Directory:
    """One directory of the tier and how its files move (made by :func:`open_directory`).

    :attr:`o_direct` turns from False to True while the tier is open when a probe that could
    not run at open succeeds later (see :meth:`o_direct_for_write`), and never back. Each
    operation reads it once and plans, opens and moves its file that one way: the bytes of a
    file do not depend on how it was written, so files written either way read either way.
    """

    path: str
    o_direct: bool
    """Whether files here are read and written with O_DIRECT now."""
    o_direct_problem: str | None
    """Why O_DIRECT is not used here (``None`` when it is)."""
    direct_io: DirectIO = DirectIO.ON
    """The state behind :attr:`o_direct`."""
    url: str = field(default="", repr=False)
    """The tier's URL, for messages."""
    writer: str = field(default="", repr=False)
    """The backend instance's writer id, which names its probe files."""
    subdirs: set[str] = field(default_factory=set, repr=False)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    probed_at: float = field(default=0.0, repr=False)
    """``time.monotonic()`` of the last O_DIRECT probe."""
    claims: list[Claim] = field(default_factory=list, repr=False)
    """The claims of this backend's writes in flight here."""
    _probing: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _room: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def claim(self, length: int, free_space: Callable[[], int]) -> Claim | tuple[int, int]:
        """Claim ``length`` bytes of the disk's free space (``free_space()``, in bytes) for
        a write starting here: the :class:`Claim` (give it back with :meth:`unclaim`), or,
        when too little is left, the free bytes and the part of them that other writes in
        flight here still need. What a write in flight has already allocated is gone from
        the free space, so only the rest of its claim counts against it."""
        with self._room:
            pending = sum(claim.unallocated() for claim in self.claims)
            free = free_space()  # after ``pending``: space allocated between counts once
            if free - pending < length:
                return free, pending
            claim = Claim(length)
            self.claims.append(claim)
            return claim

    def writing(self, claim: Claim, fd: int) -> None:
        """The write of ``claim`` fills the file open as ``fd`` (until :meth:`written`)."""
        with self._room:
            claim.fd = fd

    def written(self, claim: Claim, *, whole: bool) -> None:
        """The write of ``claim`` is about to close its file: ``whole`` when all of it was
        written (nothing more to allocate), else it failed (the file is being deleted)."""
        with self._room:
            claim.fd = -1
            claim.whole = whole

    def unclaim(self, claim: Claim) -> None:
        """The write of ``claim`` ended."""
        with self._room:
            self.claims.remove(claim)

    def describe(self) -> str:
        """The directory and how its files move, for ``kvplug check``."""
        if self.direct_io in (DirectIO.ON, DirectIO.OFF):
            return f"{self.path} ({self.direct_io.value})"
        return f"{self.path} ({self.direct_io.value}: {self.o_direct_problem})"

    def o_direct_for_write(self) -> bool:
        """Whether a write into this directory uses O_DIRECT. While the probe could not run
        (:attr:`DirectIO.RETRYING`), it first probes again once :data:`O_DIRECT_RETRY`
        seconds have passed since the last probe; one thread probes, the others write
        buffered meanwhile."""
        if self._probe_due() and self._probing.acquire(blocking=False):
            try:
                if self._probe_due():  # not probed by another thread meanwhile
                    self.settle(_probe_o_direct(self.path, self.writer), first=False)
            finally:
                self._probing.release()
        return self.o_direct

    def _probe_due(self) -> bool:
        return (
            self.direct_io is DirectIO.RETRYING
            and time.monotonic() - self.probed_at >= O_DIRECT_RETRY
        )

    def settle(self, failure: ProbeFailure | None, *, first: bool) -> None:
        """Take the outcome of an O_DIRECT probe (``failure``, None when it worked), the
        ``first`` at open or a later one, and log what changed."""
        self.probed_at = time.monotonic()
        if failure is None:
            self.o_direct_problem = None
            self.direct_io = DirectIO.ON
            self.o_direct = True  # last: who sees it sees the state that goes with it
            if not first:
                logger.info(
                    "%s: the O_DIRECT probe in %s succeeded; files there are read and written "
                    "with O_DIRECT from now on (files written before read the same).",
                    self.url,
                    self.path,
                )
            return
        self.o_direct_problem = str(failure)
        if failure.refused:
            self.direct_io = DirectIO.REFUSED
            logger.warning(
                "%s: the filesystem of %s refuses O_DIRECT (%s); files there are read and "
                "written through the page cache (buffered I/O). Put the cache on a local disk "
                "filesystem that supports direct I/O (ext4, xfs), or set o_direct=false to "
                "silence this.",
                self.url,
                self.path,
                failure,
            )
        elif first:  # the state stays RETRYING: puts probe again
            logger.warning("%s", self._cannot_probe(failure))
        else:
            logger.debug("%s: O_DIRECT probe in %s failed again: %s", self.url, self.path, failure)

    def _cannot_probe(self, failure: ProbeFailure) -> str:
        consequence = (
            "That says nothing about O_DIRECT support: files there are read and written "
            "through the page cache (buffered I/O) until a probe succeeds; a put into the "
            f"directory probes again, at most every {O_DIRECT_RETRY:g} s, and O_DIRECT is "
            "used from then on."
        )
        what = f"{self.url}: the O_DIRECT probe ({failure.step})"
        if failure.error is not None:
            return str(classify_os_error(failure.error, what, self.path, consequence))
        return (
            f"{what} in {self.path} went wrong, which a full disk can cause. {consequence} "
            "Check the free space of that disk."
        )


def open_directory(url: BackendURL, path: str, writer: str, o_direct: bool) -> Directory:
    """The prepared directory ``path`` of the tier of ``url``, its O_DIRECT support probed
    with a file of the backend ``writer`` when ``o_direct``; one warning when O_DIRECT cannot
    be used there, or not yet."""
    if not o_direct:
        return Directory(path, False, "o_direct=false", DirectIO.OFF, str(url), writer)
    directory = Directory(path, False, "not probed yet", DirectIO.RETRYING, str(url), writer)
    directory.settle(_probe_o_direct(path, writer), first=True)
    return directory


def open_directories(
    url: BackendURL,
    paths: Sequence[str],
    writer: str,
    options: DiskOptions,
    locks: list[WriterLock],
) -> list[Directory]:
    """The tier's directories ``paths``, each prepared (made, checked), locked for the backend
    ``writer`` (each lock appended to ``locks``: the caller releases them, also when this
    raises) and opened (:func:`open_directory`); two names of one directory count once."""
    directories: list[Directory] = []
    seen: set[tuple[int, int]] = set()
    for path in paths:
        _prepare_directory(path, url, options.allow_shared_dir)
        info = os.stat(path)
        if (info.st_dev, info.st_ino) in seen:
            continue  # two names of one directory
        seen.add((info.st_dev, info.st_ino))
        try:
            locks.append(WriterLock(path, writer))
        except OSError as error:
            raise ConfigError(
                f"{url}: cannot create this backend's lock file in {path}: "
                f"{reason(error)}. The cache directory must be writable by this user; fix its "
                "permissions or choose another directory."
            ) from None
        directories.append(open_directory(url, path, writer, options.o_direct))
    return directories


def shard_of(directories: Sequence[Directory], stem: str, home: int | None) -> Directory:
    """The directory the object file ``stem`` is written to: by the stem's hash, or, when
    the scheme names a ``home`` (``gds://``'s ``shard=by_gpu``), directory ``home % count``."""
    if home is not None:
        return directories[home % len(directories)]
    return directories[int(stem[2:10], 16) % len(directories)]


def probe_order(directories: Sequence[Directory], stem: str, home: int | None) -> list[Directory]:
    """Where to look for the object file ``stem``: its shard first, then the others."""
    first = shard_of(directories, stem, home)
    return [first, *(d for d in directories if d is not first)]


def _directory_paths(url: BackendURL, extra: Sequence[str]) -> tuple[str, ...]:
    raw = (url.path.split(",") if url.path else []) + list(extra)
    if not raw:
        raise InvalidBackendURL(
            f"{url} names no directory. Write an absolute path after three slashes, "
            f"{url.scheme}:///var/cache/kvplug, several separated by commas, "
            f"{url.scheme}:///nvme0/kv,/nvme1/kv, or give the option paths."
        )
    paths: list[str] = []
    for path in raw:
        if not path or not os.path.isabs(path):
            raise InvalidBackendURL(
                f"{url}: directory {path!r} is not an absolute path. Write absolute paths, "
                f"separated by commas: {url.scheme}:///nvme0/kv,/nvme1/kv"
            )
        normal = os.path.normpath(path)
        if normal not in paths:
            paths.append(normal)
    return tuple(paths)


def _check_not_shared(path: str, url: BackendURL) -> None:
    """Refuse a directory that another user owns or can write to."""
    info = os.stat(path)
    problems = []
    uid = os.geteuid()
    if info.st_uid != uid:
        problems.append(f"it is owned by uid {info.st_uid}, not by this process's uid {uid}")
    writers = [
        who
        for bit, who in ((stat.S_IWGRP, "its group"), (stat.S_IWOTH, "every user"))
        if info.st_mode & bit
    ]
    if writers:
        problems.append(
            f"{' and '.join(writers)} can write to it (mode {stat.S_IMODE(info.st_mode):o})"
        )
    if problems:
        raise ConfigError(
            f"{url}: refusing the cache directory {path}: {'; '.join(problems)}, so another "
            "user could plant, change or delete cached KV data there. Run `chmod 700 "
            f"{path}` (and chown it to this user), use a directory of your own, or pass "
            "allow_shared_dir=true if sharing it is intended."
        )


def _prepare_directory(path: str, url: BackendURL, allow_shared: bool) -> None:
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except FileExistsError:
        raise ConfigError(
            f"{url}: {path} exists and is not a directory. Name a directory for the cache."
        ) from None
    except OSError as error:
        raise ConfigError(
            f"{url}: cannot create the cache directory {path}: {reason(error)}. Create it "
            "(mode 700) or choose a directory this user can write to."
        ) from None
    if not allow_shared:
        _check_not_shared(path, url)
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{url}: the cache directory {path} is not writable by this user. Fix its "
            "permissions or choose another directory."
        )


def _probe_failed(step: str, error: OSError) -> ProbeFailure:
    return ProbeFailure(step, error, error.errno in _REFUSALS)


def _probe_o_direct(path: str, writer: str) -> ProbeFailure | None:
    """None when an aligned block can be written and read back with O_DIRECT in ``path``,
    else why not: the filesystem refuses O_DIRECT (EINVAL), or the probe could not run."""
    if not O_DIRECT:
        return ProbeFailure("this platform has no O_DIRECT", None, refused=True)
    name = os.path.join(path, probe_name(writer))
    try:
        block, back = mmap.mmap(-1, BLOCK), mmap.mmap(-1, BLOCK)
    except OSError as error:  # out of memory: the probe could not run
        return _probe_failed("mapping two aligned blocks of memory", error)
    block[:] = (b"kvplug O_DIRECT probe " * (BLOCK // 16))[:BLOCK]
    try:
        try:
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | O_DIRECT | OPEN_FLAGS, 0o600)
        except OSError as error:
            unlink_quietly(name)
            return _probe_failed("opening a file with O_DIRECT", error)
        try:
            try:
                written = os.pwritev(fd, [block], 0)
            except OSError as error:
                return _probe_failed(f"an aligned {BLOCK}-byte O_DIRECT write", error)
            if written != BLOCK:
                return ProbeFailure(
                    f"an aligned O_DIRECT write took {written} of {BLOCK} bytes", None, False
                )
            try:
                read = os.preadv(fd, [back], 0)
            except OSError as error:
                return _probe_failed(f"an aligned {BLOCK}-byte O_DIRECT read", error)
            if read != BLOCK or back[:] != block[:]:
                return ProbeFailure(
                    "an aligned O_DIRECT read did not return the block just written", None, True
                )
        finally:
            os.close(fd)
            unlink_quietly(name)
    finally:
        block.close()
        back.close()
    return None


__all__ = [
    "OPEN_FLAGS",
    "O_DIRECT_RETRY",
    "DirectIO",
    "Directory",
    "ProbeFailure",
    "open_directories",
    "open_directory",
    "probe_order",
    "shard_of",
]
