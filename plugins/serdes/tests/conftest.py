"""The real Redis servers the serdes' round trips use (kvplug_testing.server_fixtures: each
module that asks gets its own, on a free loopback port)."""

from __future__ import annotations

import pytest

from kvplug_testing.server_family import REDIS, ServerFamily
from kvplug_testing.server_fixtures import *  # noqa: F403  (the fixtures, for this folder)


@pytest.fixture(scope="session")
def server_family() -> ServerFamily:
    return REDIS
