from pathlib import Path

import pytest

from kvplug_contracts import BackendContract


class TestAcmeContract(BackendContract):
    """Every clause of the kvplug contract against acme://."""

    @pytest.fixture
    def kvplug_url(self, tmp_path: Path) -> str:
        return f"acme://{tmp_path}/contract.sqlite"

    @pytest.fixture
    def kvplug_options(self) -> dict[str, object]:
        return {"busy_timeout": 2}
