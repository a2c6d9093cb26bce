"""What opening a disk tier finds in its directories (internal): object files to index,
damaged ones to delete, temporary files of interrupted writes to remove or, when their writer
still runs, to keep counting against ``max_size``."""

# File descriptors and str paths on the I/O path, as in kvplug_disk.backend.
# ruff: noqa: PTH108, PTH119

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass

from kvplug.errors import CorruptObject
from kvplug.keys import CacheKey, InvalidKey
from kvplug.url import BackendURL
from kvplug_disk.directories import Directory, _check_not_shared
from kvplug_disk.fileops import LiveWriters, NotAnObject, open_object, reason, unlink_quietly
from kvplug_disk.index import IndexEntry
from kvplug_disk.layout import (
    BLOCK,
    OBJECT_NAME,
    SUBDIR_NAME,
    TEMP_NAME,
    WRITER_LOCK_NAME,
    ObjectHeader,
    checked_header,
    digest,
)

logger = logging.getLogger("kvplug.disk")

STAT_NAMES = (
    "objects",
    "bytes",
    "corrupt",
    "temp_removed",
    "temp_in_use",
    "stale_locks",
    "duplicates",
    "foreign",
    "unreadable",
    "evicted",
)

TempInUse = Callable[[Directory, str, str, float, LiveWriters], bool]
"""Whether a temporary file (its directory, writer pid, writer id, mtime) must be kept."""
MakeEntry = Callable[[str, Directory, ObjectHeader], IndexEntry]


@dataclass(frozen=True)
class KeptTemp:
    """A temporary file of another live writer, found at open: its bytes count against
    max_size until it is gone."""

    directory: Directory
    pid: str
    writer: str
    size: int


def human(nbytes: int) -> str:
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{nbytes} B"
        size /= 1024
    return f"{nbytes} B"  # pragma: no cover


def load_header(path: str) -> tuple[ObjectHeader, float]:
    """The verified header of an object file and its mtime; CorruptObject when damaged,
    NotAnObject when it is not a regular file."""
    fd = open_object(path)
    try:
        info = os.fstat(fd)
        data = os.pread(fd, BLOCK, 0)
    finally:
        os.close(fd)
    return checked_header(data, info.st_size), info.st_mtime


class DiskScan:
    """One pass over the tier's directories at open: :attr:`found` (the newest file of each
    key), :attr:`kept_temps` (temporary files of live writers) and :attr:`stats`."""

    def __init__(
        self,
        url: BackendURL,
        allow_shared_dir: bool,
        temp_in_use: TempInUse,
        make_entry: MakeEntry,
    ) -> None:
        self.url = url
        self._allow_shared_dir = allow_shared_dir
        self._temp_in_use = temp_in_use
        self._make_entry = make_entry
        self.stats: dict[str, int] = dict.fromkeys(STAT_NAMES, 0)
        self.found: dict[CacheKey, tuple[float, IndexEntry]] = {}
        self.kept_temps: dict[str, KeptTemp] = {}

    def run(self, directories: list[Directory]) -> None:
        """Scan ``directories``: delete damaged object files, temporary files of writers
        that ended and older duplicates; leave foreign files alone."""
        stats, found = self.stats, self.found
        writers = LiveWriters()
        for directory in directories:
            with os.scandir(directory.path) as items:
                for item in items:
                    if TEMP_NAME.fullmatch(item.name):
                        self._clean_temp(directory, item.path, item.name, stats, writers)
                    elif SUBDIR_NAME.fullmatch(item.name) and item.is_dir(follow_symlinks=False):
                        if not self._allow_shared_dir:
                            _check_not_shared(item.path, self.url)
                        directory.subdirs.add(item.name)
                        self._scan_subdir(directory, item.path, found, stats, writers)
                    elif not (
                        WRITER_LOCK_NAME.fullmatch(item.name)
                        and writers.check_lock(directory.path, item.name) is not None
                    ):
                        stats["foreign"] += 1
        stats["stale_locks"] = writers.stale_locks

    def _scan_subdir(
        self,
        directory: Directory,
        path: str,
        found: dict[CacheKey, tuple[float, IndexEntry]],
        stats: dict[str, int],
        writers: LiveWriters,
    ) -> None:
        with os.scandir(path) as items:
            for item in items:
                match = OBJECT_NAME.fullmatch(item.name)
                if TEMP_NAME.fullmatch(item.name):
                    self._clean_temp(directory, item.path, item.name, stats, writers)
                    continue
                if (
                    match is None
                    or not item.is_file(follow_symlinks=False)
                    or match.group(1)[:2] != os.path.basename(path)
                ):
                    # An object's file lives only in the subdirectory named by its stem's
                    # first two digits (the index derives the path from the stem).
                    stats["foreign"] += 1
                    continue
                try:
                    header, mtime = load_header(item.path)
                    if digest(header.key_text) != match.group(1):
                        raise CorruptObject("the key inside does not match the file name.")
                    key = CacheKey.parse(header.key_text)
                except (FileNotFoundError, NotAnObject):  # replaced since it was listed
                    stats["foreign"] += 1
                    continue
                except (CorruptObject, InvalidKey) as error:
                    logger.debug("%s: removing damaged object file %s: %s", self.url, item, error)
                    stats["corrupt"] += 1
                    unlink_quietly(item.path)
                    continue
                except OSError as error:
                    logger.debug("%s: cannot read %s: %s", self.url, item.path, reason(error))
                    stats["unreadable"] += 1
                    continue
                entry = self._make_entry(match.group(1), directory, header)
                previous = found.get(key)
                if previous is not None:
                    # One key in two places (the directory list changed): keep the newer.
                    stats["duplicates"] += 1
                    older, newer = sorted((previous, (mtime, entry)), key=lambda pair: pair[0])
                    unlink_quietly(older[1].path)
                    found[key] = newer
                else:
                    found[key] = (mtime, entry)

    def _clean_temp(
        self,
        directory: Directory,
        path: str,
        name: str,
        stats: dict[str, int],
        writers: LiveWriters,
    ) -> None:
        """Delete the temporary file ``path`` unless its writer is alive; then it is kept and
        counts against max_size until it is gone."""
        match = TEMP_NAME.fullmatch(name)
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            return
        if match is None or not stat.S_ISREG(info.st_mode):
            stats["foreign"] += 1
            return
        pid, writer = match.group(1), match.group(2)
        if self._temp_in_use(directory, pid, writer, info.st_mtime, writers):
            stats["temp_in_use"] += 1  # another backend's write in progress
            self.kept_temps[path] = KeptTemp(directory, pid, writer, info.st_size)
            return
        try:
            os.unlink(path)
            stats["temp_removed"] += 1
        except FileNotFoundError:
            pass
        except OSError:
            stats["unreadable"] += 1


def log_rebuild(url: BackendURL, count: int, stats: dict[str, int]) -> None:
    """Log the one summary line of an index rebuild."""
    parts = [
        f"found {stats['objects']} object(s), {human(stats['bytes'])}, in {count} "
        f"director{'y' if count == 1 else 'ies'}"
    ]
    notes = (
        ("evicted", "evicted {} to fit max_size"),
        ("corrupt", "removed {} damaged object file(s)"),
        ("temp_removed", "removed {} temporary file(s) of interrupted writes"),
        ("stale_locks", "removed {} lock file(s) of writers that ended"),
        ("duplicates", "removed {} older duplicate(s)"),
        ("unreadable", "skipped {} unreadable file(s)"),
        ("foreign", "left {} foreign file(s) alone"),
        ("temp_in_use", "left {} temporary file(s) of running writers alone"),
    )
    parts += [text.format(stats[name]) for name, text in notes if stats[name]]
    damaged = stats["corrupt"] or stats["temp_removed"] or stats["unreadable"]
    logger.log(
        logging.WARNING if damaged else logging.INFO,
        "%s: index rebuilt from disk: %s.",
        url,
        "; ".join(parts),
    )


__all__ = ["DiskScan", "KeptTemp", "human", "load_header", "log_rebuild"]
