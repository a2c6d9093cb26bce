"""The disk engine's bookkeeping of what it stores (internal): the index of stored objects, the
locks that guard it, eviction's file deletions, the tier's counters, other writers' temporary
files counted against ``max_size``, and warnings logged once per directory and cause."""

# File descriptors and str paths, as in kvplug_disk.backend.
# ruff: noqa: PTH108

from __future__ import annotations

import itertools
import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from kvplug.damage import DamagedValues
from kvplug.errors import CapacityExceeded
from kvplug.index import EvictableIndex, Reservation
from kvplug.keys import CacheKey
from kvplug.quotas import make_index
from kvplug.url import BackendURL
from kvplug_disk.directories import Directory
from kvplug_disk.fileops import Deleted, LiveWriters, NotAnObject, delete_object_file, reason
from kvplug_disk.index import IndexEntry
from kvplug_disk.layout import ObjectHeader
from kvplug_disk.options import DiskOptions
from kvplug_disk.rebuild import DiskScan, KeptTemp

logger = logging.getLogger("kvplug.disk")

RETRY_UNDELETABLE = 30.0
"""Seconds eviction leaves a file it could not delete alone before it tries again."""
TEMP_RECHECK = 60.0
"""Seconds between looks at temporary files of other live writers (also done whenever a put
needs the room they hold)."""
_STRIPES = 64


class Catalog:
    """What one disk backend knows it stores: :attr:`index` (one
    :class:`~kvplug_disk.index.IndexEntry` per key, with eviction by policy), guarded by
    :attr:`lock`, which is never held across file I/O or an ``await``; the lock stripes that
    serialize writes, removals and evictions of one key; the counters; and the temporary
    files of other live writers (:attr:`kept_temps`), whose bytes count against ``max_size``.

    ``temp_grace``: seconds a temporary file whose writer holds no lock visible here is kept
    all the same (see :attr:`kvplug_disk.scheme.DiskScheme.temp_grace`).
    """

    def __init__(self, url: BackendURL, options: DiskOptions, temp_grace: float) -> None:
        self.url = url
        self.max_size = options.max_size
        self.temp_grace = temp_grace
        self.lock = threading.Lock()
        self.index: EvictableIndex[CacheKey, IndexEntry] = make_index(
            self.max_size, options.eviction, pin_ttl=options.pin_ttl, quotas=options.quotas
        )
        self.kept_temps: dict[str, KeptTemp] = {}
        self.temps_checked_at = 0.0
        self._stripes = [threading.RLock() for _ in range(_STRIPES)]
        self._generations = itertools.count(1)
        self._reported: set[tuple[str, str]] = set()
        self._report_lock = threading.Lock()
        self.evictions = 0
        self.damaged_values = DamagedValues[str](url)
        self.allocation_failures = 0
        self.foreign_files = 0
        self.discovered = 0
        self.eviction_failures = 0

    def stats(self) -> dict[str, int]:
        """A consistent snapshot of the counters (see :meth:`DiskBackend.stats`)."""
        with self.lock:
            return {
                "evictions": self.evictions,
                "corrupt_objects": self.damaged_values.count,
                "allocation_failures": self.allocation_failures,
                "foreign_files": self.foreign_files,
                "discovered": self.discovered,
                "eviction_failures": self.eviction_failures,
                "bytes_held": self.index.bytes_held,
                "temp_bytes": self.index.external_bytes,
                "temp_files": len(self.kept_temps),
                "keys": len(self.index),
                "pinned_keys": self.index.pinned_keys,
                "max_size": self.max_size,
            }

    def tenant_stats(self) -> dict[str, dict[str, int | None]]:
        """Each reported tenant's counters (see :meth:`DiskBackend.tenant_stats`)."""
        if not self.index.tracks_tenants:
            return {}
        with self.lock:
            return self.index.tenant_stats()

    def missed(self, key: CacheKey) -> None:
        """A read of ``key`` found nothing: counted for its tenant (with quotas)."""
        if self.index.tracks_tenants:
            with self.lock:
                self.index.missed(key)

    # -- entries and locks ----------------------------------------------------------------

    def next_generation(self) -> int:
        """A number no other write of this backend had (:attr:`IndexEntry.gen`)."""
        return next(self._generations)

    def new_entry(self, stem: str, directory: Directory, header: ObjectHeader) -> IndexEntry:
        """An entry for the valid object file ``stem`` in ``directory`` with ``header``."""
        frame = header.frame
        return IndexEntry(
            stem,
            directory,
            header.file_length,
            frame.shape,
            frame.dtype,
            frame.fmt,
            frame.payload_len,
            self.next_generation(),
        )

    def stripe(self, stem: str) -> threading.RLock:
        """The lock that serializes writes, removals and evictions of the key ``stem``."""
        return self._stripes[int(stem[-4:], 16) % _STRIPES]

    def first_report(self, where: str, cause: OSError | str) -> bool:
        """True the first time this backend sees ``cause`` (an OSError's errno, or words) in
        ``where`` (callers log at WARNING then and at DEBUG after)."""
        with self._report_lock:
            report = (where, cause if isinstance(cause, str) else str(cause.errno))
            if report in self._reported:
                return False
            self._reported.add(report)
            return True

    # -- keys leaving the index -----------------------------------------------------------

    def forget(self, key: CacheKey, entry: IndexEntry) -> None:
        """The file of ``entry`` is gone (removed outside kvplug): drop it from the index."""
        with self.stripe(entry.stem), self.lock:
            current = self.index.get(key)
            if current is not None and current.gen == entry.gen:
                self.index.remove(key)

    def forget_foreign(self, key: CacheKey, entry: IndexEntry, error: NotAnObject) -> None:
        """A foreign thing is under ``entry``'s name: a counted miss; drop the key from the
        index and leave the thing where it is (a put of the key replaces it)."""
        with self.stripe(entry.stem), self.lock:
            current = self.index.get(key)
            if current is None or current.gen != entry.gen:
                return
            self.index.remove(key)
            self.foreign_files += 1
        first = self.first_report(entry.directory.path, "foreign")
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

    def adopt(self, key: CacheKey, entry: IndexEntry, header: ObjectHeader) -> IndexEntry:
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
        with self.lock:
            current = self.index.get(key)
            if current is not None and current.gen == entry.gen:
                self.index.update(key, adopted, adopted.size)
        return adopted

    # -- eviction -------------------------------------------------------------------------

    def evicted(self, key: CacheKey, entry: IndexEntry) -> bool:
        """The index's eviction callback (:attr:`lock` held): delete the victim's file."""
        stripe = self.stripe(entry.stem)
        # Never wait here (the index lock is held): a key being written is skipped.
        if not stripe.acquire(blocking=False):
            return False
        try:
            deleted = delete_object_file(entry.path)
        except OSError as error:
            self.index.hold_off(key, RETRY_UNDELETABLE)
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
        first = self.first_report(entry.directory.path, error)
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

    def reserve(self, key: CacheKey, length: int, check_open: Callable[[], None]) -> Reservation:
        """Make room for a file of ``length`` bytes (evicting by policy) and reserve it;
        ``check_open`` raises when the backend closed meanwhile."""
        if self.kept_temps and (
            self.index.used + length > self.max_size
            or time.monotonic() - self.temps_checked_at > TEMP_RECHECK
        ):
            self.recheck_temps()
        with self.lock:
            check_open()
            reservation = self.index.reserve(length, self.evicted, replacing=key)
            if reservation is None:
                raise CapacityExceeded(self._full_message(key, length))
            return reservation

    def _full_message(self, key: CacheKey, length: int) -> str:
        """Why an object file of ``length`` bytes for ``key`` does not fit (:attr:`lock` is
        held)."""
        quota = self.index.quota_refusal(key, length)
        if quota is not None:
            return f"cannot store {key} in {self.url}: {quota}"
        stuck = self.index.held_off()
        parts = [
            f"{self.index.bytes_held} of {self.max_size} bytes are held in {len(self.index)} "
            f"objects and {self.index.reserved} more are being written"
        ]
        if self.index.external_bytes:
            parts.append(
                f"{self.index.external_bytes} bytes are temporary files of "
                f"{len(self.kept_temps)} writes of other running processes"
            )
        if stuck:
            parts.append(
                f"{sum(self.index.nbytes(k) for k in stuck)} bytes are in {len(stuck)} files "
                "that could not be deleted (see the warning logged)"
            )
        guaranteed = self.index.guarantee_note(key)
        if guaranteed:
            parts.append(guaranteed)
        return (
            f"cannot make room for an object file of {length} bytes in {self.url}: "
            f"{'; '.join(parts)}; every object that could go is pinned, being written or "
            "cannot be deleted. Unpin keys, raise max_size, or add a directory."
        )

    # -- what opening found on disk, and other writers' temporary files -------------------

    def load(self, scan: DiskScan) -> dict[str, int]:
        """Index what ``scan`` found at open, evict down to ``max_size``; the scan's stats
        with the counts of objects, bytes and evictions."""
        stats = scan.stats
        with self.lock:
            for path, temp in scan.kept_temps.items():
                if path not in self.kept_temps:
                    self.kept_temps[path] = temp
                    self.index.external_bytes += temp.size
            for key, (_, entry) in sorted(scan.found.items(), key=lambda item: item[1][0]):
                self.index.put(key, entry, entry.size)
            stats["objects"] = len(self.index)
            stats["bytes"] = self.index.bytes_held
            while self.index.used > self.max_size and self.index.evict_one(self.evicted):
                stats["evicted"] += 1
            self.damaged_values.tally(stats["corrupt"])
            self.temps_checked_at = time.monotonic()
        return stats

    def temp_in_use(
        self, directory: Directory, pid: str, writer: str, mtime: float, writers: LiveWriters
    ) -> bool:
        """Whether a temporary file of ``writer`` (pid ``pid``) last written at ``mtime``
        must be kept: its writer holds its lock, or it is younger than ``temp_grace``."""
        if self.temp_grace and time.time() - mtime < self.temp_grace:
            return True
        return writers.alive(directory.path, pid, writer)

    def recheck_temps(self) -> None:
        """Look at the other writers' temporary files found at open again: forget those that
        are gone, delete those whose writer has died since."""
        with self.lock:
            kept = list(self.kept_temps.items())
            self.temps_checked_at = time.monotonic()
        writers = LiveWriters()
        for path, temp in kept:
            try:
                info = os.lstat(path)
                if stat.S_ISREG(info.st_mode) and self.temp_in_use(
                    temp.directory, temp.pid, temp.writer, info.st_mtime, writers
                ):
                    continue
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as error:
                logger.debug("%s: cannot remove %s: %s", self.url, path, reason(error))
                continue
            with self.lock:
                if self.kept_temps.pop(path, None) is not None:
                    self.index.external_bytes -= temp.size

    def clear(self) -> None:
        """Forget everything (the backend closed; the files stay)."""
        with self.lock:
            self.index.clear()
            self.kept_temps.clear()


__all__ = ["RETRY_UNDELETABLE", "TEMP_RECHECK", "Catalog"]
