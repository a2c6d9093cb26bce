"""What the disk engine's index holds about one stored object (internal)."""

from __future__ import annotations

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


__all__ = ["IndexEntry"]
