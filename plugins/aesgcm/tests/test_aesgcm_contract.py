"""The contract suite against a real Redis server with every value sealed by the aesgcm serde:
encryption changes what is stored, never what the backend promises."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvplug_aesgcm.keyring import new_entry
from kvplug_contracts import BackendContract
from kvplug_testing.conformance import ControlledServer

pytestmark = pytest.mark.redis


class TestSealedRedisConformance(ControlledServer, BackendContract):
    server_fixture = "standalone"

    @pytest.fixture
    def kvplug_options(self, tmp_path: Path) -> dict[str, object]:
        keys = tmp_path / "keys"
        keys.write_text(new_entry(1) + "\n" + new_entry(2) + "\n")
        keys.chmod(0o600)
        return {"serde": "aesgcm", "serde_key_file": str(keys), "serde_per_tenant": True}
