"""The contract suite against every built-in backend, through the subclass route vendors use
(override a fixture or two); `scripts/test.sh` also runs `kvplug contract` for each."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvplug import Backend, CacheKey
from kvplug_contracts import BackendContract
from kvplug_contracts.plugin import load_known_failures

ROOT = Path(__file__).resolve().parents[1]


class TestCpuConformance(BackendContract):
    @pytest.fixture
    def kvplug_url(self) -> str:
        return "cpu://"


class TestBlackholeConformance(BackendContract):
    kvplug_known_failures = load_known_failures(ROOT / "plugins/blackhole/contract-xfails.txt")

    @pytest.fixture
    def kvplug_url(self) -> str:
        return "blackhole://"


class TestAuditOverCpuConformance(BackendContract):
    @pytest.fixture
    def kvplug_url(self) -> str:
        return "audit::cpu://"

    @pytest.fixture
    def damage_stored(self) -> Callable[..., Any]:
        """Damage the object the inner cpu tier holds, in place, behind the wrapper's back."""

        async def damage(backend: Backend, key: CacheKey, mode: str) -> bool:
            stored = await backend.inner.get(key)  # type: ignore[attr-defined]
            if stored is None:
                return False
            try:
                raw = stored.raw
                if mode == "flip":
                    raw[raw.numel() // 2] ^= 0x10
                elif mode == "truncate":
                    raw[raw.numel() // 2 :] = 0
                else:
                    raw.copy_(raw.flip(0) ^ 0x5A)
            finally:
                stored.release()
            return True

        return damage


class TestAcmeConformance(BackendContract):
    """The example third-party plugin (examples/kvplug-acme), as a vendor would run it."""

    @pytest.fixture
    def kvplug_url(self, tmp_path_factory: pytest.TempPathFactory) -> str:
        return f"acme://{tmp_path_factory.getbasetemp()}/acme-contract.sqlite"
