"""How payload bytes move between memory and object files: the :class:`FileIO` seam.

* :class:`FileIO`: the abstract seam (what an implementation must do).
* :class:`PosixFileIO`: the default, ``file://``'s: ``preadv``/``pwritev`` on host memory,
  O_DIRECT where the directory takes it.
* :class:`~kvplug_disk.fileio.cufile.CuFileIO`: NVIDIA cuFile (GPUDirect Storage), what
  ``gds://`` and ``weka://`` use; needs ``pip install 'kvplug-disk[gds]'``. Imported on first
  use, so ``file://`` never loads cufile-python.

A :class:`~kvplug_disk.backend.DiskBackend` takes one as ``file_io=``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvplug.lazy import lazy_exports
from kvplug_disk.fileio.base import FileIO, Payload
from kvplug_disk.fileio.posix import PosixFileIO

if TYPE_CHECKING:
    from kvplug_disk.fileio.cufile import CuFileError, CuFileIO


__getattr__ = lazy_exports(
    __name__,
    {
        "kvplug_disk.fileio.cufile": ("CuFileIO", "CuFileError"),
    },
)


__all__ = ["CuFileError", "CuFileIO", "FileIO", "Payload", "PosixFileIO"]
