"""A stand-in for cuFile, for the CPU tests of ``gds://`` and nothing else.

:class:`PosixStandIn` is :class:`kvplug_disk.fileio.PosixFileIO` taking the path cuFile takes
through the :class:`~kvplug_disk.fileio.FileIO` seam: each payload moves on its own, at offset
4096, through :meth:`~kvplug_disk.fileio.FileIO.open`, ``write`` and ``read`` with the header
block by ``pwrite``/``pread``, from memory the seam accepts (never host views), on descriptors
opened without O_NOFOLLOW. So tests on machines without a GPU can check everything the backend
does around the data movement: the file format (the same as ``file://``), the index and its
rebuild, sharding, sharing a directory, torn and damaged files. A test passes it to
:class:`~kvplug_disk.gds.backend.GdsBackend` as ``file_io=PosixStandIn()``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from kvplug_disk.fileio import CuFileError, FileIO, PosixFileIO


class PosixStandIn(PosixFileIO):
    """CPU tests only: moves host memory to and from files as cuFile would be asked to.

    ``calls`` counts reads, writes and registrations, so a test can tell that payloads went
    through the seam.
    """

    name = "posix-stand-in"
    moves_host_views: ClassVar[bool] = False
    refuses_nofollow: ClassVar[bool] = True
    library: ClassVar[str] = "cuFile"
    library_errors: ClassVar[tuple[type[OSError], ...]] = (CuFileError,)
    write_object = FileIO.write_object
    read_object = FileIO.read_object

    def __init__(self) -> None:
        super().__init__()
        self.calls = {"read": 0, "write": 0, "register": 0}

    def _register_region(self, pointer: int, size: int) -> None:
        self.calls["register"] += 1

    def _read(self, handle: Any, base: int, size: int, file_offset: int, offset: int) -> int:
        self.calls["read"] += 1
        return super()._read(handle, base, size, file_offset, offset)

    def _write(self, handle: Any, base: int, size: int, file_offset: int, offset: int) -> int:
        self.calls["write"] += 1
        return super()._write(handle, base, size, file_offset, offset)


__all__ = ["PosixStandIn"]
