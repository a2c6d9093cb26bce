"""Parsing and printing of human-written sizes such as ``512MiB``, ``5GiB`` or ``1.5 GB``, and
what the machine has.

A size is a whole number of bytes: an int, or one number (digits, optionally one ``.`` and more
digits) followed by an optional unit. ``KiB``/``MiB``/``GiB``/... are powers of two,
``KB``/``MB``/``GB``/... (and ``K``/``M``/``G``) powers of ten, case-insensitive. Anything else
(``5,5GiB``, ``5.GiB``, ``1.5.5GiB``, ``1.5B``, ``-1``, ``1e9``) is refused, never guessed at.

    >>> parse_size("1.5 GiB"), parse_size("0.5KiB"), parse_size(4096)
    (1610612736, 512, 4096)
    >>> parse_size("5,5GiB", what="max_size")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    kvplug.units.InvalidSize: max_size must be a whole size ..., got '5,5GiB': '5,5' is not...
"""

from __future__ import annotations

import math
import re
from decimal import Decimal
from typing import NamedTuple

import psutil
from pydantic import ByteSize

from kvplug.errors import ConfigError

GiB = 1 << 30
MAX_SIZE = (1 << 63) - 1
"""Larger sizes fit no machine's address space (and no C ``ssize_t``)."""

_UNITS = {name: int(factor) for name, factor in ByteSize.byte_sizes.items() if "bit" not in name}
_SIZE = re.compile(r"\s*(?P<number>[^\sA-Za-z]*)\s*(?P<unit>[A-Za-z]*)\s*")
_NUMBER = re.compile(r"\d+(\.\d+)?")


class InvalidSize(ConfigError):
    """A value that is not a whole size; :attr:`reason` says why, for callers that word the
    rest of the message themselves."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def _refuse(value: object, what: str, reason: str) -> InvalidSize:
    return InvalidSize(
        f"{what} must be a whole size such as 4096, '512MiB' or '5GiB', got {value!r}: {reason}.",
        reason,
    )


def parse_size(value: object, *, what: str = "size") -> int:
    """Bytes from an int, or a string with a unit (see the module documentation). Raises
    :class:`InvalidSize` naming ``what`` for anything that is not a whole size."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise _refuse(value, what, f"a {type(value).__name__} is not a size")
    if isinstance(value, float):
        if value == math.inf:
            raise _refuse(value, what, "it is larger than any machine can address (8 EiB)")
        if not value.is_integer():
            raise _refuse(value, what, "it is not a whole number of bytes")
        value = int(value)
    if isinstance(value, int):
        size = value
    else:
        match = _SIZE.fullmatch(value)
        if match is None:
            raise _refuse(value, what, "write one number and one unit")
        number, unit = match["number"], match["unit"]
        if not _NUMBER.fullmatch(number):
            raise _refuse(
                value,
                what,
                f"{number!r} is not a number (use '.' for a fraction, no thousands separators)",
            )
        factor = _UNITS.get(unit.lower() or "b")
        if factor is None:
            raise _refuse(value, what, f"{unit!r} is not a unit; use B, KiB, MiB, GiB or TiB")
        exact = Decimal(number) * factor
        if exact != exact.to_integral_value():
            raise _refuse(value, what, "it is not a whole number of bytes")
        size = int(exact)
    if size < 0:
        raise _refuse(value, what, "it is negative")
    if size > MAX_SIZE:
        raise _refuse(value, what, "it is larger than any machine can address (8 EiB)")
    return size


def parse_gib(value: object, *, what: str) -> int:
    """Bytes from a number of GiB as LMCache writes it (``max_local_cpu_size: 5.0``)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return parse_size(value, what=what)
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"{what} must be a finite, non-negative number of GiB, got {value!r}.")
    return parse_size(int(value * GiB), what=what)


def format_size(nbytes: int) -> str:
    """``5.0GiB``: a size for people to read."""
    return str(ByteSize(nbytes).human_readable())


class HostMemory(NamedTuple):
    """This machine's memory, in bytes."""

    total: int
    available: int
    """What new allocations can get without swapping (Linux ``MemAvailable``)."""

    def __str__(self) -> str:
        return f"{format_size(self.total)} in total, {format_size(self.available)} available now"


def host_memory() -> HostMemory:
    """This machine's memory now."""
    memory = psutil.virtual_memory()
    return HostMemory(int(memory.total), int(memory.available))


__all__ = [
    "MAX_SIZE",
    "GiB",
    "HostMemory",
    "InvalidSize",
    "format_size",
    "host_memory",
    "parse_gib",
    "parse_size",
]
