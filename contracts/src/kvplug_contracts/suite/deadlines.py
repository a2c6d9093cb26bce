"""Clause 10: remote operations have deadlines, never hang, and recover without a reopen, checked
by pausing and stopping the server through the ``server_control`` fixture
(:class:`ServerControl`). How long the suite waits is set in
:mod:`kvplug_contracts.suite.lifecycle`."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import pytest

from kvplug import Backend, BackendUnavailable, FreeListAllocator, MemoryObj
from kvplug.backend import Wraps
from kvplug.url import BackendURL, split_chain
from kvplug_contracts.suite import lifecycle
from kvplug_contracts.suite.operations import SHAPE, Operation
from kvplug_contracts.support import (
    ContractTimeout,
    Keyspace,
    Run,
    check_same,
    clause,
    difference,
    make_obj,
    not_run,
    release_all,
    violated,
)


@runtime_checkable
class ServerControl(Protocol):
    """What the ``server_control`` fixture returns so that clause 10 can be checked: synchronous
    control over the server behind the URL under test. Each method returns once the change has
    happened.

    * ``pause()``: the server stops answering but keeps its connections, its port and its data,
      like ``SIGSTOP``: requests are accepted by the kernel and never answered.
    * ``resume()``: undo :meth:`pause` (``SIGCONT``); the data is still there.
    * ``stop()``: the server goes away (killed): connections are reset, new ones refused.
    * ``start()``: the server listens again on the same address; return once it accepts
      connections. Its data may be gone (keeping it is clause 14's business, not this one's).

    For a server the test session starts itself::

        class ProcessControl:
            def __init__(self, argv, port):
                self.argv, self.port = argv, port
                self.start()

            def pause(self):
                self.process.send_signal(signal.SIGSTOP)

            def resume(self):
                self.process.send_signal(signal.SIGCONT)

            def stop(self):
                self.process.kill()
                self.process.wait()

            def start(self):
                self.process = subprocess.Popen(self.argv)
                wait_until_listening("127.0.0.1", self.port)

        class TestAcme(BackendContract):
            @pytest.fixture
            def server_control(self, acme_server):
                return ProcessControl(acme_server.argv, acme_server.port)
    """

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def stop(self) -> None: ...

    def start(self) -> None: ...


class _Raised:
    """The outcome of an operation that raised BackendTimeout or BackendUnavailable."""

    def __init__(self, error: BackendUnavailable) -> None:
        self.error = error


def _server(server_control: object) -> ServerControl:
    if server_control is None:
        not_run(
            "the suite cannot pause or stop the server behind the URL: pass --kvplug-proxy "
            "(kvplug contract --proxy) or override the server_control fixture"
        )
    if not isinstance(server_control, ServerControl):
        pytest.fail(
            f"the server_control fixture returned {server_control!r}, which lacks some of "
            "pause(), resume(), stop() and start(); see kvplug_contracts.suite.lifecycle."
            "ServerControl",
            pytrace=False,
        )
    return server_control


def _deadline_backend(
    open_contract_backend: Callable[..., Backend], kvplug_url: str, kvplug_options: dict[str, Any]
) -> Backend:
    """A backend with a short deadline, unless the vendor configured one."""
    inner_query = BackendURL.parse(split_chain(kvplug_url)[-1]).options
    if "timeout" in kvplug_options or "timeout" in inner_query:
        return open_contract_backend()
    return open_contract_backend(timeout=lifecycle.DEADLINE_UNDER_TEST)


def _deadline(backend: Backend) -> float:
    """The longest ``timeout`` option along a wrapper chain and, for a Store, of its tiers (an
    operation that reaches a lower tier waits as long as that tier's deadline)."""
    deadline = 0.0
    current: object = backend
    while isinstance(current, Backend):
        deadline = max(deadline, current.options.timeout)
        for tier in getattr(current, "tiers", ()):
            deadline = max(deadline, _deadline(tier))
        current = current.inner if isinstance(current, Wraps) else None
    return deadline


def _during_outage(run: Run, deadline: float, state: str, what: str, operation: Operation) -> Any:
    """Run ``operation`` while the server is ``state``: it must end within the deadline with
    BackendTimeout or BackendUnavailable (returned as :class:`_Raised`), or a result that the
    caller checks for correctness."""
    limit = deadline + lifecycle.DEADLINE_GRACE
    patience = deadline + lifecycle.HANG_MARGIN
    started = time.monotonic()
    try:
        result = run(operation(), timeout=patience)
    except ContractTimeout:
        violated(
            10,
            f"{what} hung while the server was {state}: no result and no error within "
            f"{patience:.1f} s (the backend's deadline is {deadline:.1f} s)",
        )
    except BackendUnavailable as error:
        result = _Raised(error)
    except Exception as error:
        violated(
            10,
            f"{what} raised {type(error).__name__}: {error} while the server was {state}; "
            "expected BackendTimeout or BackendUnavailable (kvplug.errors)",
        )
    elapsed = time.monotonic() - started
    if elapsed > limit:
        if isinstance(result, MemoryObj):
            result.release()
        violated(
            10,
            f"{what} took {elapsed:.1f} s while the server was {state}; the backend's deadline "
            f"is {deadline:.1f} s (allowed: {limit:.1f} s)",
        )
    return result


def _outage_round(
    run: Run,
    backend: Backend,
    deadline: float,
    state: str,
    keyspace: Keyspace,
    stored: MemoryObj,
    new: MemoryObj,
) -> None:
    """get and contains of a stored key and a put of a new one, while the server is down."""
    got = _during_outage(run, deadline, state, "get", lambda: backend.get(keyspace.key(2)))
    if got is None:
        violated(
            10,
            f"get of a stored key returned None (a miss) while the server was {state}: an outage "
            "must raise BackendTimeout or BackendUnavailable, so callers can tell it from a miss",
        )
    if isinstance(got, MemoryObj):
        try:
            check_same(10, stored, got, f"get while the server was {state} returned data")
        finally:
            got.release()
    found = _during_outage(
        run, deadline, state, "contains", lambda: backend.contains(keyspace.key(2))
    )
    if found is not True and not isinstance(found, _Raised):
        violated(
            10,
            f"contains of a stored key returned {found!r} while the server was {state}: an outage "
            "must raise BackendTimeout or BackendUnavailable, not answer",
        )
    _during_outage(run, deadline, state, "put", lambda: backend.put(keyspace.key(4), new))


def _once_back(run: Run, deadline: float, back: str, what: str, operation: Operation) -> Any:
    """Retry ``operation`` while it raises BackendUnavailable, until RECOVERY_LIMIT seconds
    after the server came back; return its result."""
    started = time.monotonic()
    while True:
        try:
            return run(operation(), timeout=deadline + lifecycle.HANG_MARGIN)
        except BackendUnavailable as error:
            last: BackendUnavailable = error
        except ContractTimeout:
            violated(10, f"{what} hung after the server {back}")
        except Exception as error:
            violated(
                10,
                f"{what} raised {type(error).__name__}: {error} after the server {back}; expected "
                "a result, or BackendUnavailable while the backend reconnects",
            )
        recovery_limit = lifecycle.RECOVERY_LIMIT
        if time.monotonic() - started > recovery_limit:
            violated(
                10,
                f"{what} still failed {recovery_limit:.0f} s after the server {back}, without the "
                f"backend being reopened: {type(last).__name__}: {last}",
            )
        time.sleep(0.2)


def _check_not_other(number: int, got: MemoryObj, other: MemoryObj, what: str) -> None:
    if difference(other, got) is None:
        got.release()
        violated(
            number,
            f"{what} returned the object stored under another key: a late reply to a request "
            "that timed out during the outage was taken as this request's reply",
        )


def _store_then_outage(
    run: Run,
    backend: Backend,
    deadline: float,
    keyspace: Keyspace,
    objs: list[MemoryObj],
    down: Callable[[], None],
    up: Callable[[], None],
    state: str,
) -> None:
    """Store ``objs[0]`` and ``objs[1]`` under keys 1 and 2, take the server down, check one
    round of operations against the deadline (putting ``objs[2]``), and bring it back."""
    run(backend.put(keyspace.key(1), objs[0]))
    run(backend.put(keyspace.key(2), objs[1]))
    down()
    try:
        _outage_round(run, backend, deadline, state, keyspace, objs[1], objs[2])
    finally:
        up()


class DeadlineContract:
    """Clause 10: remote operations have deadlines, never hang, and recover without a reopen.

    Needs the ``server_control`` fixture (see :class:`ServerControl`); without it the clause is
    n/a. The tests open their own backend with ``timeout=2`` unless the URL or
    ``--kvplug-option`` sets ``timeout``; an operation may take that deadline plus
    ``DEADLINE_GRACE`` seconds (:mod:`~kvplug_contracts.suite.lifecycle`) while the server is
    down.
    """

    @clause(10, central=True)
    def test_while_paused_operations_fail_within_the_deadline_and_recover_after_resume(
        self,
        server_control: object,
        open_contract_backend: Callable[..., Backend],
        kvplug_url: str,
        kvplug_options: dict[str, Any],
        run: Run,
        keyspace: Keyspace,
        allocator: FreeListAllocator,
    ) -> None:
        control = _server(server_control)
        backend = _deadline_backend(open_contract_backend, kvplug_url, kvplug_options)
        deadline = _deadline(backend)
        objs = [make_obj(allocator, SHAPE, seed=s) for s in (30, 31, 32, 33)]
        first, second, _, later = objs
        try:
            _store_then_outage(
                run, backend, deadline, keyspace, objs, control.pause, control.resume, "paused"
            )
            back = "resumed"
            got = _once_back(run, deadline, back, "get", lambda: backend.get(keyspace.key(1)))
            if got is not None:
                _check_not_other(10, got, second, "get after the server resumed")
            try:
                check_same(10, first, got, "get of a key stored before the pause")
            finally:
                release_all([got])
            if run(backend.contains(keyspace.key(3))):
                violated(10, "after the server resumed, contains of a key never stored is True")
            _once_back(run, deadline, back, "put", lambda: backend.put(keyspace.key(5), later))
            got = run(backend.get(keyspace.key(5)))
            try:
                check_same(10, later, got, "get of a key put after the server resumed")
            finally:
                release_all([got])
        finally:
            release_all(objs)

    @clause(10, central=True)
    def test_while_stopped_operations_fail_fast_and_recover_after_restart(
        self,
        server_control: object,
        open_contract_backend: Callable[..., Backend],
        kvplug_url: str,
        kvplug_options: dict[str, Any],
        run: Run,
        keyspace: Keyspace,
        allocator: FreeListAllocator,
    ) -> None:
        control = _server(server_control)
        backend = _deadline_backend(open_contract_backend, kvplug_url, kvplug_options)
        deadline = _deadline(backend)
        objs = [make_obj(allocator, SHAPE, seed=s) for s in (40, 41, 42, 43)]
        first, second, _, later = objs
        try:
            _store_then_outage(
                run, backend, deadline, keyspace, objs, control.stop, control.start, "stopped"
            )
            back = "restarted"
            _once_back(run, deadline, back, "put", lambda: backend.put(keyspace.key(5), later))
            got = _once_back(run, deadline, back, "get", lambda: backend.get(keyspace.key(5)))
            try:
                check_same(10, later, got, "get of a key put after the server restarted")
            finally:
                release_all([got])
            # The restart may have lost older data; what is still read must be right.
            got = run(backend.get(keyspace.key(1)))
            if got is not None:
                _check_not_other(10, got, second, "get after the server restarted")
                try:
                    check_same(10, first, got, "get of a key stored before the restart")
                finally:
                    got.release()
        finally:
            release_all(objs)


__all__ = ["DeadlineContract", "ServerControl"]
