"""kvplug-serdes: serdes that make the bytes on the wire fewer.

* ``zstd`` and ``lz4`` (lossless): the object's bytes split into byte planes (every element's
  high bytes together, its low bytes together), then each plane compressed; bit-exact for
  every dtype. Each compressor is an extra: ``pip install 'kvplug-serdes[zstd]'``.
* ``fp8`` and ``k16v8`` (lossy, opt-in): FP8 e4m3 with a scale per block of elements, for the
  whole object or for the values only; the error bound is in :mod:`kvplug_serdes.fp8`.

Each is chosen per tier (``redis://host:6379?serde=zstd``, ``serde: zstd`` in a tiers entry);
the serde is recorded in every frame, so a reader configured with another decodes it or
reports a miss, never garbage. See docs/serdes.md.
"""

from __future__ import annotations

from kvplug_serdes.fp8 import FP8Options, FP8Serde, K16V8Serde
from kvplug_serdes.lossless import LZ4Options, LZ4Serde, ShuffleOptions, ZstdOptions, ZstdSerde

__all__ = [
    "FP8Options",
    "FP8Serde",
    "K16V8Serde",
    "LZ4Options",
    "LZ4Serde",
    "ShuffleOptions",
    "ZstdOptions",
    "ZstdSerde",
]
