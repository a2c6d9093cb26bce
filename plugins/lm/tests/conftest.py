"""What the lm:// tests share: LMCache 0.5.6's own ``lmcache_server``, run from its venv (one per
module that asks for it; skipped, with the reason, where the venv is absent)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvplug_testing.lm import LMCACHE_ABSENT, LMServerProcess, lmcache_python


@pytest.fixture(scope="module")
def lmcache_server() -> Iterator[LMServerProcess]:
    python = lmcache_python()
    if python is None:
        pytest.skip(LMCACHE_ABSENT)
    with LMServerProcess.lmcache(python) as server:
        yield server
