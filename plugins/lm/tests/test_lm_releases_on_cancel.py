"""The ``lm://`` client's ``releases_on_cancel``: a cancelled ``get_into`` or put (and their
batched forms, the extended mode's pipelines over several connections) lets go of the caller's
memory by the time its cancellation ends, in the extended mode (with and without checksums, which
would hide a torn put from the store) and the plain mode, on asyncio and on uvloop. Each check
pauses a real ``kvplug lm-server`` mid-value through a :class:`Tap`, which also sees any byte of
the caller's buffer sent after the cancellation (``kvplug_testing.cancellation``). Reads from
LMCache's own ``lmcache_server`` are checked too where its venv is present; not puts: LMCache
0.5.6's server stores ``None`` for a PUT whose connection closed mid-payload, and its handler then
fails every GET of that key (it closes the connection)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import kvplug
from kvplug_testing.cancellation import OPERATIONS, Tap, check_operation, run_on
from kvplug_testing.lm import LMServerProcess

MODES = {
    "extended": {},
    "extended, no checksums": {"checksums": False},
    "plain": {"mode": "plain"},
}


@pytest.fixture(scope="module")
def lm_server() -> Iterator[LMServerProcess]:
    with LMServerProcess(["--max-memory", "512MiB"]) as server:
        yield server


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize("operation", list(OPERATIONS))
@pytest.mark.parametrize("mode", list(MODES))
def test_a_cancelled_operation_lets_go_of_the_callers_memory(
    lm_server: LMServerProcess, mode: str, operation: str, loop: str
) -> None:
    with Tap(lm_server.host, lm_server.port) as tap:
        run_on(loop, check_operation(tap.url("lm"), tap, operation, **MODES[mode]))


@pytest.mark.lmcache
@pytest.mark.parametrize("operation", ["get_into", "batched_get_into"])
def test_against_lmcaches_server_a_cancelled_read_lets_go_of_the_callers_memory(
    lmcache_server: LMServerProcess, operation: str
) -> None:
    with Tap(lmcache_server.host, lmcache_server.port) as tap:
        run_on("asyncio", check_operation(tap.url("lm"), tap, operation))


@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_declares_releases_on_cancel(lm_server: LMServerProcess, mode: str) -> None:
    async def capabilities() -> bool:
        backend = await kvplug.open_backend(lm_server.url, **MODES[mode])
        try:
            return backend.capabilities.releases_on_cancel
        finally:
            await backend.close()

    assert kvplug.create_backend(lm_server.url).capabilities.releases_on_cancel  # before open
    assert run_on("asyncio", capabilities())
