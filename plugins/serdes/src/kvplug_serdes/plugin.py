"""Entry point of kvplug-serdes: the lossless ``zstd`` and ``lz4`` serdes and the lossy
``fp8`` and ``k16v8``."""

from __future__ import annotations

from kvplug.hookspecs import hookimpl
from kvplug.serde import Serde


@hookimpl
def kvplug_serdes() -> list[type[Serde]]:
    from kvplug_serdes.fp8 import FP8Serde, K16V8Serde
    from kvplug_serdes.lossless import LZ4Serde, ZstdSerde

    return [ZstdSerde, LZ4Serde, FP8Serde, K16V8Serde]
