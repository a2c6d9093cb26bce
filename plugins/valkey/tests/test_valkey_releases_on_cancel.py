"""The Valkey tier's ``releases_on_cancel`` against real valkey-server processes: a cancelled
``get_into`` or put (and their batched forms) lets go of the caller's memory by the time its
cancellation ends, on kvplug's own connections and through valkey-py (``direct_reads=false``,
``direct_writes=false``, TLS puts, a Cluster), on asyncio and on uvloop. The scenarios are
``kvplug_testing.tier_suite``'s, the checks ``kvplug_testing.cancellation``'s; valkey-py is the
client library here."""

from __future__ import annotations

import pytest

from kvplug_testing.tier_suite import ReleasesOnCancelScenarios

pytestmark = pytest.mark.redis


class TestValkeyReleasesOnCancel(ReleasesOnCancelScenarios):
    urls = (
        "valkey://127.0.0.1:1",
        "valkeys://127.0.0.1:1",
        "valkey+sentinel://127.0.0.1:1/mymaster",
        "valkey+cluster://127.0.0.1:1",
    )
    tls_loops = ("uvloop",)
    cluster_loops = ("uvloop",)
