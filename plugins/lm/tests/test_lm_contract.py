"""The contract suite against the ``lm://`` client and ``kvplug lm-server`` (a subprocess on
127.0.0.1): in the extended mode the two negotiate, in the plain mode forced on the client
(LMCache's protocol against kvplug's server), and against a small server for clause 9.
Every class hands the suite the server's process as ``server_control``, so clause 10 runs
against a real pause (SIGSTOP), stop (SIGKILL) and restart on the same port.

Clause 6 (damaged data is a counted, deleted miss) does not apply to either mode, and each
class says why in its ``damage_stored`` fixture; the client's checksum verification is
tested in test_lm_client.py with a proxy that damages a reply on its way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvplug_contracts import BackendContract
from kvplug_contracts.suite import CapacityContract
from kvplug_contracts.support import clause, not_applicable
from kvplug_testing.lm import LMServerProcess

# Room for the suite's 80 MiB objects, several at once.
SERVER_MEMORY = "1GiB"

EXTENDED_NO_DAMAGE = (
    "the kvplug lm-server checks every payload against the xxh3 checksum it was put with and "
    "refuses one that does not match, so no request can store damaged data for the suite to "
    "read back; the client's check of the checksum on read (a counted miss, then a DELETE) is "
    "tested in test_lm_client.py through a proxy that damages a reply"
)
PLAIN_NO_DAMAGE = (
    "LMCache's plain protocol carries no checksum and cannot delete, so a client in the plain "
    "mode can neither detect damaged data nor remove it; use the extended mode for clause 6"
)


@pytest.fixture(scope="module")
def lm_server() -> Iterator[LMServerProcess]:
    with LMServerProcess(["--max-memory", SERVER_MEMORY]) as server:
        yield server


@pytest.fixture(scope="module")
def small_lm_server() -> Iterator[LMServerProcess]:
    with LMServerProcess(["--max-memory", "4MiB"]) as server:
        yield server


def _not_applicable(reason: str) -> Callable[..., Any]:
    async def damage(*_: object) -> bool:
        not_applicable(reason)

    return damage


SIZED_FOR_THE_SUITE = (
    "this server is sized for the suite's 80 MiB objects; clause 9 runs in "
    "TestFullLMServerConformance against a server of 4 MiB (--max-memory)"
)


@clause(9)
def _full_store_elsewhere(self: object) -> None:
    """Clause 9 needs a store small enough to fill; the lm:// store is the server, so it runs
    against a small server of its own (TestFullLMServerConformance)."""
    not_applicable(SIZED_FOR_THE_SUITE)


class TestLMExtendedConformance(BackendContract):
    """The default: the client's hello finds a kvplug server, so the extended mode."""

    test_a_full_store_evicts_or_raises_capacity_exceeded = _full_store_elsewhere
    test_an_object_larger_than_the_whole_store_never_corrupts = _full_store_elsewhere

    @pytest.fixture
    def kvplug_url(self, lm_server: LMServerProcess) -> str:
        return lm_server.url

    @pytest.fixture
    def kvplug_options(self) -> dict[str, object]:
        return {"mode": "extended"}

    @pytest.fixture
    def server_control(self, lm_server: LMServerProcess) -> Iterator[LMServerProcess]:
        yield lm_server
        lm_server.resume()
        lm_server.start()

    @pytest.fixture
    def damage_stored(self) -> Callable[..., Any]:
        return _not_applicable(EXTENDED_NO_DAMAGE)


class TestLMPlainConformance(BackendContract):
    """mode=plain: LMCache's protocol (no hello, EXIST after PUT) against kvplug's server,
    the way LMCache's own client talks to it."""

    test_a_full_store_evicts_or_raises_capacity_exceeded = _full_store_elsewhere
    test_an_object_larger_than_the_whole_store_never_corrupts = _full_store_elsewhere

    @pytest.fixture
    def kvplug_url(self, lm_server: LMServerProcess) -> str:
        return lm_server.url

    @pytest.fixture
    def kvplug_options(self) -> dict[str, object]:
        return {"mode": "plain"}

    @pytest.fixture
    def server_control(self, lm_server: LMServerProcess) -> Iterator[LMServerProcess]:
        yield lm_server
        lm_server.resume()
        lm_server.start()

    @pytest.fixture
    def damage_stored(self) -> Callable[..., Any]:
        return _not_applicable(PLAIN_NO_DAMAGE)

    @clause(12)
    def test_hostile_model_names_and_tags_stay_in_their_own_key(self) -> None:
        not_applicable(
            "LMCache's plain protocol carries keys of at most 150 bytes without whitespace or "
            "control characters; the hostile names include such keys, and put refuses them "
            "with NotSupported (test_lm_client.py checks that) instead of storing them under "
            "another key. The extended mode, against the same server, passes this test"
        )


class TestFullLMServerConformance(CapacityContract):
    """A server of 4 MiB (--max-memory): puts beyond it evict the least recently used."""

    @pytest.fixture
    def kvplug_url(self, small_lm_server: LMServerProcess) -> str:
        return small_lm_server.url

    @pytest.fixture
    def small_store_options(self) -> dict[str, object]:
        return {}  # the server behind kvplug_url is the small store


class TestFullLMServerPlainConformance(CapacityContract):
    """The same in the plain mode: a PUT the full server drops is caught by the EXIST that
    follows it, and put raises CapacityExceeded."""

    @pytest.fixture
    def kvplug_url(self, small_lm_server: LMServerProcess) -> str:
        return small_lm_server.url

    @pytest.fixture
    def kvplug_options(self) -> dict[str, object]:
        return {"mode": "plain"}

    @pytest.fixture
    def small_store_options(self) -> dict[str, object]:
        return {}
