"""The contract suite against a real Redis server with every value compressed by the zstd serde:
a serde changes what is stored, never what the backend promises."""

from __future__ import annotations

import pytest

from kvplug_contracts import BackendContract
from kvplug_testing.conformance import ControlledServer

pytestmark = pytest.mark.redis


class TestZstdRedisConformance(ControlledServer, BackendContract):
    server_fixture = "standalone"

    @pytest.fixture
    def kvplug_options(self) -> dict[str, object]:
        return {"serde": "zstd", "serde_level": 3}
