"""The kvplug contract against audit::cpu://, with damage done to the inner tier's object
behind the wrapper's back (the wrapper must catch it)."""

from collections.abc import Callable
from typing import Any

import pytest

from kvplug import Backend, CacheKey
from kvplug_contracts import BackendContract


class TestAuditOverCpuContract(BackendContract):
    @pytest.fixture
    def kvplug_url(self) -> str:
        return "audit::cpu://"

    @pytest.fixture
    def damage_stored(self) -> Callable[..., Any]:
        """Damage the object the inner cpu tier holds, in place."""

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
