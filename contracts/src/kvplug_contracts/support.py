"""What every contract test uses: the clause table, the event-loop runner, test objects and
comparisons that explain a violation."""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import threading
import uuid
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, NoReturn, TypeVar

import pytest
import torch

from kvplug import Backend, CacheKey, MemoryFormat, MemoryObj
from kvplug.memory import Allocator

T = TypeVar("T")
Run = Callable[..., Any]
"""The ``run`` fixture: ``run(coroutine, timeout=None)`` awaits on the suite's loop."""

CLAUSES: dict[int, str] = {
    1: "a miss returns None",
    2: "get after put is bit-identical",
    3: "overwrites are atomic, never torn",
    4: "batched_contains counts the prefix; batched_get is aligned",
    5: "put releases its reference; get returns an owned object; no leaks",
    6: "corrupt stored data reads as a miss, is counted and removed",
    7: "remove of an absent key is False; contains agrees with get",
    8: "pinned keys survive eviction; unpin always succeeds; pins expire",
    9: "a full store raises CapacityExceeded or evicts; reads keep working",
    10: "remote operations have deadlines and recover",
    11: "close is idempotent and bounded; later calls raise BackendClosed",
    12: "keys are isolated per namespace",
    13: "capabilities are honest",
    14: "persistent backends keep data across close and reopen",
    15: "safe under concurrency",
}

DEFAULT_TIMEOUT = 30.0


def clause(*numbers: int) -> pytest.MarkDecorator:
    """Mark a contract test with the clause numbers it checks."""
    for number in numbers:
        if number not in CLAUSES:
            raise ValueError(f"there is no contract clause {number}")
    return pytest.mark.kvplug_clause(*numbers)


def violated(number: int, message: str) -> NoReturn:
    """Fail the running test, naming the clause and what was seen."""
    pytest.fail(f"clause {number} ({CLAUSES[number]}) violated: {message}", pytrace=False)


def not_applicable(reason: str) -> NoReturn:
    """Skip a clause that does not apply to this backend (reported as n/a)."""
    pytest.skip(f"not applicable: {reason}")


class ContractTimeout(AssertionError):
    """An operation did not finish within the suite's own time limit."""


class LoopRunner:
    """One event loop on its own thread. Tests stay synchronous: ``run(coro)`` waits for the
    result with a time limit, so a backend that blocks or hangs fails the test instead of
    hanging the suite."""

    def __init__(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.timeout = timeout
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="kvplug-contract-loop", daemon=True
        )
        self._thread.start()

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        limit = self.timeout if timeout is None else timeout
        future = self.submit(coroutine)
        try:
            return future.result(limit)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise ContractTimeout(
                f"the operation did not finish within {limit} s (the suite's time limit; "
                "change it with --kvplug-timeout)"
            ) from None

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self.loop.close()


class Keyspace:
    """Keys in a namespace of their own, so tests never see each other's data (also on a
    server shared by several runs)."""

    def __init__(self, label: str) -> None:
        digest = hashlib.sha1(label.encode()).hexdigest()[:8]
        self.model = f"kvplug-contract/{digest}-{uuid.uuid4().hex[:12]}"

    def key(self, n: int, *, worker_id: int = 0, world_size: int = 1, **tags: str) -> CacheKey:
        return CacheKey(self.model, world_size, worker_id, n, tags=tuple(tags.items()))

    def keys(self, count: int, start: int = 0) -> list[CacheKey]:
        return [self.key(n) for n in range(start, start + count)]


def make_obj(
    allocator: Allocator,
    shape: Sequence[int],
    dtype: torch.dtype = torch.float16,
    fmt: MemoryFormat = MemoryFormat.KV_2LTD,
    seed: int = 0,
) -> MemoryObj:
    """A new object filled with seeded random bytes (every bit pattern, NaNs included)."""
    obj = allocator.allocate(shape, dtype, fmt)
    if obj is None:
        raise RuntimeError(
            f"the suite's allocator has no room for {tuple(shape)} {dtype}: an earlier step "
            "leaked objects, or the shape is larger than the allocator"
        )
    generator = torch.Generator().manual_seed(seed)
    obj.raw.copy_(torch.randint(0, 256, (obj.nbytes,), dtype=torch.uint8, generator=generator))
    return obj


def difference(expected: MemoryObj, got: MemoryObj) -> str | None:
    """How ``got`` differs from ``expected`` (shape, dtype, format, bytes), or None."""
    if got.shape != expected.shape:
        return f"shape {got.shape}, expected {expected.shape}"
    if got.dtype != expected.dtype:
        return f"dtype {got.dtype}, expected {expected.dtype}"
    if got.fmt != expected.fmt:
        return f"format {got.fmt.name}, expected {expected.fmt.name}"
    got_bytes = got.raw.cpu()
    expected_bytes = expected.raw.cpu()
    if not torch.equal(got_bytes, expected_bytes):
        mismatch = (got_bytes != expected_bytes).nonzero()
        first = int(mismatch[0])
        return (
            f"{len(mismatch)} of {expected.nbytes} bytes differ; first at byte {first}: "
            f"got {int(got_bytes[first])}, expected {int(expected_bytes[first])}"
        )
    return None


def check_same(number: int, expected: MemoryObj, got: MemoryObj | None, what: str) -> None:
    """Fail under clause ``number`` unless ``got`` is bit-identical to ``expected``."""
    if got is None:
        violated(number, f"{what}: get returned None (a miss), expected the stored object")
    problem = difference(expected, got)
    if problem is not None:
        violated(number, f"{what}: {problem}")


def layers(backend: Backend) -> list[Backend]:
    """``backend`` and every backend it wraps (through ``inner``), outermost first."""
    chain = [backend]
    while isinstance(getattr(chain[-1], "inner", None), Backend):
        chain.append(chain[-1].inner)  # type: ignore[attr-defined]
    return chain


def innermost(backend: Backend) -> Backend:
    """The backend at the bottom of a ``wrapper::...::url`` chain."""
    return layers(backend)[-1]


def release_all(objs: Sequence[MemoryObj | None]) -> None:
    for obj in objs:
        if obj is not None:
            obj.release()


__all__ = [
    "CLAUSES",
    "ContractTimeout",
    "Keyspace",
    "LoopRunner",
    "Run",
    "check_same",
    "clause",
    "difference",
    "innermost",
    "layers",
    "make_obj",
    "not_applicable",
    "release_all",
    "violated",
]
