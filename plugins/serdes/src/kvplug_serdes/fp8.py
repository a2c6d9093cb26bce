"""The lossy serdes ``fp8`` and ``k16v8``: KV quantized to FP8 (e4m3) with a scale per block.

Opt-in: a value read back is close to what was stored, not equal to it. ``fp8`` quantizes the
whole object; ``k16v8`` keeps the keys as they are and quantizes the values only (attention is
more sensitive to errors in K, which are multiplied into every score, than in V).

Each run of ``block`` consecutive elements (default 128: one head of a typical head size) gets
the scale ``amax / 448`` (448 is e4m3's largest finite value), so every block uses e4m3's whole
range. The work runs where the object lives: on the GPU for an object in GPU memory (only the
8-bit bytes and the scales cross to the host), on the CPU otherwise.

**Error bound.** For an element ``x`` of a block whose largest magnitude is ``A``, the value
read back ``x'`` satisfies ``|x - x'| <= |x| / 14 + A * 2**-18``: e4m3 keeps 3 mantissa bits
(a relative error of at most 2**-4), its subnormals are spaced ``A / 448 * 2**-9`` apart, and
the cast back to bfloat16 adds at most 2**-8 of ``|x|`` (float16 and float32 less).

What is not quantized is stored as it is, bit-exact: objects that are not floating point
(bytes, integers, FP8 already), and any object holding a NaN or an infinity (a scale would
spread it over the whole block).

``k16v8`` needs to know which part of an object is K: the KV formats say it
(``KV_2LTD``, ``KV_2TD``: K is the first half; ``KV_T2D``: K is ``[:, 0]`` of every token). An
object of another format (an engine's own byte layout, MLA's latent cache, which has no V) is
refused with :class:`~kvplug.errors.NotSupported`, never quantized whole behind the
operator's back.

Payload layout (little-endian)::

    0   version      u8   1
    1   mode         u8   0: stored as it is; 1: all quantized; 2: K kept, V quantized
    2   reserved     u16  zero
    4   block        u32  elements per scale
    8   nbytes       u64  the object's bytes
    16  kept         u64  bytes kept as they are (mode 0: all; mode 2: K's)
    24  count        u64  elements quantized
    32  scales       f32 per block of the quantized elements
    ..  kept bytes
    ..  fp8 e4m3     one byte per quantized element

Example::

    >>> import torch
    >>> from kvplug.memory import MemoryFormat, MemoryObj
    >>> from kvplug.serde import open_serde
    >>> fp8 = open_serde("fp8")
    >>> kv = torch.randn(2, 2, 16, 128).to(torch.bfloat16)
    >>> payload = fp8.encode(MemoryObj.from_tensor(kv, MemoryFormat.KV_2LTD))
    >>> round(len(payload) / (kv.numel() * 2), 2)
    0.52
    >>> out = MemoryObj.from_tensor(torch.empty_like(kv), MemoryFormat.KV_2LTD)
    >>> fp8.decode(memoryview(payload), out)
    >>> bool(((out.tensor.float() - kv.float()).abs() <= kv.float().abs() / 14 + 1e-3).all())
    True
"""

from __future__ import annotations

import logging
import math
import struct
from typing import TYPE_CHECKING, ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field

from kvplug.errors import CorruptObject, NotSupported
from kvplug.memory import MemoryFormat, MemoryObj
from kvplug.serde import Serde

if TYPE_CHECKING:
    from kvplug.keys import CacheKey

log = logging.getLogger(__name__)

VERSION = 1
STORED, QUANTIZED, KEYS_KEPT = 0, 1, 2
_HEADER = struct.Struct("<BBHIQQQ")
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)
QUANTIZABLE = (torch.float16, torch.bfloat16, torch.float32)
"""The dtypes quantized; others are stored as they are."""
HALVES = (MemoryFormat.KV_2LTD, MemoryFormat.KV_2TD)
"""Formats whose first half (along dim 0) is K and second half V."""


class FP8Options(BaseModel):
    """Options of the ``fp8`` and ``k16v8`` serdes (``serde_block`` on a backend)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    block: int = Field(
        default=128, ge=16, le=1 << 20, description="elements that share one scale (smaller: finer)"
    )


def quantize(values: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(scales, codes)`` of the flat floating-point ``values``: float32 scales, one per
    ``block`` elements, and one e4m3 byte per element, both on ``values``' device; None when
    ``values`` hold a NaN or an infinity."""
    count = values.numel()
    blocks = math.ceil(count / block)
    padded = values.float()
    if blocks * block != count:
        padded = torch.nn.functional.pad(padded, (0, blocks * block - count))
    grid = padded.view(blocks, block)
    amax = grid.abs().amax(dim=1)
    if not bool(torch.isfinite(amax).all()):
        return None
    scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    codes = (grid / scales[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return scales, codes.view(-1)[:count].view(torch.uint8)


def dequantize(
    scales: torch.Tensor, codes: torch.Tensor, block: int, dtype: torch.dtype
) -> torch.Tensor:
    """The flat values that :func:`quantize` gave ``(scales, codes)`` for, in ``dtype``."""
    count = codes.numel()
    blocks = scales.numel()
    values = codes.view(FP8).float()
    if blocks * block != count:
        values = torch.nn.functional.pad(values, (0, blocks * block - count))
    return (values.view(blocks, block) * scales[:, None]).view(-1)[:count].to(dtype)


class FP8Serde(Serde):
    """``fp8``: every floating-point element as FP8 e4m3 with a float32 scale per ``block``
    elements (about half the bytes of 16-bit KV). Lossy; see the module's error bound."""

    name = "fp8"
    description = "lossy, opt-in: FP8 e4m3 with a scale per block of elements (block)"
    lossy = True
    Options: ClassVar[type[BaseModel] | None] = FP8Options
    keeps_keys: ClassVar[bool] = False

    def __init__(self, options: FP8Options | None = None) -> None:
        self.options = options or FP8Options()
        self._warned: set[torch.dtype] = set()

    def _split(self, obj: MemoryObj) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The part kept as it is (None: nothing) and the part quantized, both flat."""
        tensor = obj.tensor
        if not self.keeps_keys:
            return None, tensor.reshape(-1)
        halves = kv_halves(tensor, obj.fmt)
        if halves is None:
            raise NotSupported(
                f"serde {self.name!r} keeps the keys at full precision, so it must know which "
                f"part of an object is K; an object of format {obj.fmt.name} with shape "
                f"{tuple(obj.shape)} does not say. Use serde=fp8 (every element at 8 bits) or a "
                "lossless serde for this tier, or hand kvplug KV_2LTD, KV_2TD or KV_T2D objects."
            )
        return halves[0].reshape(-1), halves[1].reshape(-1)

    def encode(self, obj: MemoryObj, key: CacheKey | None = None) -> bytearray:
        if obj.dtype not in QUANTIZABLE or obj.nbytes == 0:
            self._warn_once(obj.dtype)
            return self._stored(obj)
        kept, quantized = self._split(obj)
        found = quantize(quantized, self.options.block)
        if found is None:
            return self._stored(obj)
        scales, codes = found
        mode = QUANTIZED if kept is None else KEYS_KEPT
        kept_bytes = kept.contiguous().view(torch.uint8) if kept is not None else None
        kept_len = kept_bytes.numel() if kept_bytes is not None else 0
        header = _HEADER.pack(
            VERSION, mode, 0, self.options.block, obj.nbytes, kept_len, codes.numel()
        )
        payload = bytearray(len(header) + 4 * scales.numel() + kept_len + codes.numel())
        payload[: len(header)] = header
        # Each part lands in the payload straight from where it was computed (a GPU object's
        # codes cross to the host once, into their place).
        into = torch.frombuffer(payload, dtype=torch.uint8)
        offset = len(header)
        for part in (scales.view(torch.uint8), kept_bytes, codes):
            if part is not None and part.numel():
                into[offset : offset + part.numel()].copy_(part)
                offset += part.numel()
        return payload

    def _stored(self, obj: MemoryObj) -> bytearray:
        header = _HEADER.pack(VERSION, STORED, 0, self.options.block, obj.nbytes, obj.nbytes, 0)
        payload = bytearray(len(header) + obj.nbytes)
        payload[: len(header)] = header
        if obj.nbytes:
            torch.frombuffer(payload, dtype=torch.uint8)[len(header) :].copy_(obj.raw)
        return payload

    def _warn_once(self, dtype: torch.dtype) -> None:
        if dtype in self._warned or dtype in QUANTIZABLE:
            return
        self._warned.add(dtype)
        log.warning(
            "serde %r stores %s objects as they are: only float16, bfloat16 and float32 KV is "
            "quantized. An engine integration that hands over raw bytes gains nothing from it; "
            "use a lossless serde (zstd, lz4) there.",
            self.name,
            dtype,
        )

    def decode(self, payload: memoryview, out: MemoryObj, key: CacheKey | None = None) -> None:
        view = memoryview(payload).cast("B")
        where = f"{self.name} value of {key}" if key is not None else f"{self.name} value"
        if view.nbytes < _HEADER.size:
            raise CorruptObject(f"{where}: {view.nbytes} bytes, shorter than its header.")
        version, mode, _, block, nbytes, kept_len, count = _HEADER.unpack_from(view)
        if version != VERSION:
            raise CorruptObject(
                f"{where}: layout version {version}; this kvplug-serdes reads {VERSION} "
                "(upgrade it on this reader)."
            )
        if nbytes != out.nbytes:
            raise CorruptObject(
                f"{where}: holds {nbytes} bytes, but the frame's shape {tuple(out.shape)} "
                f"{out.dtype} has {out.nbytes}."
            )
        blocks = math.ceil(count / block) if block else -1
        itemsize = out.dtype.itemsize
        expected = _HEADER.size + 4 * blocks + kept_len + count
        if (
            mode not in (STORED, QUANTIZED, KEYS_KEPT)
            or blocks < 0
            or expected != view.nbytes
            or (mode == STORED and (kept_len != nbytes or count))
            or (
                mode != STORED
                and (out.dtype not in QUANTIZABLE or kept_len + count * itemsize != nbytes)
            )
        ):
            raise CorruptObject(
                f"{where}: its lengths (mode {mode}, {kept_len} kept bytes, {count} quantized "
                f"elements in blocks of {block}) do not fit its {view.nbytes} bytes or the "
                f"frame's {out.dtype}."
            )
        offset = _HEADER.size
        if mode == STORED:
            out.raw.copy_(_host_bytes(view[offset:]))
            return
        scales = _host_bytes(view[offset : offset + 4 * blocks]).view(torch.float32)
        offset += 4 * blocks
        kept = _host_bytes(view[offset : offset + kept_len])
        codes = _host_bytes(view[offset + kept_len :])
        device = out.device
        values = dequantize(scales.to(device), codes.to(device), block, out.dtype)
        tensor = out.tensor
        if mode == QUANTIZED:
            tensor.view(-1).copy_(values)
            return
        halves = kv_halves(tensor, out.fmt)
        if halves is None:
            raise CorruptObject(
                f"{where}: keeps K apart, but the frame's format {out.fmt.name} with shape "
                f"{tuple(out.shape)} has no K and V halves."
            )
        keys_out, values_out = halves
        keys_out.copy_(kept.to(device).view(out.dtype).view(keys_out.shape))
        values_out.copy_(values.view(values_out.shape))


def kv_halves(tensor: torch.Tensor, fmt: MemoryFormat) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Views of the K and the V of ``tensor`` laid out as ``fmt``, or None when the format does
    not say which part is K (the encoder and the decoder split alike)."""
    if fmt in HALVES and tensor.dim() >= 1 and tensor.shape[0] == 2:
        return tensor[0], tensor[1]
    if fmt == MemoryFormat.KV_T2D and tensor.dim() >= 2 and tensor.shape[1] == 2:
        return tensor[:, 0], tensor[:, 1]
    return None


def _host_bytes(part: memoryview) -> torch.Tensor:
    """``part`` copied into a new host tensor of bytes (payloads may be read-only)."""
    tensor = torch.empty(part.nbytes, dtype=torch.uint8)
    if part.nbytes:
        MemoryObj.from_tensor(tensor).memoryview()[:] = part
    return tensor


class K16V8Serde(FP8Serde):
    """``k16v8``: keys kept as they are (16 bits), values as FP8 e4m3 with a scale per block
    (about three quarters of the bytes). Lossy for V only; see the module."""

    name = "k16v8"
    description = "lossy, opt-in: keys kept at 16 bits, values FP8 e4m3 with per-block scales"
    keeps_keys = True


__all__ = ["FP8Options", "FP8Serde", "K16V8Serde", "dequantize", "quantize"]
