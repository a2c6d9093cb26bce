"""The servers a Redis-protocol tier's test modules share, as pytest fixtures of the family that
a ``server_family`` fixture names (:mod:`kvplug_testing.server_family`). Each module that asks
for one gets its own (module scope; :func:`fresh_server` is the test's own), started on a free
loopback port and killed when the module is done; a TLS one skips, with the reason, where the
family's server has no TLS.

A plugin's ``conftest.py`` takes the fixtures in and names its family::

    from kvplug_testing.server_family import REDIS, ServerFamily
    from kvplug_testing.server_fixtures import *  # noqa: F403

    @pytest.fixture(scope="session")
    def server_family() -> ServerFamily:
        return REDIS
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Literal

import pytest

from kvplug_testing.redis import RedisServer
from kvplug_testing.server_family import ServerFamily

PASSWORD = "s3cret-pw@x"
"""The default user's password on :func:`password_server` (the ``@`` must be escaped in URLs)."""

ACL_USERS = {"alice": ("alice-pw", "+@all"), "blind": ("blind-pw", "+@all", "-get")}
"""The users :func:`password_server` adds, by name: their password and command rules."""


def _started(
    start: Callable[[ServerFamily], AbstractContextManager[object]],
    doc: str,
    *,
    tls: bool = False,
    scope: Literal["function", "module"] = "module",
) -> Any:
    """A fixture that yields what ``start`` starts of the ``server_family`` and stops it after;
    with ``tls``, it skips where the family's server has no TLS."""

    def started(server_family: ServerFamily) -> Iterator[object]:
        if tls:
            server_family.skip_without_tls()
        with start(server_family) as process:
            yield process

    started.__doc__ = doc
    return pytest.fixture(scope=scope)(started)


standalone = _started(lambda family: family.server(), "A plain server.")
fresh_server = _started(
    lambda family: family.server(),
    "A server of the test's own, to pause, stop or fill.",
    scope="function",
)
tls_server = _started(lambda family: family.server(tls=True), "A server on TLS only.", tls=True)
small_bulk_server = _started(
    lambda family: family.server(extra_config={"proto-max-bulk-len": "1mb"}),
    "A server whose proto-max-bulk-len is 1mb (tier_checks.BULK_LIMIT), the least it takes.",
)
sentinel_group = _started(
    lambda family: family.sentinel_group(), "Master, replica and three sentinels."
)
tls_sentinel_group = _started(
    lambda family: family.sentinel_group(tls=True),
    "Master, replica and sentinels on TLS only, each asking for a client certificate.",
    tls=True,
)
cluster = _started(lambda family: family.cluster(), "Three masters sharing the slots.")


@pytest.fixture(scope="module")
def password_server(server_family: ServerFamily) -> Iterator[RedisServer]:
    """A server asking for :data:`PASSWORD`, with the users of :data:`ACL_USERS` too."""
    with server_family.server(password=PASSWORD) as server:
        with server.client() as client:
            for user, (password, *rules) in ACL_USERS.items():
                client.execute_command("ACL", "SETUSER", user, "on", f">{password}", "~*", *rules)
        yield server


__all__ = [
    "ACL_USERS",
    "PASSWORD",
    "cluster",
    "fresh_server",
    "password_server",
    "sentinel_group",
    "small_bulk_server",
    "standalone",
    "tls_sentinel_group",
    "tls_server",
]
