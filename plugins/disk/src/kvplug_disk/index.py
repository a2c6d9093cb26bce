"""What the disk engine's index holds about one stored object, and deleting an object file
(internal)."""

# File descriptors and str paths on the I/O path, as in kvplug_disk.backend.
# ruff: noqa: PTH108

from __future__ import annotations

import enum
import os
import stat
from dataclasses import dataclass

import torch

from kvplug.memory import MemoryFormat
from kvplug_disk.directories import Directory
from kvplug_disk.layout import ObjectHeader


@dataclass
class IndexEntry:
    """What the index knows about one stored object; the file is the truth."""

    path: str
    stem: str
    directory: Directory
    size: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    fmt: MemoryFormat
    payload_len: int
    gen: int

    def describes(self, header: ObjectHeader) -> bool:
        frame = header.frame
        return (frame.shape, frame.dtype, frame.fmt, frame.payload_len) == (
            self.shape,
            self.dtype,
            self.fmt,
            self.payload_len,
        )


class _Deleted(enum.Enum):
    """What deleting an object file did."""

    DONE = "deleted"
    ABSENT = "nothing was there"
    FOREIGN = "a directory is there, not an object file; left alone"


def _delete_object_file(path: str) -> _Deleted:
    """Delete the object file ``path``; raises the OSError when the file stays."""
    try:
        os.unlink(path)
        return _Deleted.DONE
    except (FileNotFoundError, NotADirectoryError):
        return _Deleted.ABSENT
    except (IsADirectoryError, PermissionError):
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return _Deleted.ABSENT
        if stat.S_ISDIR(mode):
            return _Deleted.FOREIGN
        raise


__all__ = ["IndexEntry"]
