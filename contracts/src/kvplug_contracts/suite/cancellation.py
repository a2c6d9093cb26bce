"""Clause 13 for ``releases_on_cancel``: a cancelled operation has let go of the caller's
memory by the time its cancellation has finished, and never touches it afterwards.

Engines lend such a backend their own buffers and reuse a buffer as soon as a job past its
deadline is reported failed; a backend that keeps reading or writing it after the cancellation
would store an engine's later bytes under the old key, or write stale bytes into memory the
engine has handed to another request. The buffers here are plain torch memory, as an engine's
are, not the suite's allocator's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any

import torch

from kvplug import Backend, BackendUnavailable, MemoryObj
from kvplug.runtime.engine import keeps_objects
from kvplug_contracts.suite.lifecycle import ServerControl
from kvplug_contracts.support import (
    Keyspace,
    Run,
    clause,
    not_applicable,
    violated,
)

SHAPE = (2, 8, 256, 512)
"""fp16: 8 MiB, enough for a transfer to be under way when it is cancelled."""
CANCEL_POINTS = (0, 1, 2, 5, 20)
"""Event-loop iterations an operation runs before it is cancelled."""
PAUSED_FOR = 0.2
"""Seconds an operation runs against a paused server before it is cancelled."""
SETTLE = 0.3
"""Seconds the suite waits after a cancellation for anything the backend still does."""
SENTINEL = 0x5A
RECOVERY_TRIES = 50
"""Reads tried, 0.2 s apart, while the backend reconnects after the server was paused."""


def engine_buffer(seed: int) -> MemoryObj:
    """A buffer of the caller's own (torch memory), filled with seeded random bytes."""
    generator = torch.Generator().manual_seed(seed)
    nbytes = torch.Size(SHAPE).numel() * 2
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)
    return MemoryObj.from_tensor(data.view(torch.float16).view(SHAPE))


async def _cancelled(
    operation: Coroutine[Any, Any, object],
    objs: list[MemoryObj],
    *,
    iterations: int = 0,
    seconds: float = 0.0,
) -> list[int]:
    """Run ``operation``, cancel it after ``iterations`` loop iterations (or ``seconds``), await
    its end, and return the reference counts of ``objs`` at once."""
    task = asyncio.ensure_future(operation)
    for _ in range(iterations):
        await asyncio.sleep(0)
    if seconds:
        await asyncio.sleep(seconds)
    task.cancel()
    # Ended, failed or cancelled: what matters here is the caller's memory.
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    return [obj.ref_count for obj in objs]


def _applies(backend: Backend) -> None:
    if not backend.capabilities.releases_on_cancel:
        not_applicable("the backend does not declare 'releases_on_cancel'")


def _borrows_puts(backend: Backend) -> bool:
    """Whether a put only borrows the caller's memory: a backend that keeps the objects it is
    given (a host-memory tier, a Store that writes behind) makes them its stored values, so
    engines hand it copies and its puts are not checked here."""
    return not keeps_objects(backend)


def _check_released(counts: list[int], what: str) -> None:
    held = [n - 1 for n in counts if n != 1]
    if held:
        violated(
            13,
            f"{what}: right after the cancelled operation ended the backend still held "
            f"{sum(held)} reference(s) to the caller's memory; a backend declaring "
            "'releases_on_cancel' must let go before its cancellation finishes (hand worker "
            "threads a kvplug.lease.Lease and await its revoke() on cancellation)",
        )


def _check_untouched(dests: list[MemoryObj], what: str) -> None:
    for dest in dests:
        if not bool((dest.raw == SENTINEL).all()):
            violated(
                13,
                f"{what}: the backend wrote into the caller's buffer after the cancelled "
                "get_into had ended (the caller had refilled it)",
            )


def _check_original_or_miss(
    run: Run, backend: Backend, keyspace: Keyspace, pairs: list[tuple[int, torch.Tensor]], what: str
) -> None:
    for number, original in pairs:
        got = run(backend.get(keyspace.key(number)))
        if got is None:
            continue
        try:
            if not torch.equal(got.raw.cpu(), original):
                rewritten = bool((got.raw == SENTINEL).any())
                violated(
                    13,
                    f"{what}: a get returned bytes that are not the ones the caller handed over "
                    + (
                        "(bytes the caller wrote after the cancellation landed under the key)"
                        if rewritten
                        else "(a mix)"
                    ),
                )
        finally:
            got.release()


class CancellationContract:
    """Clause 13 for ``releases_on_cancel`` (n/a where it is not declared): cancelled puts and
    reads into the caller's memory let go of it at once, at every point of the operation, and
    never store or write it afterwards; with ``server_control`` also while the server is
    paused, so that the transfer is surely in flight."""

    @clause(13)
    def test_a_cancelled_get_into_never_writes_the_buffer_afterwards(
        self, open_contract_backend: Callable[..., Backend], run: Run, keyspace: Keyspace
    ) -> None:
        backend = open_contract_backend()
        _applies(backend)
        stored = engine_buffer(90)
        run(backend.put(keyspace.key(1), stored))
        for point in CANCEL_POINTS:
            dests = [engine_buffer(91)]
            counts = run(
                _cancelled(backend.get_into(keyspace.key(1), dests[0]), dests, iterations=point)
            )
            _check_released(counts, f"get_into cancelled after {point} loop iterations")
            dests[0].raw.fill_(SENTINEL)
            run(asyncio.sleep(SETTLE))
            _check_untouched(dests, f"get_into cancelled after {point} loop iterations")
        keys = [keyspace.key(1), keyspace.key(1), keyspace.key(2)]
        dests = [engine_buffer(92 + n) for n in range(3)]
        counts = run(_cancelled(backend.batched_get_into(keys, dests), dests, iterations=2))
        _check_released(counts, "batched_get_into cancelled after 2 loop iterations")
        for dest in dests:
            dest.raw.fill_(SENTINEL)
        run(asyncio.sleep(SETTLE))
        _check_untouched(dests, "batched_get_into cancelled after 2 loop iterations")

    @clause(13)
    def test_a_cancelled_put_never_stores_what_the_caller_wrote_afterwards(
        self, open_contract_backend: Callable[..., Backend], run: Run, keyspace: Keyspace
    ) -> None:
        backend = open_contract_backend()
        _applies(backend)
        if not _borrows_puts(backend):
            not_applicable(
                "the backend keeps the objects it is given (zero_copy, or a Store that writes "
                "behind): they become its stored values, so callers hand it copies"
            )
        pairs: list[tuple[int, torch.Tensor]] = []
        for n, point in enumerate(CANCEL_POINTS):
            source = engine_buffer(100 + n)
            pairs.append((10 + n, source.raw.clone()))
            counts = run(
                _cancelled(backend.put(keyspace.key(10 + n), source), [source], iterations=point)
            )
            _check_released(counts, f"put cancelled after {point} loop iterations")
            source.raw.fill_(SENTINEL)  # the caller reuses its buffer at once
        sources = [engine_buffer(120 + n) for n in range(3)]
        pairs += [(30 + n, source.raw.clone()) for n, source in enumerate(sources)]
        keys = [keyspace.key(30 + n) for n in range(3)]
        counts = run(_cancelled(backend.batched_put(keys, sources), sources, iterations=2))
        _check_released(counts, "batched_put cancelled after 2 loop iterations")
        for source in sources:
            source.raw.fill_(SENTINEL)
        run(asyncio.sleep(SETTLE))
        _check_original_or_miss(run, backend, keyspace, pairs, "after a cancelled put")

    @clause(13)
    def test_operations_cancelled_while_the_server_is_paused_let_go_and_stay_away(
        self,
        server_control: object,
        open_contract_backend: Callable[..., Backend],
        run: Run,
        keyspace: Keyspace,
    ) -> None:
        backend = open_contract_backend()
        _applies(backend)
        if not isinstance(server_control, ServerControl):
            not_applicable(
                "no server to pause (pass --kvplug-proxy or override server_control); the "
                "cancellation points above were checked"
            )
        stored = engine_buffer(130)
        run(backend.put(keyspace.key(1), stored))
        dest, source = engine_buffer(131), engine_buffer(132)
        original = source.raw.clone()
        server_control.pause()
        try:
            counts = run(
                _cancelled(backend.get_into(keyspace.key(1), dest), [dest], seconds=PAUSED_FOR)
            )
            _check_released(counts, "get_into cancelled while the server was paused")
            if _borrows_puts(backend):
                counts = run(
                    _cancelled(backend.put(keyspace.key(2), source), [source], seconds=PAUSED_FOR)
                )
                _check_released(counts, "put cancelled while the server was paused")
            dest.raw.fill_(SENTINEL)
            source.raw.fill_(SENTINEL)
        finally:
            server_control.resume()
        run(asyncio.sleep(SETTLE))
        _check_untouched([dest], "get_into cancelled while the server was paused")
        for _ in range(RECOVERY_TRIES):  # the backend reconnects after the pause
            try:
                _check_original_or_miss(
                    run, backend, keyspace, [(2, original)], "put cancelled while paused"
                )
                break
            except BackendUnavailable:
                run(asyncio.sleep(0.2))


__all__ = ["CancellationContract"]
