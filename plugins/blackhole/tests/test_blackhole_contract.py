"""The kvplug contract against blackhole://, with its declared known failures (it stores
nothing, so the clauses about reading back fail by design)."""

from pathlib import Path

import pytest

from kvplug_contracts import BackendContract, load_known_failures


class TestBlackholeContract(BackendContract):
    kvplug_known_failures = load_known_failures(Path(__file__).parents[1] / "contract-xfails.txt")

    @pytest.fixture
    def kvplug_url(self) -> str:
        return "blackhole://"
