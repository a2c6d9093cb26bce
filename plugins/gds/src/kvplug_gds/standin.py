"""A POSIX stand-in for cuFile, for the CPU tests of ``gds://`` and nothing else.

:class:`PosixStandIn` implements :class:`kvplug_gds.fileio.FileIO` with ``pread``/``pwrite``
on host memory, so tests on machines without a GPU can check everything the backend does
around the data movement: the file format (the same as ``file://``), the index and its
rebuild, sharding, sharing a directory, torn and damaged files. It accepts host buffers only
and is never chosen by a URL or an option: a test passes it to
:class:`~kvplug_gds.backend.GdsBackend` as ``file_io=PosixStandIn()``.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import torch

from kvplug_gds.fileio import FileIO


class PosixStandIn(FileIO):
    """CPU tests only: moves host memory to and from files with ``os.preadv``/``os.pwritev``.

    ``calls`` counts reads and writes, so a test can tell that payloads went through the seam.
    """

    name = "posix-stand-in"

    def __init__(self) -> None:
        super().__init__()
        self.calls = {"read": 0, "write": 0, "register": 0}

    def accepts(self, buffer: torch.Tensor) -> bool:
        return buffer.device.type == "cpu"

    def open(self, fd: int) -> Any:
        return fd

    def close(self, handle: Any) -> None:
        pass

    def _register_region(self, pointer: int, size: int) -> None:
        self.calls["register"] += 1

    @staticmethod
    def _view(base: int, size: int, offset: int) -> memoryview:
        return memoryview((ctypes.c_ubyte * size).from_address(base + offset)).cast("B")

    def _read(self, handle: Any, base: int, size: int, file_offset: int, offset: int) -> int:
        self.calls["read"] += 1
        view, total = self._view(base, size, offset), 0
        while total < size:
            count = os.preadv(handle, [view[total:]], file_offset + total)
            if count <= 0:
                break
            total += count
        return total

    def _write(self, handle: Any, base: int, size: int, file_offset: int, offset: int) -> int:
        self.calls["write"] += 1
        view, total = self._view(base, size, offset), 0
        while total < size:
            count = os.pwritev(handle, [view[total:]], file_offset + total)
            if count <= 0:
                raise OSError(5, "the file system accepted no bytes")
            total += count
        return total


__all__ = ["PosixStandIn"]
