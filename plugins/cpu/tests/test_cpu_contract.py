"""The kvplug contract against cpu:// (the small store for clauses 8 and 9 comes from
CpuBackend.contract_small_options)."""

import pytest

from kvplug_contracts import BackendContract


class TestCpuContract(BackendContract):
    """Every clause of the kvplug contract against cpu://."""

    @pytest.fixture
    def kvplug_url(self) -> str:
        return "cpu://"
