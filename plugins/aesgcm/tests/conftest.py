"""Key files for the aesgcm serde's tests, and the real Redis servers its round trips use
(kvplug_testing.server_fixtures: each module that asks gets its own, on a free loopback port)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvplug_aesgcm.keyring import new_entry
from kvplug_testing.server_family import REDIS, ServerFamily
from kvplug_testing.server_fixtures import *  # noqa: F403  (the fixtures, for this folder)


@pytest.fixture(scope="session")
def server_family() -> ServerFamily:
    return REDIS


@pytest.fixture
def key_file(tmp_path: Path) -> Callable[..., Path]:
    """Write a key file of fresh keys with the ids given (mode 600) and return its path;
    ``name`` picks the file, so a test can hold several key files."""

    def write(*ids: int, name: str = "keys") -> Path:
        path = tmp_path / name
        path.write_text("# test keys\n" + "\n".join(new_entry(key_id) for key_id in ids) + "\n")
        path.chmod(0o600)
        return path

    return write
