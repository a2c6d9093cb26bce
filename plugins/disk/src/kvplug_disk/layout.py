"""The on-disk layout of ``file://``: one file per object, named by a digest of its key.

A directory of the tier holds up to 256 subdirectories named by two hex digits; each holds
object files ``<digest>.kv``, where ``<digest>`` is the 32-hex-digit xxh3-128 of the key's
string form. No part of a file name comes from key contents, so no key can reach outside the
directory (contract clause 12). The subdirectory is the digest's first two digits.

An object file (all integers little-endian)::

    offset 0      header block, BLOCK (4096) bytes:
      0             kvplug frame header (kvplug.frame.encode_header), H bytes: magic, version,
                    format, dtype, shape, serde ("naive"), payload length, xxh3-64 checksum of
                    the payload, and its own xxh32 header checksum
      H             b"KVPD", u16 layout version (1), u16 flags, u32 key length L
      H + 12        the key's string form (CacheKey.to_string), UTF-8, L bytes
      H + 12 + L    zero padding
      4088          u64 xxh3-64 of bytes 0..4088 of the block (everything above)
    offset 4096   payload: payload-length bytes, zero-padded to a multiple of BLOCK

Flags: bit 0, :data:`FLAG_NO_PAYLOAD_CHECKSUM`, says the frame header's payload checksum was
not computed (it is zero): the writer held the payload in GPU memory (``gds://``), where an
xxh3 over host bytes would cost a copy to the host. Readers then check the header block and
the exact payload length but not the payload bytes. ``file://`` never sets it; unknown flag bits
make the block unreadable, so an older reader never misreads a newer file.

Every file length is a multiple of BLOCK and the payload starts on a block boundary, so a
file is written and read with O_DIRECT straight from and into 4096-aligned allocator memory.

Files are written under a temporary name in the same subdirectory,
``.<digest>.<pid>.<writer>.<8 hex>.tmp``, and renamed into place, so a reader (or a process
started after a crash) never sees a half-written object under an object name. ``<writer>``
(16 hex digits) names the backend instance that writes; it holds an exclusive ``flock`` on
``<dir>/.kvplug-writer.<pid>.<writer>.lock`` from its open to its close, so a later open can
tell a temporary file of a live writer (its lock is held) from one of a writer that died (the
kernel released the lock): pids say nothing, since they are reused (in a container every
engine start is pid 1). Names with a single 16-hex part after the pid come from older
versions, which took no lock.

Example::

    >>> import torch
    >>> from kvplug.frame import encode_header
    >>> from kvplug.memory import MemoryFormat
    >>> payload = bytes(100)
    >>> frame = encode_header((100,), torch.uint8, MemoryFormat.BINARY_BUFFER, "naive", payload)
    >>> block = encode_block(frame, "llama@1@0@2a@half")
    >>> header = decode_block(block)
    >>> header.key_text, header.frame.payload_len, header.file_length
    ('llama@1@0@2a@half', 100, 8192)
    >>> object_name(header.key_text)[0] == digest(header.key_text)[:2]
    True
"""

from __future__ import annotations

import os
import re
import secrets
import struct
from dataclasses import dataclass

import torch
import xxhash

from kvplug.errors import CorruptObject
from kvplug.frame import MAX_NDIM, FrameHeader, decode_header, encode_header
from kvplug.memory import MemoryFormat

BLOCK = 4096
"""File alignment: header block size, payload offset and the unit of every file length."""
MAGIC = b"KVPD"
LAYOUT_VERSION = 1
SERDE = "naive"
"""Payloads are the object's bytes as they are: no transform, so reads go straight to memory."""
SUFFIX = ".kv"
FLAG_NO_PAYLOAD_CHECKSUM = 1
"""Header flag: the payload checksum was not computed (payload written from GPU memory)."""
_KNOWN_FLAGS = FLAG_NO_PAYLOAD_CHECKSUM

_KEY_RECORD = struct.Struct("<4sHHI")
_BLOCK_CHECKSUM = struct.Struct("<Q")
CHECKSUM_AT = BLOCK - _BLOCK_CHECKSUM.size

_LARGEST_FRAME_HEADER = len(
    encode_header((1,) * MAX_NDIM, torch.uint8, MemoryFormat.BINARY_BUFFER, SERDE, b"")
)
MAX_KEY_BYTES = CHECKSUM_AT - _LARGEST_FRAME_HEADER - _KEY_RECORD.size
"""The longest key string form (UTF-8 bytes) that fits in the header block with any shape."""

OBJECT_NAME = re.compile(r"([0-9a-f]{32})\.kv")
SUBDIR_NAME = re.compile(r"[0-9a-f]{2}")
TEMP_NAME = re.compile(
    r"\.(?:[0-9a-f]{32}|kvplug-probe)\.([0-9]+)\.([0-9a-f]{16})(?:\.[0-9a-f]{8})?\.tmp"
)
"""Temporary files (object writes, O_DIRECT probes, gds read links); group 1 is the writer's
pid, group 2 its writer id."""
WRITER_LOCK_NAME = re.compile(r"\.kvplug-writer\.([0-9]+)\.([0-9a-f]{16})\.lock")
"""Lock files of writers, in each top-level directory; group 1 is the pid, group 2 the writer
id."""
MOVED_ASIDE = ".moved-aside-"
"""Infix of the names that foreign things in the way of an object or subdirectory get."""


def digest(key_text: str) -> str:
    """The 32-hex-digit xxh3-128 of a key's string form: the object's file name stem."""
    return str(xxhash.xxh3_128_hexdigest(key_text.encode("utf-8")))


def object_name(key_text: str) -> tuple[str, str]:
    """``(subdirectory, file name)`` of the object stored under ``key_text``."""
    stem = digest(key_text)
    return stem[:2], stem + SUFFIX


def new_writer_id() -> str:
    """A fresh writer id: 16 hex digits naming one backend instance's files."""
    return secrets.token_hex(8)


def writer_lock_name(writer: str) -> str:
    """The name of the lock file ``writer`` of this process holds in each directory."""
    return f".kvplug-writer.{os.getpid()}.{writer}.lock"


def temp_name(stem: str, writer: str) -> str:
    """A fresh temporary file name for a write of the object ``stem`` by ``writer`` of this
    process."""
    return f".{stem}.{os.getpid()}.{writer}.{secrets.token_hex(4)}.tmp"


def probe_name(writer: str) -> str:
    """A fresh name for an O_DIRECT or cuFile probe file of ``writer`` of this process."""
    return f".kvplug-probe.{os.getpid()}.{writer}.{secrets.token_hex(4)}.tmp"


def moved_aside_name(name: str) -> str:
    """A fresh name for a foreign ``name`` moved out of the way; it matches no pattern of the
    layout, so the index rebuild counts it as foreign and leaves it alone."""
    return f"{name}{MOVED_ASIDE}{secrets.token_hex(4)}"


def padded(nbytes: int) -> int:
    """``nbytes`` rounded up to a whole number of blocks."""
    return -(-nbytes // BLOCK) * BLOCK


def file_length(payload_len: int) -> int:
    """The length of the file holding a payload of ``payload_len`` bytes."""
    return BLOCK + padded(payload_len)


@dataclass(frozen=True)
class ObjectHeader:
    """What a verified header block says: the frame header and the key it was stored under."""

    frame: FrameHeader
    key_text: str
    flags: int = 0

    @property
    def file_length(self) -> int:
        return file_length(self.frame.payload_len)

    @property
    def payload_checksummed(self) -> bool:
        """Whether the frame header's payload checksum is real (see the module docstring)."""
        return not self.flags & FLAG_NO_PAYLOAD_CHECKSUM


def encode_block(frame_header: bytes, key_text: str, flags: int = 0) -> bytes:
    """The BLOCK-byte header block for ``frame_header`` (from
    :func:`kvplug.frame.encode_header`), the key string ``key_text`` and ``flags``."""
    if flags & ~_KNOWN_FLAGS:
        raise ValueError(f"unknown header flags {flags:#x}")
    key_bytes = key_text.encode("utf-8")
    end = len(frame_header) + _KEY_RECORD.size + len(key_bytes)
    if end > CHECKSUM_AT:
        raise ValueError(
            f"key of {len(key_bytes)} bytes does not fit in a header block; the limit is "
            f"{MAX_KEY_BYTES} bytes."
        )
    block = bytearray(BLOCK)
    block[: len(frame_header)] = frame_header
    _KEY_RECORD.pack_into(block, len(frame_header), MAGIC, LAYOUT_VERSION, flags, len(key_bytes))
    start = len(frame_header) + _KEY_RECORD.size
    block[start:end] = key_bytes
    _BLOCK_CHECKSUM.pack_into(block, CHECKSUM_AT, xxhash.xxh3_64_intdigest(block[:CHECKSUM_AT]))
    return bytes(block)


def decode_block(data: bytes | bytearray | memoryview) -> ObjectHeader:
    """Verify a header block completely (block checksum, frame header and its checksum, layout
    magic, version and flags, key length, UTF-8 key, zero padding, serde) and return what it says.

    Raises :class:`~kvplug.errors.CorruptObject` naming the first problem found.
    """
    view = memoryview(data).cast("B")
    if view.nbytes < BLOCK:
        raise CorruptObject(f"header block truncated: {view.nbytes} of {BLOCK} bytes.")
    view = view[:BLOCK]
    (stored,) = _BLOCK_CHECKSUM.unpack_from(view, CHECKSUM_AT)
    if xxhash.xxh3_64_intdigest(view[:CHECKSUM_AT]) != stored:
        raise CorruptObject("header block checksum mismatch: the header was altered or torn.")
    frame = decode_header(view[:CHECKSUM_AT])
    if frame.serde != SERDE:
        raise CorruptObject(
            f"object stored with serde {frame.serde!r}; this layout uses {SERDE!r}."
        )
    magic, version, flags, key_len = _KEY_RECORD.unpack_from(view, frame.header_len)
    if magic != MAGIC or version != LAYOUT_VERSION or flags & ~_KNOWN_FLAGS:
        raise CorruptObject(
            f"not a kvplug disk object: key record {bytes(magic)!r} version {version} flags "
            f"{flags:#x}, expected {MAGIC!r} version {LAYOUT_VERSION} with known flags."
        )
    start = frame.header_len + _KEY_RECORD.size
    end = start + key_len
    if end > CHECKSUM_AT:
        raise CorruptObject(f"key length {key_len} runs past the header block.")
    if bytes(view[end:CHECKSUM_AT]).lstrip(b"\x00"):
        raise CorruptObject("header block padding is not zero.")
    try:
        key_text = bytes(view[start:end]).decode("utf-8")
    except UnicodeDecodeError:
        raise CorruptObject("the key in the header block is not UTF-8.") from None
    return ObjectHeader(frame, key_text, flags)


def checked_header(block: bytes | bytearray | memoryview, file_size: int) -> ObjectHeader:
    """The verified header ``block`` of a file of ``file_size`` bytes, which must be the
    length the header gives; CorruptObject when damaged, truncated or torn."""
    header = decode_block(block)
    if file_size != header.file_length:
        raise CorruptObject(
            f"file is {file_size} bytes, its header says {header.file_length} (truncated or torn)."
        )
    return header


__all__ = [
    "BLOCK",
    "FLAG_NO_PAYLOAD_CHECKSUM",
    "MAX_KEY_BYTES",
    "MOVED_ASIDE",
    "OBJECT_NAME",
    "SUBDIR_NAME",
    "SUFFIX",
    "TEMP_NAME",
    "WRITER_LOCK_NAME",
    "ObjectHeader",
    "checked_header",
    "decode_block",
    "digest",
    "encode_block",
    "file_length",
    "moved_aside_name",
    "new_writer_id",
    "object_name",
    "padded",
    "probe_name",
    "temp_name",
    "writer_lock_name",
]
