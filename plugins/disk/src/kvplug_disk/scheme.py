"""What a URL scheme of the disk engine declares besides its options and capabilities:
:class:`DiskScheme`, the seam ``gds://`` and ``weka://`` plug into.

One engine, :class:`~kvplug_disk.backend.DiskBackend`, serves ``file://``, ``gds://`` and
``weka://``: the file layout, the index, eviction, pins, crash safety and error handling are
the same code for all three. What differs goes through two explicit seams, never through
overridden internals of the engine:

* how payload bytes move: a :class:`~kvplug_disk.fileio.FileIO`, the I/O library's side
  (``PosixFileIO``, ``CuFileIO``), with the facts the engine plans by (which memory it takes,
  whether it refuses ``O_NOFOLLOW`` descriptors, which of its errors say nothing about a
  file);
* everything else a scheme adds: its :class:`DiskScheme`, named by the backend class as
  ``Scheme`` (as it names ``Options``). The engine makes one per backend,
  ``Scheme(backend)``, once the options are parsed, and asks it only what this class
  declares. A FileIO passed as ``file_io=`` replaces the library and nothing else, so the
  CPU tests of ``gds://`` run its scheme around a POSIX stand-in for cuFile.

This class is ``file://``'s scheme and the defaults of every other
(:class:`kvplug_disk.gds.scheme.GdsScheme`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from kvplug.memory import MemoryObj
from kvplug_disk.directories import Directory
from kvplug_disk.fileio.base import FileIO
from kvplug_disk.fileio.posix import PosixFileIO
from kvplug_disk.payloads import BouncePool

if TYPE_CHECKING:
    from kvplug_disk.backend import DiskBackend


class DiskScheme:
    """``file://``: payloads staged, when they must be, in an unpinned aligned bounce pool;
    objects sharded by key hash; nothing more to check at open than the directories."""

    medium: ClassVar[str] = "disk"
    """What error messages call the tier's storage."""
    temp_grace: ClassVar[float] = 0.0
    """Seconds a temporary file whose writer holds no lock visible here is still kept (0:
    none; on a shared mount the writer may run on another host)."""
    reads_into_callers_memory: ClassVar[bool] = True
    """Whether ``get_into`` reads straight into the caller's object; False: into the tier's
    own memory, then one copy (the default of :meth:`kvplug.backend.Backend._get_into`)."""

    def __init__(self, backend: DiskBackend) -> None:
        self.bounce = BouncePool()
        """Where payloads outside aligned memory are staged (made on first use)."""

    @property
    def checksums_device_memory(self) -> bool:
        """Whether payloads in device memory are checksummed too (copied to the host)."""
        return False

    def home_directory(self) -> int | None:
        """Every object this backend writes goes to directory ``home % count`` (reads look
        everywhere); None: each to the directory its key hashes to."""
        return None

    def default_file_io(self) -> FileIO | None:
        """The FileIO of a backend given none, made with the backend; None: made by
        :meth:`open_file_io` when the backend opens."""
        return PosixFileIO()

    def open_file_io(self, io: FileIO | None) -> FileIO:
        """Called whenever the backend opens its directories, before it does (from the
        threads opening it, so an implementation guards what it does once): check what the
        scheme needs of the machine and return the FileIO payloads move through. ``io`` is
        the backend's so far (given as ``file_io=``, or :meth:`default_file_io`'s)."""
        return io if io is not None else PosixFileIO()

    def directories_opened(self, directories: Sequence[Directory]) -> None:
        """Called at open once the directories exist, are locked and had O_DIRECT probed,
        before the index is rebuilt from their files: check what the scheme needs of them
        (raise to refuse the open). Default: nothing."""

    def staging_block(self, length: int) -> MemoryObj | None:
        """``length`` bytes of 4096-aligned memory the FileIO takes, for a payload whose own
        memory it cannot use; None when there is none to spare (then buffered I/O, or, for a
        FileIO that takes no host views, a one-off copy)."""
        return self.bounce.block(length)

    def using_block(self, obj: MemoryObj) -> None:
        """``obj``'s allocator block is about to be moved as it is. Default: nothing."""

    def closed(self, io: FileIO | None, busy: bool) -> None:
        """Called once the backend closed (``busy``: file I/O is still running past the
        close deadline) with its FileIO, if it had one. Default: nothing."""


__all__ = ["DiskScheme"]
