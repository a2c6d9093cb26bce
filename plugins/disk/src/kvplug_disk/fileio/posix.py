"""The default :class:`~kvplug_disk.fileio.FileIO` of ``file://``: POSIX ``preadv``/``pwritev``
on host memory, with O_DIRECT when the engine opened the file that way."""

from __future__ import annotations

import ctypes
import errno
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import torch

from kvplug_disk.fileio.base import FileIO, Payload
from kvplug_disk.fileops import read_all, write_all
from kvplug_disk.layout import BLOCK


class PosixFileIO(FileIO):
    """Host memory to and from files with vectored ``preadv``/``pwritev`` loops.

    :meth:`write_object` writes the header block and the payload in one sequential write from
    the start of the file (no hole for the file system to fill later), and :meth:`read_object`
    reads them in one call. It takes the payload as host memory views
    (:attr:`Payload.buffers`), so without O_DIRECT any host memory moves as it is; with O_DIRECT
    the engine hands it block-aligned memory (the object's own allocator block, or its aligned
    bounce pool). Registration is not needed and does nothing.
    """

    name = "posix"
    moves_host_views: ClassVar[bool] = True

    def accepts(self, buffer: torch.Tensor) -> bool:
        return buffer.device.type == "cpu"

    def open(self, fd: int) -> Any:
        return fd

    def close(self, handle: Any) -> None:
        pass

    @staticmethod
    def _view(base: int, size: int, offset: int) -> memoryview:
        return memoryview((ctypes.c_ubyte * size).from_address(base + offset)).cast("B")

    def _read(self, handle: Any, base: int, size: int, file_offset: int, offset: int) -> int:
        return read_all(handle, [self._view(base, size, offset)], file_offset)

    def _write(self, handle: Any, base: int, size: int, file_offset: int, offset: int) -> int:
        return write_all(handle, [self._view(base, size, offset)], file_offset)

    def write_object(self, fd: int, payload: Payload, header: Callable[[], memoryview]) -> None:
        written = write_all(fd, [header(), *payload.buffers], 0, payload.access)
        if written != BLOCK + payload.length:
            raise OSError(
                errno.EIO, f"wrote {written} of {BLOCK + payload.length} bytes of the object"
            )

    def read_object(
        self,
        fd: int,
        header: memoryview,
        payload: Payload,
        handle: Callable[[], AbstractContextManager[Any]] | None = None,
    ) -> int:
        return read_all(fd, [header, *payload.buffers], 0, payload.access)


__all__ = ["PosixFileIO"]
