"""Every test here, and every LMCache process they start, runs with LMCache's usage telemetry
off (LMCache reports to a server of its own unless told not to, and tests talk to loopback
only) and without its start-up banner. The helpers the test modules share
(``lmcache_support``) are importable from this directory; ``redis_server`` is one real
redis-server per test module."""

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvplug_testing import RedisServer

for name, value in {
    "LMCACHE_TRACK_USAGE": "false",
    "DO_NOT_TRACK": "1",
    "LMCACHE_DISABLE_BANNER": "1",
}.items():
    os.environ[name] = value

# pytest imports test modules with --import-mode=importlib, which puts no test directory on
# sys.path; the shared helpers are a plain module of this one.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    """A real redis-server on a free loopback port, for the module's tests."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (bash scripts/setup.sh installs it)")
    with RedisServer() as server:
        yield server
