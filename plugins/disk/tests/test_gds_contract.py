"""The contract suite against gds:// (kvplug_disk.gds) on a machine without a GPU: payloads move
through gds_standin.PosixStandIn instead of cuFile, and everything else (the index,
objects of other instances found on demand, damage handling, pins, capacity, capabilities) is
the real backend's. test_gds_cuda.py runs the suite again with cuFile on a GPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gds_standin import PosixStandIn

from kvplug_contracts import BackendContract


class TestGdsStandInConformance(BackendContract):
    @pytest.fixture
    def kvplug_url(self, tmp_path: Path) -> str:
        return f"gds://{tmp_path}/gds"

    @pytest.fixture
    def kvplug_options(self) -> dict[str, Any]:
        return {"file_io": PosixStandIn()}

    @pytest.fixture
    def small_store_options(self) -> dict[str, Any]:
        return {"max_size": "4MiB"}
