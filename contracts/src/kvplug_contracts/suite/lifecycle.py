"""Clauses 10, 11 and 13: deadlines and recovery, close, honest capabilities."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any, Protocol, runtime_checkable

import pytest

from kvplug import (
    Backend,
    BackendClosed,
    BackendUnavailable,
    CacheKey,
    FreeListAllocator,
    KvplugError,
    MemoryObj,
    NotSupported,
)
from kvplug.backend import Wraps, gather_all
from kvplug.url import BackendURL, split_chain
from kvplug_contracts.support import (
    ContractTimeout,
    Keyspace,
    Run,
    check_same,
    clause,
    difference,
    innermost,
    make_obj,
    not_applicable,
    not_run,
    release_all,
    violated,
)

Operation = Callable[[], Coroutine[Any, Any, object]]

SHAPE = (2, 1, 16, 64)

DEADLINE_UNDER_TEST = 2.0
"""The ``timeout`` option of the backend the deadline tests open, unless the URL or
``--kvplug-option`` sets one: a short deadline keeps an outage test to seconds."""
DEADLINE_GRACE = 2.0
"""Seconds an operation may take beyond the backend's own deadline while the server is down."""
HANG_MARGIN = 5.0
"""Seconds beyond the deadline after which the suite stops waiting: the operation hangs."""
RECOVERY_LIMIT = 10.0
"""Seconds after the server is back within which operations must succeed again."""
CLOSE_LIMIT = 5.0
"""Seconds ``close`` may take, also with operations in flight, and those operations after it."""
IN_FLIGHT = 50


# -- clause 10 -------------------------------------------------------------------------------


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
    return open_contract_backend(timeout=DEADLINE_UNDER_TEST)


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
    limit = deadline + DEADLINE_GRACE
    started = time.monotonic()
    try:
        result = run(operation(), timeout=deadline + HANG_MARGIN)
    except ContractTimeout:
        violated(
            10,
            f"{what} hung while the server was {state}: no result and no error within "
            f"{deadline + HANG_MARGIN:.1f} s (the backend's deadline is {deadline:.1f} s)",
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
            return run(operation(), timeout=deadline + HANG_MARGIN)
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
        if time.monotonic() - started > RECOVERY_LIMIT:
            violated(
                10,
                f"{what} still failed {RECOVERY_LIMIT:.0f} s after the server {back}, without the "
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
    ``DEADLINE_GRACE`` seconds while the server is down.
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


# -- clause 11 -------------------------------------------------------------------------------


def _close_within(run: Run, backend: Backend, what: str) -> None:
    try:
        run(backend.close(), timeout=CLOSE_LIMIT)
    except ContractTimeout:
        violated(11, f"{what} did not finish within {CLOSE_LIMIT:g} s")
    except Exception as error:
        violated(11, f"{what} raised {type(error).__name__}: {error}")


async def _listed(backend: Backend) -> list[CacheKey]:
    return [key async for key in backend.list_keys()]


async def _cancel_and_wait(tasks: list[asyncio.Task[Any]], limit: float) -> None:
    """Cancel the tasks not done yet and wait up to ``limit`` seconds for them to end."""
    running = [task for task in tasks if not task.done()]
    for task in running:
        task.cancel()
    if running:
        await asyncio.wait(running, timeout=limit)


def _release_result(result: object) -> None:
    if isinstance(result, MemoryObj):
        result.release()
    elif isinstance(result, list):
        release_all([r for r in result if isinstance(r, MemoryObj)])


class CloseContract:
    """Clause 11: ``close`` is idempotent and bounded, even with operations in flight; every
    later operation raises BackendClosed."""

    @clause(11)
    def test_close_twice_and_concurrently_is_fine(
        self, open_contract_backend: Callable[..., Backend], run: Run
    ) -> None:
        backend = open_contract_backend()
        _close_within(run, backend, "the first close")
        _close_within(run, backend, "a second close of a closed backend")
        other = open_contract_backend()

        async def close_together() -> None:
            await gather_all([other.close(), other.close(), other.close()])

        try:
            run(close_together(), timeout=CLOSE_LIMIT)
        except ContractTimeout:
            violated(11, f"three concurrent closes did not finish within {CLOSE_LIMIT:g} s")
        except Exception as error:
            violated(11, f"three concurrent closes raised {type(error).__name__}: {error}")

    @clause(11)
    def test_every_operation_after_close_raises_backend_closed(
        self,
        open_contract_backend: Callable[..., Backend],
        run: Run,
        keyspace: Keyspace,
        allocator: FreeListAllocator,
    ) -> None:
        backend = open_contract_backend()
        obj = make_obj(allocator, SHAPE, seed=50)
        key, absent = keyspace.key(1), keyspace.key(2)
        try:
            run(backend.put(key, obj))
            _close_within(run, backend, "close")
            capabilities = backend.capabilities
            operations: dict[str, Operation] = {
                "get": lambda: backend.get(key),
                "put": lambda: backend.put(absent, obj),
                "contains": lambda: backend.contains(key),
                "remove": lambda: backend.remove(key),
                "batched_get": lambda: backend.batched_get([key, absent]),
                "batched_put": lambda: backend.batched_put([absent], [obj]),
                "batched_contains": lambda: backend.batched_contains([key, absent]),
            }
            if capabilities.pin:
                operations["pin"] = lambda: backend.pin(key)
                operations["unpin"] = lambda: backend.unpin(key)
            if capabilities.list_keys:
                operations["list_keys"] = lambda: _listed(backend)
            wrong: list[str] = []
            for name, operation in operations.items():
                try:
                    result = run(operation(), timeout=CLOSE_LIMIT)
                except BackendClosed:
                    continue
                except NotSupported:
                    if name == "remove" and not capabilities.remove:
                        continue  # either answer is honest for an undeclared capability
                    wrong.append(f"{name} raised NotSupported")
                except ContractTimeout:
                    wrong.append(f"{name} hung (no answer within {CLOSE_LIMIT:g} s)")
                except Exception as error:
                    wrong.append(f"{name} raised {type(error).__name__}: {error}")
                else:
                    _release_result(result)
                    wrong.append(f"{name} returned {result!r}")
            if wrong:
                violated(
                    11,
                    f"after close, {len(wrong)} operation(s) did not raise BackendClosed: "
                    + "; ".join(wrong),
                )
            if obj.ref_count != 1:
                violated(
                    5,
                    f"puts refused after close left the caller's object with ref_count "
                    f"{obj.ref_count}, not 1",
                )
        finally:
            obj.release()

    @clause(11)
    def test_close_with_operations_in_flight_finishes_in_bounded_time(
        self,
        open_contract_backend: Callable[..., Backend],
        run: Run,
        keyspace: Keyspace,
        allocator: FreeListAllocator,
    ) -> None:
        backend = open_contract_backend()
        stored = make_obj(allocator, SHAPE, seed=60)
        news = [make_obj(allocator, SHAPE, seed=61 + i) for i in range(IN_FLIGHT // 2)]
        keys = keyspace.keys(IN_FLIGHT + 1)

        async def operation(i: int) -> MemoryObj | None:
            if i % 2:
                await backend.put(keys[i + 1], news[i // 2])
                return None
            return await backend.get(keys[0])

        tasks: list[asyncio.Task[MemoryObj | None]] = []

        async def scenario() -> tuple[bool, float, int]:
            try:
                tasks.extend(asyncio.ensure_future(operation(i)) for i in range(IN_FLIGHT // 2))
                await asyncio.sleep(0)
                tasks.extend(
                    asyncio.ensure_future(operation(i)) for i in range(IN_FLIGHT // 2, IN_FLIGHT)
                )
                started = time.monotonic()
                try:
                    await asyncio.wait_for(backend.close(), CLOSE_LIMIT)
                    close_finished = True
                except TimeoutError:
                    close_finished = False
                close_seconds = time.monotonic() - started
                _, pending = await asyncio.wait(tasks, timeout=CLOSE_LIMIT)
                return close_finished, close_seconds, len(pending)
            finally:
                # Also when this step is cancelled: no operation outlives the test.
                await _cancel_and_wait(tasks, CLOSE_LIMIT)

        results: list[MemoryObj | None] = []
        try:
            run(backend.put(keys[0], stored))
            try:
                # Each stage of the scenario takes up to CLOSE_LIMIT; one more for a busy machine.
                close_finished, seconds, hung = run(scenario(), timeout=4 * CLOSE_LIMIT)
            except ContractTimeout as timeout:
                pytest.fail(str(timeout), pytrace=False)  # it names the clause and the cause
            finally:
                finished = [t for t in tasks if t.done() and not t.cancelled()]
                results = [t.result() for t in finished if t.exception() is None]
            if not close_finished:
                violated(
                    11,
                    f"close with {IN_FLIGHT} operations in flight did not finish within "
                    f"{CLOSE_LIMIT:g} s",
                )
            if hung:
                violated(
                    11,
                    f"{hung} of {IN_FLIGHT} operations in flight had neither a result nor an "
                    f"error {CLOSE_LIMIT:g} s after close returned (in {seconds:.2f} s)",
                )
            strange = [
                error
                for t in finished
                if (error := t.exception()) is not None and not isinstance(error, KvplugError)
            ]
            if strange:
                violated(
                    11,
                    f"{len(strange)} operation(s) in flight during close raised errors outside "
                    f"kvplug.errors, e.g. {type(strange[0]).__name__}: {strange[0]}; "
                    "expected a result or BackendClosed",
                )
            for got in results:
                if got is not None:
                    check_same(11, stored, got, "a get in flight during close returned data")
        finally:
            release_all([*results, stored, *news])


# -- clause 13 -------------------------------------------------------------------------------


def _not_supported(run: Run, capability: str, what: str, operation: Operation) -> None:
    """``operation`` must raise NotSupported, since ``capability`` is not declared."""
    try:
        result = run(operation())
    except NotSupported:
        return
    except Exception as error:
        violated(
            13,
            f"'{capability}' is not declared, so {what} must raise NotSupported; it raised "
            f"{type(error).__name__}: {error}",
        )
    _release_result(result)
    violated(
        13,
        f"'{capability}' is not declared, so {what} must raise NotSupported; it returned "
        f"{result!r}",
    )


def _works(run: Run, capability: str, what: str, operation: Operation) -> Any:
    """``operation`` must work, since ``capability`` is declared."""
    try:
        return run(operation())
    except NotSupported as error:
        violated(13, f"the backend declares '{capability}' but {what} raised NotSupported: {error}")
    except Exception as error:
        violated(
            13,
            f"the backend declares '{capability}' but {what} raised "
            f"{type(error).__name__}: {error}",
        )


class CapabilityContract:
    """Clause 13: a declared capability works; an undeclared one raises NotSupported.

    ``persistent`` is checked by the persistence clause (14).
    """

    @clause(13)
    def test_pin_and_unpin_match_the_pin_capability(
        self, backend: Backend, run: Run, keyspace: Keyspace, allocator: FreeListAllocator
    ) -> None:
        key, absent = keyspace.key(1), keyspace.key(2)
        if not backend.capabilities.pin:
            _not_supported(run, "pin", "pin", lambda: backend.pin(key))
            _not_supported(run, "pin", "unpin", lambda: backend.unpin(key))
            return
        obj = make_obj(allocator, SHAPE, seed=70)
        try:
            run(backend.put(key, obj))
        finally:
            obj.release()
        present = run(backend.contains(key))
        expected = {
            "pin of a stored key": (lambda: backend.pin(key), present),
            "unpin of that key": (lambda: backend.unpin(key), present),
            "pin of a key never stored": (lambda: backend.pin(absent), False),
            "unpin of a key never stored": (lambda: backend.unpin(absent), False),
        }
        for what, (operation, want) in expected.items():
            answer = _works(run, "pin", what, operation)
            if not isinstance(answer, bool) or answer != want:
                violated(
                    13, f"the backend declares 'pin'; {what} returned {answer!r}, expected {want}"
                )

    @clause(13)
    def test_list_keys_matches_the_list_capability(
        self, backend: Backend, run: Run, keyspace: Keyspace, allocator: FreeListAllocator
    ) -> None:
        if not backend.capabilities.list_keys:
            _not_supported(run, "list_keys", "list_keys", lambda: _listed(backend))
            return
        keys = keyspace.keys(3)
        obj = make_obj(allocator, SHAPE, seed=71)
        try:
            run(backend.batched_put(keys, [obj] * 3))
        finally:
            obj.release()
        stored = {key for key in keys if run(backend.contains(key))}
        listed = _works(run, "list_keys", "list_keys", lambda: _listed(backend))
        foreign = [key for key in listed if not isinstance(key, CacheKey)]
        if foreign:
            violated(13, f"list_keys yielded {foreign[0]!r}, which is not a CacheKey")
        mine = {key for key in listed if key.model_name == keyspace.model}
        if mine != stored:
            violated(
                13,
                f"list_keys yielded chunk hashes {sorted(k.chunk_hash_hex for k in mine)} of this "
                f"test's keys; stored (contains is True): "
                f"{sorted(k.chunk_hash_hex for k in stored)}",
            )

    @clause(13)
    def test_remove_matches_the_remove_capability(
        self, backend: Backend, run: Run, keyspace: Keyspace, allocator: FreeListAllocator
    ) -> None:
        key = keyspace.key(1)
        obj = make_obj(allocator, SHAPE, seed=72)
        try:
            run(backend.put(key, obj))
        finally:
            obj.release()
        if not backend.capabilities.remove:
            _not_supported(run, "remove", "remove of a stored key", lambda: backend.remove(key))
            _not_supported(
                run,
                "remove",
                "remove of a key never stored",
                lambda: backend.remove(keyspace.key(2)),
            )
            return
        present = run(backend.contains(key))
        removed = _works(run, "remove", "remove", lambda: backend.remove(key))
        if removed is not present:
            violated(
                13,
                f"the backend declares 'remove'; remove of a key whose contains is {present} "
                f"returned {removed!r}",
            )
        got = run(backend.get(key))
        if got is not None or run(backend.contains(key)):
            release_all([got])
            violated(13, "the backend declares 'remove' but the key is still there after remove")

    @clause(13)
    def test_objects_are_in_host_memory_without_device_memory(
        self, backend: Backend, run: Run, keyspace: Keyspace, allocator: FreeListAllocator
    ) -> None:
        if backend.capabilities.device_memory:
            not_applicable("the backend declares 'device_memory': get may return GPU memory")
        keys = keyspace.keys(2)
        obj = make_obj(allocator, SHAPE, seed=73)
        try:
            run(backend.batched_put(keys, [obj, obj]))
        finally:
            obj.release()
        got = [run(backend.get(keys[0])), *run(backend.batched_get(keys))]
        try:
            returned = [g for g in got if g is not None]
            if not returned:
                not_applicable("the backend kept none of the objects put; nothing to inspect")
            devices = sorted({str(g.device) for g in returned if g.device.type != "cpu"})
            if devices:
                violated(
                    13,
                    f"'device_memory' is not declared, but get returned objects on {devices}",
                )
        finally:
            release_all(got)

    @clause(5, 13)
    def test_get_results_stay_intact_when_the_key_changes_or_the_backend_closes(
        self,
        open_contract_backend: Callable[..., Backend],
        run: Run,
        keyspace: Keyspace,
        allocator: FreeListAllocator,
    ) -> None:
        """What makes ``zero_copy`` honest (and every other backend correct): an object get
        returned is the caller's, whatever happens to the key or the backend afterwards."""
        backend = open_contract_backend()
        key = keyspace.key(1)
        first = make_obj(allocator, SHAPE, seed=74)
        second = make_obj(allocator, SHAPE, seed=75)
        expected = MemoryObj(first.raw.clone(), first.shape, first.dtype, first.fmt)
        got: MemoryObj | None = None
        try:
            run(backend.put(key, first))
            got = run(backend.get(key))
            if got is None:
                not_applicable("the backend kept nothing that was put; nothing to inspect")
            run(backend.put(key, second))
            if backend.capabilities.remove:
                run(backend.remove(key))
            run(backend.close())
            if not got.is_valid:
                violated(5, "an object returned by get was freed when the key changed or closed")
            problem = difference(expected, got)
            if problem is not None:
                violated(
                    5,
                    "an object returned by get changed after its key was overwritten, removed "
                    f"and the backend closed: {problem}",
                )
        finally:
            release_all([got, first, second])

    @clause(13)
    def test_native_batching_overrides_the_batched_operations(self, backend: Backend) -> None:
        if not backend.capabilities.native_batching:
            not_applicable("the backend does not declare 'native_batching'")
        inner = type(innermost(backend))
        defaults = inner.missing_hooks("native_batching")
        if defaults:
            violated(
                13,
                f"{inner.__name__} declares 'native_batching' but keeps the per-key default "
                f"of {', '.join(defaults)}",
            )

    @clause(13)
    def test_a_second_backend_sees_the_same_objects_when_shared_across_processes(
        self,
        open_contract_backend: Callable[..., Backend],
        run: Run,
        keyspace: Keyspace,
        allocator: FreeListAllocator,
    ) -> None:
        """Approximated within one process: a second backend opened on the same URL shares no
        Python state with the first, only the store behind the URL."""
        first = open_contract_backend()
        if not first.capabilities.shared_across_processes:
            not_applicable("the backend does not declare 'shared_across_processes'")
        second = open_contract_backend()
        objs = [make_obj(allocator, SHAPE, seed=s) for s in (76, 77)]
        try:
            for writer, reader, n, obj in (
                (first, second, 1, objs[0]),
                (second, first, 2, objs[1]),
            ):
                run(writer.put(keyspace.key(n), obj))
                got = run(reader.get(keyspace.key(n)))
                try:
                    check_same(
                        13,
                        obj,
                        got,
                        "the backend declares 'shared_across_processes'; another backend on the "
                        "same URL read what one put",
                    )
                finally:
                    release_all([got])
        finally:
            release_all(objs)


__all__ = [
    "CLOSE_LIMIT",
    "DEADLINE_GRACE",
    "DEADLINE_UNDER_TEST",
    "RECOVERY_LIMIT",
    "CapabilityContract",
    "CloseContract",
    "DeadlineContract",
    "ServerControl",
]
