"""``infinistore://`` declares ``releases_on_cancel`` over RDMA and TCP, and it holds: InfiniStore's
client only ever gets staging memory or a copy of the backend's own, and the caller's memory is
copied in (a put) or out (a read) on the event loop while the operation still runs. Checked
against the recording stand-in of InfiniStore's client and server (``infinistore_standin``; the
real server needs an RDMA device), paused while a transfer is in flight, with kvplug-redis'
checks (``kvplug_testing.cancellation``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from infinistore_standin import StandInServer

import kvplug
from kvplug_testing.cancellation import OPERATIONS, check_operation, run_on

OPTIONS = {"max_value_size": "48MiB", "staging_size": "128MiB"}


@pytest.fixture(scope="module")
def standin() -> Iterator[StandInServer]:
    server = StandInServer()
    yield server
    server.close()


@pytest.mark.parametrize("operation", list(OPERATIONS))
@pytest.mark.parametrize("connection_type", ["rdma", "tcp"])
def test_a_cancelled_operation_lets_go_of_the_callers_memory(
    standin: StandInServer, connection_type: str, operation: str
) -> None:
    options = {
        **OPTIONS,
        "connection_type": connection_type,
        "connection_factory": standin.connection_factory(),
    }
    try:
        # The stand-in answers a read at once and in one piece: paused before it is asked.
        scenario = check_operation(standin.url, standin, operation, pause_first=True, **options)
        run_on("asyncio", scenario)
    finally:
        standin.resume()


@pytest.mark.parametrize("connection_type", ["rdma", "tcp"])
def test_both_connection_types_declare_releases_on_cancel(connection_type: str) -> None:
    backend = kvplug.create_backend(f"infinistore://127.0.0.1:1?connection_type={connection_type}")
    assert backend.capabilities.releases_on_cancel
