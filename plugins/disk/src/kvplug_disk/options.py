"""Options of ``file://`` (and, extended, of ``gds://`` and ``weka://``): :class:`DiskOptions`.
See :mod:`kvplug_disk.backend` for what each does."""

from __future__ import annotations

import os

from pydantic import Field, field_validator

from kvplug.errors import ConfigError
from kvplug.options import EvictionOptions
from kvplug.units import GiB, parse_size
from kvplug_disk.layout import BLOCK

DEFAULT_MAX_SIZE = 10 * GiB
DEFAULT_WORKERS = 4
DEFAULT_QUEUE_DEPTH = 64


class DiskOptions(EvictionOptions):
    """Options of ``file://``."""

    paths: tuple[str, ...] = Field(
        (), description="more directories besides the URL path: a list or 'a,b'"
    )
    max_size: int = Field(
        DEFAULT_MAX_SIZE,
        description="bytes of object files the tier holds: '100GiB'",
        validate_default=True,  # the default too must hold every tenant quota
    )
    o_direct: bool = Field(True, description="use O_DIRECT where the filesystem supports it")
    fsync: bool = Field(False, description="fsync files and directories before put returns")
    workers: int = Field(DEFAULT_WORKERS, ge=1, le=256, description="file I/O threads")
    queue_depth: int = Field(
        DEFAULT_QUEUE_DEPTH, ge=1, le=1 << 16, description="operations in flight at most"
    )
    allow_shared_dir: bool = Field(
        False, description="accept a directory another user owns or can write to"
    )

    @field_validator("paths", mode="before")
    @classmethod
    def _split_paths(cls, value: object) -> tuple[str, ...]:
        if value is None:
            return ()
        if isinstance(value, str):
            return tuple(value.split(",")) if value else ()
        if isinstance(value, list | tuple) and all(isinstance(p, str | os.PathLike) for p in value):
            return tuple(os.fspath(p) for p in value)
        raise ConfigError(
            f"paths must be a list of directories or a comma-separated string, got {value!r}."
        )

    @field_validator("max_size", mode="before")
    @classmethod
    def _parse_max_size(cls, value: object) -> int:
        size = parse_size(value, what="file max_size")
        if size < 2 * BLOCK:
            raise ConfigError(
                f"file max_size is {size} bytes, less than one {2 * BLOCK}-byte object file "
                "(a header block and a payload block), so nothing would fit. "
                "Give a size such as '10GiB'."
            )
        return size


__all__ = ["DEFAULT_MAX_SIZE", "DEFAULT_QUEUE_DEPTH", "DEFAULT_WORKERS", "DiskOptions"]
