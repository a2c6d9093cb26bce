"""Clause 11: ``close`` is idempotent and bounded, even with operations in flight, and every
later operation raises BackendClosed. How long the suite waits is set in
:mod:`kvplug_contracts.suite.lifecycle`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

from kvplug import Backend, BackendClosed, FreeListAllocator, KvplugError, MemoryObj, NotSupported
from kvplug.backend import gather_all
from kvplug_contracts.suite import lifecycle
from kvplug_contracts.suite.operations import SHAPE, Operation, listed_keys, release_result
from kvplug_contracts.support import (
    ContractTimeout,
    Keyspace,
    Run,
    check_same,
    clause,
    make_obj,
    release_all,
    violated,
)

IN_FLIGHT = 50
"""Operations in flight while ``close`` runs."""


def _close_within(run: Run, backend: Backend, what: str) -> None:
    try:
        run(backend.close(), timeout=lifecycle.CLOSE_LIMIT)
    except ContractTimeout:
        violated(11, f"{what} did not finish within {lifecycle.CLOSE_LIMIT:g} s")
    except Exception as error:
        violated(11, f"{what} raised {type(error).__name__}: {error}")


async def _cancel_and_wait(tasks: list[asyncio.Task[Any]], limit: float) -> None:
    """Cancel the tasks not done yet and wait up to ``limit`` seconds for them to end."""
    running = [task for task in tasks if not task.done()]
    for task in running:
        task.cancel()
    if running:
        await asyncio.wait(running, timeout=limit)


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
            run(close_together(), timeout=lifecycle.CLOSE_LIMIT)
        except ContractTimeout:
            violated(
                11, f"three concurrent closes did not finish within {lifecycle.CLOSE_LIMIT:g} s"
            )
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
                operations["list_keys"] = lambda: listed_keys(backend)
            wrong: list[str] = []
            for name, operation in operations.items():
                try:
                    result = run(operation(), timeout=lifecycle.CLOSE_LIMIT)
                except BackendClosed:
                    continue
                except NotSupported:
                    if name == "remove" and not capabilities.remove:
                        continue  # either answer is honest for an undeclared capability
                    wrong.append(f"{name} raised NotSupported")
                except ContractTimeout:
                    wrong.append(f"{name} hung (no answer within {lifecycle.CLOSE_LIMIT:g} s)")
                except Exception as error:
                    wrong.append(f"{name} raised {type(error).__name__}: {error}")
                else:
                    release_result(result)
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
                    await asyncio.wait_for(backend.close(), lifecycle.CLOSE_LIMIT)
                    close_finished = True
                except TimeoutError:
                    close_finished = False
                close_seconds = time.monotonic() - started
                _, pending = await asyncio.wait(tasks, timeout=lifecycle.CLOSE_LIMIT)
                return close_finished, close_seconds, len(pending)
            finally:
                # Also when this step is cancelled: no operation outlives the test.
                await _cancel_and_wait(tasks, lifecycle.CLOSE_LIMIT)

        results: list[MemoryObj | None] = []
        try:
            run(backend.put(keys[0], stored))
            try:
                # Each stage of the scenario takes up to CLOSE_LIMIT; one more for a busy machine.
                close_finished, seconds, hung = run(scenario(), timeout=4 * lifecycle.CLOSE_LIMIT)
            except ContractTimeout as timeout:
                pytest.fail(str(timeout), pytrace=False)  # it names the clause and the cause
            finally:
                finished = [t for t in tasks if t.done() and not t.cancelled()]
                results = [t.result() for t in finished if t.exception() is None]
            if not close_finished:
                violated(
                    11,
                    f"close with {IN_FLIGHT} operations in flight did not finish within "
                    f"{lifecycle.CLOSE_LIMIT:g} s",
                )
            if hung:
                violated(
                    11,
                    f"{hung} of {IN_FLIGHT} operations in flight had neither a result nor an "
                    f"error {lifecycle.CLOSE_LIMIT:g} s after close returned (in {seconds:.2f} s)",
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


__all__ = ["CloseContract"]
