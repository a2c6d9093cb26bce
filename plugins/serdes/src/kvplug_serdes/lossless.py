"""The lossless serdes ``zstd`` and ``lz4``: the object's bytes split into byte planes, then
each plane compressed on its own.

KV cache is 16-bit floating point: the high byte of every element (sign, exponent, the top of
the mantissa) repeats a few values, the low byte is close to noise. Compressed as they lie the
two interleave and neither compresses; grouped (the byte shuffle: every element's first byte,
then every second byte) the high plane shrinks and the low plane is kept as it is when
compressing does not make it smaller, so no time goes into inflating noise.

Payload layout (little-endian)::

    0   version      u8   1
    1   width        u8   bytes per element the planes split by (1: not shuffled)
    2   stored       u8   bit i: plane i is kept as it is (it did not compress)
    3   reserved     u8   zero
    4   reserved     u32  zero
    8   nbytes       u64  the object's bytes
    16  lengths      u64 per plane: its length in the payload
    ..  planes            back to back

The width is the object's element size unless the ``element_bytes`` option says otherwise
(an engine that hands over its KV as raw bytes: ``serde_element_bytes=2`` for 16-bit KV); it is
recorded, so a reader decodes whatever the writer chose.

Example::

    >>> import torch
    >>> from kvplug.memory import MemoryObj
    >>> from kvplug.serde import open_serde
    >>> zstd = open_serde("zstd")
    >>> kv = torch.randn(4096, dtype=torch.float32).to(torch.bfloat16)
    >>> payload = zstd.encode(MemoryObj.from_tensor(kv))
    >>> len(payload) < kv.numel() * 2
    True
    >>> out = MemoryObj.from_tensor(torch.empty_like(kv))
    >>> zstd.decode(memoryview(payload), out)
    >>> torch.equal(out.tensor.view(torch.int16), kv.view(torch.int16))
    True
"""

from __future__ import annotations

import abc
import importlib.util
import struct
import threading
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvplug.errors import CorruptObject
from kvplug.memory import MemoryObj
from kvplug.serde import FIRST_PARTY_SERDES, Serde

if TYPE_CHECKING:
    from kvplug.keys import CacheKey

VERSION = 1
_HEADER = struct.Struct("<BBBBIQ")
_LENGTH = struct.Struct("<Q")
WIDTHS = (1, 2, 4, 8)
"""The element sizes the planes may be split by."""
LZ4_MAX_INPUT = 0x7E000000
"""The largest block lz4 compresses (LZ4_MAX_INPUT_SIZE); a larger plane is kept as it is."""


class ShuffleOptions(BaseModel):
    """The option every shuffling serde takes (``serde_element_bytes`` on a backend)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    element_bytes: Literal["auto"] | int = Field(
        default="auto",
        description="bytes per element the planes split by: auto (the object's dtype), or 1, 2, "
        "4, 8 for an engine that hands over its KV as raw bytes",
    )

    @field_validator("element_bytes", mode="before")
    @classmethod
    def _width(cls, value: object) -> object:
        text = str(value).strip().lower()
        if text == "auto":
            return "auto"
        if text.isdigit() and int(text) in WIDTHS:
            return int(text)
        raise ValueError(f"must be auto or one of {', '.join(map(str, WIDTHS))}")


class ShufflingCompressor(Serde, abc.ABC):
    """A lossless serde that byte-shuffles the object, then compresses each plane with
    :meth:`compress` (see the module's payload layout). A subclass names its package in
    :attr:`module` and implements the two calls."""

    module: ClassVar[str]
    """The module the compressor imports (what :meth:`unavailable` looks for); its
    distribution on the package index has the same name."""

    def __init__(self, options: ShuffleOptions | None = None) -> None:
        self.options = options or ShuffleOptions()
        self._local = threading.local()

    @classmethod
    def unavailable(cls) -> str | None:
        if importlib.util.find_spec(cls.module) is not None:
            return None
        return (
            f"it needs the {cls.module} package, which is not installed. Install it with: "
            f"pip install {FIRST_PARTY_SERDES.get(cls.name, cls.module)}"
        )

    def codec(self) -> Any:
        """This thread's compressor state (codec objects are not safe to share between
        threads)."""
        codec = getattr(self._local, "codec", None)
        if codec is None:
            codec = self._local.codec = self.new_codec()
        return codec

    def new_codec(self) -> Any:
        """Fresh per-thread state for :meth:`compress` and :meth:`decompress`."""
        return None

    @abc.abstractmethod
    def compress(self, plane: memoryview) -> bytes | None:
        """``plane`` compressed, or None when it cannot be (too large for the codec)."""

    @abc.abstractmethod
    def decompress(self, packed: memoryview, size: int) -> bytes | bytearray:
        """``packed`` decompressed: exactly ``size`` bytes, or raises what the codec raises."""

    def width_of(self, obj: MemoryObj) -> int:
        chosen = self.options.element_bytes
        width = obj.dtype.itemsize if chosen == "auto" else chosen
        return width if width in WIDTHS and obj.nbytes % width == 0 else 1

    def encode(self, obj: MemoryObj, key: CacheKey | None = None) -> bytes:
        width = self.width_of(obj)
        planes = split_planes(obj.raw.view(-1), width)
        stored = 0
        parts: list[bytes | memoryview] = []
        for index in range(width):
            plane = memoryview(planes[index])
            packed = None if looks_incompressible(self, plane) else self.compress(plane)
            if packed is None or len(packed) >= plane.nbytes:
                stored |= 1 << index
                parts.append(plane)
            else:
                parts.append(packed)
        header = _HEADER.pack(VERSION, width, stored, 0, 0, obj.nbytes)
        lengths = b"".join(_LENGTH.pack(memoryview(part).nbytes) for part in parts)
        return b"".join([header, lengths, *parts])

    def decode(self, payload: memoryview, out: MemoryObj, key: CacheKey | None = None) -> None:
        view = memoryview(payload).cast("B")
        where = f"{self.name} value of {key}" if key is not None else f"{self.name} value"
        if view.nbytes < _HEADER.size:
            raise CorruptObject(f"{where}: {view.nbytes} bytes, shorter than its header.")
        version, width, stored, _, _, nbytes = _HEADER.unpack_from(view)
        if version != VERSION:
            raise CorruptObject(
                f"{where}: layout version {version}; this kvplug-serdes reads {VERSION} "
                "(upgrade it on this reader)."
            )
        if width not in WIDTHS or nbytes != out.nbytes or nbytes % width:
            raise CorruptObject(
                f"{where}: {nbytes} bytes in planes of {width}, but the frame's shape "
                f"{tuple(out.shape)} {out.dtype} has {out.nbytes} bytes."
            )
        offset = _HEADER.size + width * _LENGTH.size
        if view.nbytes < offset:
            raise CorruptObject(f"{where}: {view.nbytes} bytes, shorter than its plane lengths.")
        lengths = [
            _LENGTH.unpack_from(view, _HEADER.size + i * _LENGTH.size)[0] for i in range(width)
        ]
        if offset + sum(lengths) != view.nbytes:
            raise CorruptObject(
                f"{where}: its plane lengths do not add up to its {view.nbytes} bytes."
            )
        plane_len = nbytes // width
        planes = np.empty((width, plane_len), dtype=np.uint8)
        for index, length in enumerate(lengths):
            part = view[offset : offset + length]
            offset += length
            if stored >> index & 1:
                plain: bytes | bytearray | memoryview = part
            else:
                try:
                    plain = self.decompress(part, plane_len)
                except Exception as error:
                    raise CorruptObject(
                        f"{where}: plane {index} does not decompress ({error})."
                    ) from None
            if len(plain) != plane_len:
                raise CorruptObject(
                    f"{where}: plane {index} holds {len(plain)} bytes, not {plane_len}."
                )
            memoryview(planes[index])[:] = plain
        join_planes(planes, out.raw.view(-1))


SAMPLE_BYTES = 64 << 10
"""The sample of a large plane compressed first: a plane whose sample does not shrink is noise
(the low bytes of 16-bit KV) and is kept as it is without compressing the rest of it."""


def looks_incompressible(compressor: ShufflingCompressor, plane: memoryview) -> bool:
    """Whether a sample from the middle of a plane of at least 16 samples fails to shrink by
    2%: compressing the whole plane would cost its time and save nothing."""
    if plane.nbytes < 16 * SAMPLE_BYTES:
        return False
    start = (plane.nbytes - SAMPLE_BYTES) // 2
    packed = compressor.compress(plane[start : start + SAMPLE_BYTES])
    return packed is None or len(packed) > 0.98 * SAMPLE_BYTES


_WORDS: dict[int, type[np.unsignedinteger[Any]]] = {
    1: np.uint8,
    2: np.uint16,
    4: np.uint32,
    8: np.uint64,
}


def split_planes(raw: torch.Tensor, width: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """The byte planes of the flat bytes ``raw``: row i holds byte i of every ``width``-byte
    element, on the host. On the CPU by shifts of whole words (numpy: an order of magnitude
    faster here than a strided transpose), on the GPU by a transpose there."""
    if raw.device.type != "cpu":
        return raw.view(-1, width).t().contiguous().cpu().numpy()
    words = raw.numpy().view(_WORDS[width])
    planes = np.empty((width, words.size), dtype=np.uint8)
    for index in range(width):
        # The cast to uint8 keeps the low byte: what the shift brought down is the plane.
        np.right_shift(words, 8 * index, out=planes[index], casting="unsafe")
    return planes


def join_planes(planes: np.ndarray[Any, np.dtype[np.uint8]], raw: torch.Tensor) -> None:
    """Write the bytes whose planes are ``planes`` into the flat bytes ``raw`` (any device)."""
    width = planes.shape[0]
    if raw.device.type != "cpu":
        raw.view(-1, width).copy_(torch.from_numpy(planes).to(raw.device).t())
        return
    words = raw.numpy().view(_WORDS[width])
    np.copyto(words, planes[0], casting="unsafe")
    if width == 1:
        return
    shifted = np.empty_like(words)
    for index in range(1, width):
        np.left_shift(planes[index], 8 * index, out=shifted, dtype=words.dtype)
        np.bitwise_or(words, shifted, out=words)


class ZstdOptions(ShuffleOptions):
    """Options of the ``zstd`` serde (given as ``serde_<name>`` on a backend)."""

    level: int = Field(
        default=1, ge=-7, le=22, description="zstd level: negative is faster, 22 smallest"
    )
    threads: int = Field(
        default=0,
        ge=0,
        le=64,
        description="zstd's worker threads for one plane (0: compress inline)",
    )


class ZstdSerde(ShufflingCompressor):
    """``zstd``: byte-shuffled planes, each a zstd frame (the ``zstandard`` package).

    Options: ``level`` (default 1: the fastest that still finds the exponent bytes' repeats;
    higher levels cost time for little on KV), ``threads`` (zstd's own workers for one plane,
    default 0) and ``element_bytes``."""

    name = "zstd"
    description = (
        "lossless: byte-shuffled planes compressed with zstd (level, threads, element_bytes)"
    )
    Options: ClassVar[type[BaseModel] | None] = ZstdOptions
    module = "zstandard"

    options: ZstdOptions

    def __init__(self, options: ZstdOptions | None = None) -> None:
        super().__init__(options or ZstdOptions())

    def new_codec(self) -> Any:
        import zstandard

        return (
            zstandard.ZstdCompressor(level=self.options.level, threads=self.options.threads),
            zstandard.ZstdDecompressor(),
        )

    def compress(self, plane: memoryview) -> bytes:
        compressed: bytes = self.codec()[0].compress(plane)
        return compressed

    def decompress(self, packed: memoryview, size: int) -> bytes:
        import zstandard

        claimed = zstandard.frame_content_size(packed)
        if claimed != size:
            raise ValueError(f"the frame says {claimed} bytes")
        plain: bytes = self.codec()[1].decompress(packed, max_output_size=size)
        return plain


class LZ4Options(ShuffleOptions):
    """Options of the ``lz4`` serde (given as ``serde_<name>`` on a backend)."""

    acceleration: int = Field(
        default=1, ge=1, le=65537, description="lz4's acceleration: higher is faster and larger"
    )


class LZ4Serde(ShufflingCompressor):
    """``lz4``: byte-shuffled planes, each an lz4 block (the ``lz4`` package).

    Options: ``acceleration`` (default 1; higher trades ratio for speed) and
    ``element_bytes``."""

    name = "lz4"
    description = "lossless: byte-shuffled planes compressed with lz4 (acceleration, element_bytes)"
    Options: ClassVar[type[BaseModel] | None] = LZ4Options
    module = "lz4"

    options: LZ4Options

    def __init__(self, options: LZ4Options | None = None) -> None:
        super().__init__(options or LZ4Options())

    def compress(self, plane: memoryview) -> bytes | None:
        import lz4.block

        if plane.nbytes > LZ4_MAX_INPUT:
            return None
        compressed: bytes = lz4.block.compress(
            plane, mode="fast", acceleration=self.options.acceleration, store_size=False
        )
        return compressed

    def decompress(self, packed: memoryview, size: int) -> bytes:
        import lz4.block

        plain: bytes = lz4.block.decompress(packed, uncompressed_size=size)
        return plain


__all__ = [
    "LZ4Options",
    "LZ4Serde",
    "ShuffleOptions",
    "ShufflingCompressor",
    "ZstdOptions",
    "ZstdSerde",
]
