"""Parsing of human-written sizes such as ``512MiB``, ``5GiB`` or ``1.5 GB``."""

from __future__ import annotations

import math

from pydantic import ByteSize, TypeAdapter, ValidationError

from kvplug.errors import ConfigError

_BYTE_SIZE = TypeAdapter(ByteSize)
GiB = 1 << 30


def parse_size(value: object, *, what: str = "size") -> int:
    """Bytes from an int, or a string with a unit (``KiB``/``MiB``/``GiB`` are powers of two,
    ``KB``/``MB``/``GB`` powers of ten). Raises :class:`ConfigError` for anything else."""
    if isinstance(value, bool):
        raise ConfigError(f"{what} must be a size such as 4096, '512MiB' or '5GiB', got {value!r}.")
    try:
        size = int(_BYTE_SIZE.validate_python(value))
    except ValidationError:
        raise ConfigError(
            f"{what} must be a size such as 4096, '512MiB' or '5GiB', got {value!r}."
        ) from None
    if size < 0:
        raise ConfigError(f"{what} must not be negative, got {value!r}.")
    return size


def parse_gib(value: object, *, what: str) -> int:
    """Bytes from a number of GiB as LMCache writes it (``max_local_cpu_size: 5.0``)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return parse_size(value, what=what)
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"{what} must be a finite, non-negative number of GiB, got {value!r}.")
    return int(value * GiB)
