"""Options of ``gds://`` and ``weka://``: :class:`GdsOptions` and :class:`WekaOptions`, those
of ``file://`` and the ones below. See :mod:`kvplug_disk.gds.backend` for what each does."""

from __future__ import annotations

import re

from pydantic import Field, field_validator

from kvplug.errors import ConfigError
from kvplug.units import GiB, parse_size
from kvplug_disk.layout import BLOCK
from kvplug_disk.options import DiskOptions

DEFAULT_BUFFER_SIZE = 1 * GiB
_DEVICE = re.compile(r"cuda(?::([0-9]+))?")


def device_index(text: str) -> int | None:
    """The GPU index of a ``device`` option (``cuda:N``); None for ``cuda`` (the current
    device, resolved at open)."""
    match = _DEVICE.fullmatch(text)
    return int(match.group(1)) if match and match.group(1) is not None else None


class GdsOptions(DiskOptions):
    """Options of ``gds://`` (and ``weka://``): those of ``file://`` and the ones below."""

    shard: str = Field("hash", description="spread over directories by 'hash' or 'by_gpu'")
    device: str = Field("cuda", description="GPU of the tier's buffer: 'cuda' or 'cuda:N'")
    buffer_size: int = Field(
        DEFAULT_BUFFER_SIZE, description="bytes of the GPU buffer get allocates from: '8GiB'"
    )
    gpu_checksum: bool = Field(
        False, description="checksum payloads in GPU memory too (copies them to the host)"
    )
    register_buffers: bool = Field(True, description="register allocator buffers with cuFile")

    @field_validator("shard", mode="before")
    @classmethod
    def _check_shard(cls, value: object) -> str:
        if not isinstance(value, str) or value.strip().lower() not in ("hash", "by_gpu"):
            raise ConfigError(
                f"shard must be 'hash' (by key, the default) or 'by_gpu' (device index "
                f"modulo the number of directories), got {value!r}."
            )
        return value.strip().lower()

    @field_validator("device", mode="before")
    @classmethod
    def _check_device(cls, value: object) -> str:
        if not isinstance(value, str) or not _DEVICE.fullmatch(value.strip()):
            raise ConfigError(f"device must be 'cuda' or 'cuda:N' (a GPU), got {value!r}.")
        return value.strip()

    @field_validator("buffer_size", mode="before")
    @classmethod
    def _parse_buffer_size(cls, value: object) -> int:
        size = parse_size(value, what="gds buffer_size")
        if size < 2 * BLOCK:
            raise ConfigError(
                f"gds buffer_size is {size} bytes; it must hold objects, so give at least "
                f"{2 * BLOCK} bytes, typically several GiB ('8GiB')."
            )
        return size


class WekaOptions(GdsOptions):
    """Options of ``weka://``: those of ``gds://`` and ``allow_non_weka``."""

    allow_non_weka: bool = Field(
        False, description="accept directories that are not on a WekaFS mount"
    )


__all__ = ["DEFAULT_BUFFER_SIZE", "GdsOptions", "WekaOptions", "device_index"]
