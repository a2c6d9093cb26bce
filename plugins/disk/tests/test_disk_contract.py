"""The contract suite against the local-disk tier, file:// (plugins/disk), through the subclass
route vendors use: a fresh directory per test, a small store for the capacity clauses, and
damage done to the object files themselves."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvplug import Backend, CacheKey
from kvplug_contracts import BackendContract
from kvplug_disk.backend import DiskBackend
from kvplug_disk.layout import object_name


def object_file(backend: DiskBackend, key: CacheKey) -> Path | None:
    """Where the layout puts ``key``'s file, found by looking in every directory (not through
    the backend's index)."""
    subdir, name = object_name(key.to_string())
    for directory in backend.paths:
        path = Path(directory) / subdir / name
        if path.exists():
            return path
    return None


class TestDiskConformance(BackendContract):
    @pytest.fixture
    def kvplug_url(self, tmp_path: Path) -> str:
        return f"file://{tmp_path}/disk"

    @pytest.fixture
    def small_store_options(self) -> dict[str, Any]:
        return {"max_size": "4MiB"}

    @pytest.fixture
    def damage_stored(self) -> Callable[..., Any]:
        """Flip a payload byte, cut the file in half, or replace it with garbage, on disk."""

        async def damage(backend: Backend, key: CacheKey, mode: str) -> bool:
            assert isinstance(backend, DiskBackend)
            path = object_file(backend, key)
            if path is None:
                return False
            data = bytearray(path.read_bytes())
            if mode == "flip":
                data[len(data) - 100] ^= 0x01
            elif mode == "truncate":
                del data[len(data) // 2 :]
            else:
                data = bytearray(b"not a kvplug object \xff\x00" * 300)
            path.write_bytes(bytes(data))
            return True

        return damage
