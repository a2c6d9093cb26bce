"""The contract suite against the ``aesgcm::`` wrapper over backends that store objects: the cpu
tier, the disk tier and a real kvplug lm:// server. Clause 6's damage is done behind the
wrapper's back: the sealed object is read from the inner backend, altered (in the ciphertext,
where only the cipher can tell) and stored again through the inner backend, so the inner
backend's own checks pass and the wrapper alone must catch it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvplug import Backend, CacheKey
from kvplug_aesgcm.keyring import new_entry
from kvplug_contracts import BackendContract
from kvplug_testing.lm import LMServerProcess


@pytest.fixture
def sealing(tmp_path: Path) -> str:
    """The wrapper's part of a URL, with a key file of two keys."""
    keys = tmp_path / "sealing-keys"
    keys.write_text(new_entry(1) + "\n" + new_entry(2) + "\n")
    keys.chmod(0o600)
    return f"aesgcm://?key_file={keys}&per_tenant=true"


@pytest.fixture
def damage_stored() -> Callable[..., Any]:
    async def damage(backend: Backend, key: CacheKey, mode: str) -> bool:
        inner = backend.inner  # type: ignore[attr-defined]
        stored = await inner.get(key)
        if stored is None:
            return False
        try:
            raw = stored.raw
            if mode == "flip":
                raw[raw.numel() - 20] ^= 0x10
            elif mode == "truncate":
                raw[raw.numel() // 2 :] = 0
            else:
                raw.copy_(raw.flip(0) ^ 0x5A)
            await inner.put(key, stored)
        finally:
            stored.release()
        return True

    return damage


@pytest.fixture(scope="module")
def lm_server() -> Iterator[LMServerProcess]:
    with LMServerProcess() as server:
        yield server


class TestSealedCpuContract(BackendContract):
    @pytest.fixture
    def kvplug_url(self, sealing: str) -> str:
        return f"{sealing}::cpu://"


class TestSealedDiskContract(BackendContract):
    @pytest.fixture
    def kvplug_url(self, sealing: str, tmp_path: Path) -> str:
        return f"{sealing}::file://{tmp_path / 'disk'}"


class TestSealedLMContract(BackendContract):
    @pytest.fixture
    def kvplug_url(self, sealing: str, lm_server: LMServerProcess) -> str:
        return f"{sealing}::{lm_server.url}"
