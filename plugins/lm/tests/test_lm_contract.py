"""The contract suite against the ``lm://`` client and ``kvplug lm-server`` (a subprocess on
127.0.0.1): in the extended mode the two negotiate, in the plain mode forced on the client
(LMCache's protocol against kvplug's server), over TLS (``lms://``), and against a small server
for clause 9.
Every class hands the suite the server's process as ``server_control``, so clause 10 runs
against a real pause (SIGSTOP), stop (SIGKILL) and restart on the same port.

Clause 6 (damaged data is a counted, deleted miss): no request can store damaged data on a
kvplug server (it verifies every payload's checksum), so the subprocess classes say so in their
``damage_stored`` fixture. Data can still go bad at rest in the server's memory:
TestLMDamageAtRestConformance runs the suite against a server in this process and damages its
stored bytes in place, and the client must read a counted miss and delete the key. The client's
check of a reply damaged on its way is tested in test_lm_client.py through a proxy.

With a serde other than ``naive`` every value is a checksummed kvplug frame: TestLMZstdConformance
runs the suite with ``serde=zstd`` against the server in this process with the extended mode's
own checksums off, so the frame alone catches the damage at rest; TestLMLz4PlainConformance
runs it with ``serde=lz4`` in the plain mode.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvplug.backend import Backend
from kvplug.keys import MAX_TENANT_LENGTH, CacheKey
from kvplug_contracts import BackendContract
from kvplug_contracts.faultproxy import FaultProxy
from kvplug_contracts.suite import CapacityContract, TenancyContract
from kvplug_contracts.support import clause, not_applicable
from kvplug_lm.backend import LMBackend
from kvplug_lm.server import LMServer, ServerOptions, run_in_thread
from kvplug_testing.lm import LMServerProcess
from kvplug_testing.tls import OverTLS, make_tls_files

# Room for the suite's 80 MiB objects, several at once.
SERVER_MEMORY = "1GiB"

EXTENDED_NO_DAMAGE = (
    "the kvplug lm-server checks every payload against the xxh3 checksum it was put with and "
    "refuses one that does not match, so no request can store damaged data for the suite to "
    "read back; the client's check of the checksum on read (a counted miss, then a DELETE) is "
    "tested in test_lm_client.py through a proxy that damages a reply"
)
PLAIN_FRAMES_NOT_DELETED = (
    "a frame is checksummed, so the client in the plain mode detects and counts a damaged one "
    "(test_lm_serdes.py), but LMCache's plain protocol cannot delete it; use the extended mode "
    "for clause 6"
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
def in_process_server() -> Iterator[LMServer]:
    with run_in_thread(ServerOptions(port=0, max_memory=1 << 30)) as server:
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


class _OnTheServerProcess(BackendContract):
    """Against the module's ``kvplug lm-server`` subprocess, which is also the suite's
    ``server_control`` (brought back after each test); clause 9 runs on a small server."""

    test_a_full_store_evicts_or_raises_capacity_exceeded = _full_store_elsewhere
    test_an_object_larger_than_the_whole_store_never_corrupts = _full_store_elsewhere

    @pytest.fixture
    def served_by(self, lm_server: LMServerProcess) -> LMServerProcess:
        """The server process this class runs against."""
        return lm_server

    @pytest.fixture
    def kvplug_url(self, served_by: LMServerProcess) -> str:
        return served_by.url

    @pytest.fixture
    def server_control(self, served_by: LMServerProcess) -> Iterator[LMServerProcess]:
        yield served_by
        served_by.resume()
        served_by.start()


class TestLMExtendedConformance(_OnTheServerProcess):
    """The default: the client's hello finds a kvplug server, so the extended mode."""

    @pytest.fixture
    def kvplug_options(self) -> dict[str, object]:
        return {"mode": "extended"}

    @pytest.fixture
    def damage_stored(self) -> Callable[..., Any]:
        return _not_applicable(EXTENDED_NO_DAMAGE)


@pytest.fixture(scope="module")
def tls_lm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LMServerProcess]:
    """A server that speaks only TLS and requires a client certificate (test certificates)."""
    files = make_tls_files(tmp_path_factory.mktemp("tls"))
    with LMServerProcess(
        ["--max-memory", SERVER_MEMORY], tls=files, client_certificates=True
    ) as server:
        yield server


class TestLMOverTLSConformance(OverTLS, _OnTheServerProcess):
    """``lms://``: the extended mode over TLS, with a client certificate, and clause 10's
    restarts and pauses of a TLS server."""

    @pytest.fixture
    def served_by(self, tls_lm_server: LMServerProcess) -> LMServerProcess:
        return tls_lm_server

    @pytest.fixture
    def damage_stored(self) -> Callable[..., Any]:
        return _not_applicable(EXTENDED_NO_DAMAGE)


class TestLMPlainConformance(_OnTheServerProcess):
    """mode=plain: LMCache's protocol (no hello, EXIST after PUT) against kvplug's server,
    the way LMCache's own client talks to it."""

    tenant_names = tuple(
        name for name in TenancyContract.tenant_names if len(name) < MAX_TENANT_LENGTH - 1
    )
    """LMCache's plain protocol carries keys of at most 150 bytes: the two longest tenant names
    (128 characters) do not fit beside a model name (the extended mode's classes try them)."""

    @pytest.fixture
    def kvplug_options(self) -> dict[str, object]:
        return {"mode": "plain"}

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


TRUNCATE_AT_REST = (
    "a payload in the server's memory cannot lose its end at rest; a record cut short can only "
    "come from a spill file, which the server checks against its length and checksum on read "
    "(test_lm_server.py)"
)


def damage_in_memory(server: LMServer) -> Callable[..., Any]:
    """The suite's ``damage_stored`` for a server in this process: flip a bit of, or write
    garbage over, the payload the server holds for ``key``, on the server's own loop."""

    async def damage(backend: Backend, key: CacheKey, mode: str) -> bool:
        if mode == "truncate":
            not_applicable(TRUNCATE_AT_REST)
        assert isinstance(backend, LMBackend), f"{backend!r} is not the lm:// client"
        stored_key = backend.wire_key(key)

        async def spoil() -> bool:
            entry = server.store.lookup(stored_key) if server.store else None
            if entry is None:
                return False
            payload = entry.payload
            if mode == "flip":
                payload[len(payload) // 2] ^= 0x10
            else:
                pattern = b"\x00garbage\xff"
                for start in range(0, len(payload), len(pattern)):
                    piece = pattern[: len(payload) - start]
                    payload[start : start + len(piece)] = piece
            return True

        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(spoil(), server.loop))

    return damage


@pytest.fixture(scope="module")
def in_process_proxy(in_process_server: LMServer) -> Iterator[FaultProxy]:
    with FaultProxy(("127.0.0.1", in_process_server.port)) as proxy:
        yield proxy


class TestLMDamageAtRestConformance(BackendContract):
    """The extended mode against a server in this process (``run_in_thread``), whose stored
    bytes clause 6 damages in place: the checksum the server took on receipt no longer
    matches, and the client reads a counted miss and deletes the key. A thread cannot be
    paused or killed like a process, so clause 10 runs through the suite's fault proxy."""

    test_a_full_store_evicts_or_raises_capacity_exceeded = _full_store_elsewhere
    test_an_object_larger_than_the_whole_store_never_corrupts = _full_store_elsewhere

    @pytest.fixture
    def kvplug_url(self, in_process_server: LMServer, in_process_proxy: FaultProxy) -> str:
        return in_process_proxy.url_for(f"lm://127.0.0.1:{in_process_server.port}")

    @pytest.fixture
    def server_control(self, in_process_proxy: FaultProxy) -> Iterator[FaultProxy]:
        yield in_process_proxy
        in_process_proxy.heal()

    @pytest.fixture
    def kvplug_options(self) -> dict[str, object]:
        return {"mode": "extended"}

    @pytest.fixture
    def damage_stored(self, in_process_server: LMServer) -> Callable[..., Any]:
        return damage_in_memory(in_process_server)


class TestLMLz4PlainConformance(TestLMPlainConformance):
    """mode=plain with ``serde=lz4``: every object travels as a frame, LMCache's opaque bytes."""

    @pytest.fixture
    def kvplug_options(self) -> dict[str, object]:
        return {"mode": "plain", "serde": "lz4"}

    @pytest.fixture
    def damage_stored(self) -> Callable[..., Any]:
        return _not_applicable(PLAIN_FRAMES_NOT_DELETED)


class TestLMZstdConformance(TestLMDamageAtRestConformance):
    """The extended mode with ``serde=zstd`` and the mode's payload checksums off: the frame's
    own checksum is all that catches clause 6's damage at rest, a counted miss, deleted."""

    @pytest.fixture
    def kvplug_options(self) -> dict[str, object]:
        return {"mode": "extended", "serde": "zstd", "checksums": False}
