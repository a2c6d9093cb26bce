"""The real valkey-server processes the Valkey tier's test modules share, valkey-server's family
of kvplug_testing.server_fixtures: each module that asks for one gets its own (module scope),
started on a free loopback port and killed when the module is done. TLS ones are skipped, with
the reason, when the valkey-server was built without TLS."""

from __future__ import annotations

import pytest

from kvplug_testing.server_family import VALKEY, ServerFamily
from kvplug_testing.server_fixtures import *  # noqa: F403  (the fixtures, for this folder)


@pytest.fixture(scope="session")
def server_family() -> ServerFamily:
    return VALKEY
