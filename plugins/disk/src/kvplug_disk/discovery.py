"""Objects of other writers (internal): several backends (processes, an engine's ranks, hosts
on a shared mount) may use one directory, so a key not in this backend's index is looked for
on disk, and an indexed key's file is checked to be still there, before the backend answers
that it is absent or present."""

# File descriptors and str paths on the I/O path, as in kvplug_disk.backend.
# ruff: noqa: PTH108, PTH116, PTH118

from __future__ import annotations

import logging
import os
import stat
from typing import TYPE_CHECKING

from kvplug.errors import CorruptObject
from kvplug.keys import CacheKey
from kvplug_disk.catalog import Catalog
from kvplug_disk.directories import probe_order
from kvplug_disk.fileops import NotAnObject, header_buffer, kind_of, open_object, read_all
from kvplug_disk.index import IndexEntry
from kvplug_disk.layout import SUFFIX, ObjectHeader, checked_header, digest

if TYPE_CHECKING:
    from kvplug_disk.backend import DiskBackend

logger = logging.getLogger("kvplug.disk")


def _read_header(fd: int) -> ObjectHeader:
    """The verified header block of the open file ``fd``, whose length must match it."""
    size = os.fstat(fd).st_size
    buffer = header_buffer()
    count = read_all(fd, [memoryview(buffer)], 0)
    return checked_header(memoryview(buffer)[:count], size)


class Discovery:
    """Finds the objects other writers put in the directories of ``backend`` since it opened,
    and notices the ones they removed, keeping ``catalog`` up to date."""

    def __init__(self, backend: DiskBackend, catalog: Catalog) -> None:
        self._backend = backend
        self._catalog = catalog

    def known(self, key: CacheKey) -> IndexEntry | None:
        """``key``'s entry: the index's, or one found on disk (then indexed)."""
        with self._catalog.lock:
            entry = self._catalog.index.get(key)
        return entry if entry is not None else self.discover(key)

    def discover(self, key: CacheKey) -> IndexEntry | None:
        """Look for ``key``'s file in every directory (another instance may have written it)
        and add it to the index; None when there is none."""
        backend, catalog = self._backend, self._catalog
        key_text = key.to_string()
        stem = digest(key_text)
        home = backend.scheme.home_directory()
        for directory in probe_order(backend.directories, stem, home):
            path = os.path.join(directory.path, stem[:2], stem + SUFFIX)
            try:
                fd = open_object(path)
            except NotAnObject as error:
                logger.debug("%s: %s; not an object of another instance", backend.url, error)
                continue
            except OSError:
                continue
            try:
                try:
                    header = _read_header(fd)
                    if header.key_text != key_text:
                        raise CorruptObject("the key inside does not match the file name.")
                except CorruptObject as error:
                    self._discard_found(path, fd, error)
                    continue
            finally:
                os.close(fd)
            with catalog.stripe(stem), catalog.lock:
                current = catalog.index.get(key)
                if current is not None:
                    return current
                entry = catalog.new_entry(stem, directory, header)
                catalog.index.put(key, entry, entry.size)
                catalog.discovered += 1
            return entry
        return None

    def _discard_found(self, path: str, fd: int, error: Exception) -> None:
        self._catalog.damaged_values.found(path, error)
        try:
            on_disk = os.stat(path, follow_symlinks=False)
            opened = os.fstat(fd)
            if (on_disk.st_dev, on_disk.st_ino) == (opened.st_dev, opened.st_ino):
                os.unlink(path)  # only the file that was read, never a newer one
        except OSError:
            pass

    def present(self, key: CacheKey) -> bool:
        """Whether ``key``'s file is there (also one another instance wrote after open), on a
        worker thread."""
        self._backend.ensure_open()
        catalog = self._catalog
        with catalog.lock:
            entry = catalog.index.get(key)
        if entry is not None:
            try:
                mode = os.lstat(entry.path).st_mode
            except (FileNotFoundError, NotADirectoryError):
                catalog.forget(key, entry)  # removed or evicted by another instance
                return self.discover(key) is not None
            except OSError:
                return True  # cannot tell: get will
            if stat.S_ISREG(mode):
                return True
            catalog.forget_foreign(key, entry, NotAnObject(entry.path, kind_of(mode)))
        return self.discover(key) is not None

    def may_hold(self, key: CacheKey) -> bool:
        """Whether ``key`` is indexed or has a file (another instance's) in some directory:
        a lookup and a ``stat`` or two, so that removing an absent key (every put through a
        Store of several tiers does, to drop an older value) never waits behind file I/O."""
        with self._catalog.lock:
            if self._catalog.index.get(key) is not None:
                return True
        backend = self._backend
        stem = digest(key.to_string())
        return any(
            os.path.lexists(os.path.join(directory.path, stem[:2], stem + SUFFIX))
            for directory in probe_order(backend.directories, stem, backend.scheme.home_directory())
        )


__all__ = ["Discovery"]
