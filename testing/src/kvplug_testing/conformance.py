"""Mixins that point the contract suite (kvplug_contracts) at a server a fixture started, so that
a tier's conformance classes each name a server fixture instead of repeating the fixtures::

    class TestRedisConformance(ControlledServer, BackendContract):
        server_fixture = "standalone"

The server fixture and ``server_family`` are the tier's (:mod:`kvplug_testing.server_fixtures`).

* :class:`ServedBy`: ``kvplug_url`` is the server's URL, checked to be of the family's schemes
  (a Sentinel group's: clause 10 is n/a);
* :class:`ControlledServer`: the server is also the ``server_control`` clause 10 pauses and
  restarts;
* :class:`FullServer`: clause 9 against a server of the ``server_family`` fixture's family
  whose ``maxmemory`` is small, refusing writes or evicting by :attr:`FullServer.policy`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import pytest

from kvplug_testing.server_family import ServerFamily


class ServedBy:
    """The suite against the server the fixture named :attr:`server_fixture` starts."""

    server_fixture: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "server_fixture" in cls.__dict__:
            # Used by name, the server starts with the module's fixtures, before the test's own
            # (as an argument would): the suite's leak check then does not count its processes.
            uses = pytest.mark.usefixtures(cls.server_fixture)
            cls.pytestmark = [*cls.__dict__.get("pytestmark", []), uses]  # type: ignore[attr-defined]

    @pytest.fixture
    def served(self, request: pytest.FixtureRequest) -> Any:
        return request.getfixturevalue(self.server_fixture)

    @pytest.fixture
    def kvplug_url(self, served: Any, server_family: ServerFamily) -> str:
        url = str(served.url)
        # redis... or valkey...: the family's own backend is the one under test
        assert url.startswith((server_family.name, "unix://")), url
        return url


class ControlledServer(ServedBy):
    """:class:`ServedBy`, and clause 10 pauses and restarts that server."""

    @pytest.fixture
    def server_control(self, served: Any) -> Any:
        return served


class FullServer:
    """Clause 9 against a server of its own with ``maxmemory 4mb`` and :attr:`policy`."""

    policy: ClassVar[str]
    """``noeviction`` (puts raise CapacityExceeded) or ``allkeys-lru`` (evicted keys miss)."""

    @pytest.fixture
    def kvplug_url(self, server_family: ServerFamily) -> Iterator[str]:
        with server_family.server(maxmemory="4mb", policy=self.policy) as server:
            yield server.url

    @pytest.fixture
    def small_store_options(self) -> dict[str, object]:
        return {}  # the server behind kvplug_url is the small store


__all__ = ["ControlledServer", "FullServer", "ServedBy"]
