"""What the disk engine's index holds about one stored object (internal).

The index holds one :class:`IndexEntry` per stored key, so its size is the tier's memory per
key: the entry has slots and no ``__dict__``, derives the file's path from its directory and
stem instead of storing a second string, and shares one shape tuple and one int object for
each length among all entries alike (:func:`shared_shape`, :func:`shared_length`): a KV cache
stores chunks of a handful of shapes and sizes.
"""

# ruff: noqa: PTH118

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kvplug.memory import MemoryFormat
from kvplug_disk.directories import Directory
from kvplug_disk.layout import SUFFIX, ObjectHeader

MAX_SHARED = 4096
"""Distinct shapes, and distinct lengths, that :func:`shared_shape` and
:func:`shared_length` keep; values past that are stored as they come."""

_shapes: dict[tuple[int, ...], tuple[int, ...]] = {}
_lengths: dict[int, int] = {}


def shared_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """One tuple for every equal ``shape`` (a KV cache has a handful), so that each entry
    holds a pointer to it rather than its own copy."""
    shared = _shapes.get(shape)
    if shared is not None:
        return shared
    plain = tuple(int(n) for n in shape)  # never keep a torch.Size or numpy ints alive
    if len(_shapes) >= MAX_SHARED:
        return plain
    return _shapes.setdefault(plain, plain)


def shared_length(length: int) -> int:
    """One int object for every equal ``length`` (ints past 256 are objects of their own)."""
    shared = _lengths.get(length)
    if shared is not None:
        return shared
    if len(_lengths) >= MAX_SHARED:
        return length
    return _lengths.setdefault(length, length)


def object_path(directory: str, stem: str) -> str:
    """The path of the object file named ``stem`` in the tier directory ``directory``."""
    return os.path.join(directory, stem[:2], stem + SUFFIX)


@dataclass(slots=True)
class IndexEntry:
    """What the index knows about one stored object; the file is the truth."""

    stem: str
    """The file name without its suffix: the xxh3-128 of the key's string form, in hex."""
    directory: Directory
    size: int
    """Bytes of the file (header block and padding included)."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    fmt: MemoryFormat
    payload_len: int
    gen: int
    """Which write of the key this describes: different for every put, kept when the entry
    is replaced to describe the same file anew."""

    def __post_init__(self) -> None:
        self.shape = shared_shape(self.shape)
        self.size = shared_length(self.size)
        self.payload_len = shared_length(self.payload_len)

    @property
    def path(self) -> str:
        """The object file's path (derived: storing it would cost a string per key)."""
        return object_path(self.directory.path, self.stem)

    def describes(self, header: ObjectHeader) -> bool:
        """Whether ``header`` is the header of the object this entry describes."""
        frame = header.frame
        return (frame.shape, frame.dtype, frame.fmt, frame.payload_len) == (
            self.shape,
            self.dtype,
            self.fmt,
            self.payload_len,
        )


__all__ = ["MAX_SHARED", "IndexEntry", "object_path", "shared_length", "shared_shape"]
