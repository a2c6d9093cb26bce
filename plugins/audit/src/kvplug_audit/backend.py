"""The ``audit`` wrapper: logs every operation of any backend, checks that what comes back is
what went in, and injects faults on request.

It is written before the URL it wraps, with its own options in its own query::

    audit::redis://cache-1:6379
    audit://?fail_rate=0.25&seed=7&fail_ops=get,put::cpu://?max_size=1GiB

Options:

* ``verify`` (default true): remember the xxh3-64 checksum of every payload put, recompute it
  on every hit and compare. A mismatch is logged as an error, counted in
  :attr:`AuditBackend.corrupt_objects`, removed from the inner store (when it can delete) and
  answered as a miss, never as data.
* ``fail_rate`` (0 to 1, default 0): the fraction of operations that raise
  :class:`~kvplug.errors.BackendUnavailable` before reaching the inner backend.
* ``fail_ops``: the operations that may fail, a comma list of ``get``, ``put``, ``contains``,
  ``remove``, ``batched_get``, ``batched_put``, ``batched_contains`` (default: all).
* ``seed``: seed of the fault generator, for reproducible runs.
* ``delay`` (seconds, default 0): how long each operation of ``delay_ops`` waits before it
  reaches the inner backend: a slow store, for deadline and engine-boundary tests. The wait is
  cancellable, like any wait on a slow server.
* ``delay_ops``: the operations that are delayed, a comma list like ``fail_ops`` (default: all).
  A ``get_into`` is read through ``get`` and is delayed as ``get``.
* ``log_level`` (default ``INFO``): level of the per-operation lines on logger
  ``kvplug.audit``.
* ``max_tracked_keys`` (default 100000): how many keys' checksums are remembered. Beyond it the
  least recently used idle key is forgotten (counted in :attr:`AuditBackend.untracked_keys`)
  and its next hit reads as unverified, so memory stays bounded however many keys pass.

Each operation logs one line, for example::

    op=get key=llama@1@0@2a@half size=65536 latency_ms=0.012 outcome=hit backend=cpu://

with ``outcome`` one of ``hit``, ``miss``, ``ok``, ``corrupt``, ``injected`` or
``error:<ExceptionName>``. URLs are logged as ``str(url)`` shows them: password and
secret-named query values masked (:mod:`kvplug.secrets`).

Example::

    >>> import asyncio, torch, kvplug
    >>> async def main():
    ...     audited = await kvplug.open_backend("audit::cpu://?max_size=64MiB")
    ...     key = kvplug.CacheKey("llama", 1, 0, 42)
    ...     await audited.put(key, kvplug.MemoryObj.from_tensor(torch.ones(8)))
    ...     hit = await audited.get(key)
    ...     hit.release()
    ...     await audited.close()
    ...     return audited.stats()["get"]
    >>> asyncio.run(main())
    {'hit': 1}
"""

from __future__ import annotations

import asyncio
import difflib
import itertools
import logging
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from pydantic import Field, ValidationInfo, field_validator

from kvplug.backend import Backend, BackendOptions, Wrapper
from kvplug.damage import DamagedValues
from kvplug.errors import BackendUnavailable, ConfigError
from kvplug.frame import payload_checksum
from kvplug.keys import CacheKey
from kvplug.memory import Allocator, MemoryObj
from kvplug.url import BackendURL

T = TypeVar("T")

LOGGER_NAME = "kvplug.audit"
FAULT_OPS: tuple[str, ...] = (
    "get",
    "put",
    "contains",
    "remove",
    "batched_get",
    "batched_put",
    "batched_contains",
)

logger = logging.getLogger(LOGGER_NAME)


class AuditOptions(BackendOptions):
    """Options of the ``audit`` wrapper (given in its own URL query)."""

    verify: bool = Field(True, description="checksum every put and verify every hit")
    fail_rate: float = Field(
        0.0, ge=0.0, le=1.0, description="fraction of operations that raise BackendUnavailable"
    )
    fail_ops: frozenset[str] = Field(
        frozenset(FAULT_OPS), description="comma list of the operations that may fail"
    )
    seed: int | None = Field(None, description="seed of the fault generator")
    delay: float = Field(
        0.0, ge=0.0, description="seconds each operation of delay_ops waits before the inner one"
    )
    delay_ops: frozenset[str] = Field(
        frozenset(FAULT_OPS), description="comma list of the operations that are delayed"
    )
    log_level: str = Field("INFO", description="level of the per-operation log lines")
    max_tracked_keys: int = Field(
        100_000, ge=1, description="keys whose checksums are remembered (least recent dropped)"
    )

    @field_validator("fail_ops", "delay_ops", mode="before")
    @classmethod
    def _parse_ops(cls, value: object, info: ValidationInfo) -> frozenset[str]:
        if isinstance(value, str):
            names = [name.strip() for name in value.split(",") if name.strip()]
        elif isinstance(value, Iterable):
            names = [str(name).strip() for name in value]
        else:
            raise ConfigError(
                f"{info.field_name} must be a comma list such as 'get,put', got {value!r}."
            )
        for name in names:
            if name not in FAULT_OPS:
                close = difflib.get_close_matches(name, FAULT_OPS, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise ConfigError(
                    f"{info.field_name} names {name!r}, which is not an operation faults can be "
                    f"injected into.{hint} Use a comma list of: {', '.join(FAULT_OPS)}."
                )
        return frozenset(names)

    @field_validator("log_level", mode="before")
    @classmethod
    def _check_log_level(cls, value: object) -> str:
        name = value.strip().upper() if isinstance(value, str) else ""
        if not isinstance(logging.getLevelName(name), int):
            raise ConfigError(
                f"log_level {value!r} is not a logging level. "
                "Use DEBUG, INFO, WARNING, ERROR or CRITICAL."
            )
        return name


@dataclass
class _Expected:
    """What a key may legitimately hold: the checksums of the puts that may have won."""

    sums: set[int] = field(default_factory=set)
    writers: int = 0
    readers: int = 0
    overlapped: bool = False
    puts: int = 0
    """Puts begun so far, so a read can tell whether one raced with it."""


def _checksum(obj: MemoryObj) -> int:
    if obj.device.type == "cpu":
        return payload_checksum(obj.memoryview())
    return payload_checksum(obj.raw.cpu().numpy().data)


class AuditBackend(Wrapper):
    """A wrapper that audits the backend it wraps: logs, verifies, injects faults.

    Constructed by :func:`kvplug.open_backend` for ``audit::<url>`` with the wrapped backend as
    ``inner``; its options come from its own query (see the module documentation). Every
    operation, batched ones included, is forwarded to the same operation of ``inner``, so
    native batching is kept; ``open``, ``close``, ``pin``, ``unpin`` and ``list_keys`` are
    passed through. Its :attr:`capabilities` are exactly the inner backend's.

    Verification accepts, for each key, the checksum of the last put that completed alone;
    while puts or gets of a key overlap, the checksum of every put that may have won is
    accepted, so concurrent writers never cause a false alarm. Keys put before the wrapper
    existed read as unverified hits. The wrapper keeps one small entry per key put, dropped
    when the key is removed or read as a miss.

    Counters: :meth:`stats` (operation -> outcome -> count) and :attr:`corrupt_objects`.
    """

    Options: ClassVar[type[BackendOptions]] = AuditOptions
    options: AuditOptions

    def __init__(
        self,
        url: BackendURL | str,
        *,
        inner: Backend,
        allocator: Allocator | None = None,
        **options: Any,
    ) -> None:
        super().__init__(url, inner=inner, allocator=allocator, **options)
        self._level = int(logging.getLevelName(self.options.log_level))
        self._inner_text = str(inner.url)
        self._rng = random.Random(self.options.seed)
        self._lock = threading.Lock()
        self._expected: OrderedDict[CacheKey, _Expected] = OrderedDict()
        self._counts: dict[str, dict[str, int]] = {}
        self.damaged_values = DamagedValues[CacheKey](
            self.url,
            remove=inner.remove if inner.capabilities.remove else None,
            level=logging.ERROR,
        )
        """Reads that returned other bytes than were put: misses, counted, logged as errors
        and removed from the inner store (when it can delete)."""
        self.untracked_keys = 0
        """Keys forgotten to keep within ``max_tracked_keys``."""

    @property
    def corrupt_objects(self) -> int:
        """:class:`~kvplug.backend.CountsCorruptObjects`: reads that returned other bytes."""
        return self.damaged_values.count

    def stats(self) -> dict[str, dict[str, int]]:
        """Operation -> outcome -> count, e.g. ``{"get": {"hit": 3, "miss": 1}}``."""
        with self._lock:
            return {op: dict(outcomes) for op, outcomes in self._counts.items()}

    @property
    def tracked_keys(self) -> int:
        """Keys whose checksums are remembered now (at most ``max_tracked_keys`` when idle)."""
        with self._lock:
            return len(self._expected)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.url)!r} :: {self._inner_text!r})"

    # -- logging, counting, fault injection --------------------------------------------------

    def _record(
        self, op: str, key: str, size: int, started: float, outcome: str, extra: str = ""
    ) -> None:
        with self._lock:
            outcomes = self._counts.setdefault(op, {})
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
        if logger.isEnabledFor(self._level):
            logger.log(
                self._level,
                "op=%s key=%s size=%d latency_ms=%.3f outcome=%s%s backend=%s",
                op,
                key,
                size,
                (time.perf_counter() - started) * 1000.0,
                outcome,
                extra,
                self._inner_text,
            )

    async def _faults(self, op: str, key: str, size: int, started: float) -> None:
        """Inject what the options ask for ``op``: a failure (``fail_rate``), else a delay."""
        rate = self.options.fail_rate
        if rate <= 0.0 or op not in self.options.fail_ops or self._rng.random() >= rate:
            if self.options.delay and op in self.options.delay_ops:
                await asyncio.sleep(self.options.delay)
            return
        self._record(op, key, size, started, "injected")
        raise BackendUnavailable(
            f"injected fault: audit (fail_rate={rate}) failed {op} of {key} on purpose before "
            f"it reached {self._inner_text}; the store itself was not asked. Set fail_rate=0 or "
            "narrow fail_ops in the audit:// query to stop it."
        )

    async def _audited(
        self,
        op: str,
        key: str,
        call: Callable[[], Awaitable[T]],
        describe: Callable[[T], tuple[str, str]],
        *,
        inject: bool = True,
    ) -> T:
        """Run ``call`` with fault injection, counting and one log line; ``describe`` turns its
        result into ``(outcome, extra log text)``."""
        started = time.perf_counter()
        if inject:
            await self._faults(op, key, 0, started)
        try:
            result = await call()
        except BaseException as error:
            self._record(op, key, 0, started, f"error:{type(error).__name__}")
            raise
        self._record(op, key, 0, started, *describe(result))
        return result

    # -- checksum bookkeeping (see the class docstring) -------------------------------------

    def _track(self, key: CacheKey) -> _Expected:
        """The entry of ``key``, made the most recent; called with the lock held. Idle entries
        (no read or write in flight) are dropped, oldest first, beyond ``max_tracked_keys``."""
        state = self._expected.get(key)
        if state is not None:
            self._expected.move_to_end(key)
            return state
        state = self._expected[key] = _Expected()
        excess = len(self._expected) - self.options.max_tracked_keys
        if excess > 0:
            idle = (
                old_key
                for old_key, old_state in self._expected.items()
                if old_key != key and old_state.readers == 0 and old_state.writers == 0
            )
            for old_key in list(itertools.islice(idle, excess)):
                del self._expected[old_key]
                self.untracked_keys += 1
        return state

    def _begin_put(self, key: CacheKey, checksum: int) -> None:
        with self._lock:
            state = self._track(key)
            state.writers += 1
            state.puts += 1
            if state.writers > 1:
                state.overlapped = True
            # Accepted from the start: the store may hold it before put returns.
            state.sums.add(checksum)

    def _end_put(self, key: CacheKey, checksum: int, ok: bool) -> None:
        with self._lock:
            state = self._expected[key]
            state.writers -= 1
            if ok and not state.overlapped and state.readers == 0:
                state.sums = {checksum}
            if state.writers == 0:
                state.overlapped = False

    def _begin_get(self, key: CacheKey) -> int:
        """Count a read of ``key`` as in flight; returns the put count to pass to _end_get."""
        with self._lock:
            state = self._track(key)
            state.readers += 1
            return state.puts

    def _end_get(
        self, key: CacheKey, checksum: int | None, *, missed_since: int | None = None
    ) -> bool | None:
        """Whether ``checksum`` is one the key may hold; None when nothing is known.
        ``missed_since``: the read missed; forget the key unless a put raced with the read."""
        with self._lock:
            state = self._expected[key]
            state.readers -= 1
            verdict = None if checksum is None or not state.sums else checksum in state.sums
            gone = missed_since is not None and state.puts == missed_since
            if (gone or not state.sums) and state.readers == 0 and state.writers == 0:
                del self._expected[key]
            return verdict

    def _forget(self, key: CacheKey) -> None:
        with self._lock:
            state = self._expected.get(key)
            if state is not None:
                state.sums.clear()
                if state.readers == 0 and state.writers == 0:
                    del self._expected[key]

    async def _checked(self, key: CacheKey, obj: MemoryObj | None, since: int) -> MemoryObj | None:
        """Finish one verified read of ``key`` begun when ``since`` puts had begun: ``obj`` if
        it is what was put, else a miss."""
        if obj is None:
            self._end_get(key, None, missed_since=since)
            return None
        try:
            checksum = _checksum(obj)
        except BaseException:
            self._end_get(key, None)
            obj.release()
            raise
        verdict = self._end_get(key, checksum)
        if verdict is not False:
            return obj
        why = (
            f"checksum mismatch: the {obj.nbytes} bytes {self._inner_text} returned differ from "
            f"what was put (xxh3-64 {checksum:016x}); check the store for corruption or writers "
            "outside kvplug"
        )
        obj.release()
        await self.damaged_values.drop({key: why})
        self._forget(key)
        return None

    # -- the contract ----------------------------------------------------------------------------

    async def _get(self, key: CacheKey) -> MemoryObj | None:
        text = key.to_string()
        started = time.perf_counter()
        await self._faults("get", text, 0, started)
        verify = self.options.verify
        since = self._begin_get(key) if verify else 0
        try:
            obj = await self.inner.get(key)
        except BaseException as error:
            if verify:
                self._end_get(key, None)
            self._record("get", text, 0, started, f"error:{type(error).__name__}")
            raise
        size = obj.nbytes if obj is not None else 0
        result = await self._checked(key, obj, since) if verify else obj
        if obj is not None and result is None:
            outcome = "corrupt"
        else:
            outcome = "miss" if result is None else "hit"
        self._record("get", text, size, started, outcome)
        return result

    async def _put(self, key: CacheKey, obj: MemoryObj) -> None:
        text = key.to_string()
        size = obj.nbytes
        started = time.perf_counter()
        await self._faults("put", text, size, started)
        checksum = _checksum(obj) if self.options.verify else None
        if checksum is not None:
            self._begin_put(key, checksum)
        ok = False
        try:
            await self.inner.put(key, obj)
            ok = True
        except BaseException as error:
            self._record("put", text, size, started, f"error:{type(error).__name__}")
            raise
        finally:
            if checksum is not None:
                self._end_put(key, checksum, ok)
        self._record("put", text, size, started, "ok")

    async def _contains(self, key: CacheKey) -> bool:
        async def call() -> bool:
            return await self.inner.contains(key)

        return await self._audited(
            "contains", key.to_string(), call, lambda found: ("hit" if found else "miss", "")
        )

    async def _remove(self, key: CacheKey) -> bool:
        async def call() -> bool:
            removed = await self.inner.remove(key)
            self._forget(key)
            return removed

        return await self._audited(
            "remove", key.to_string(), call, lambda removed: ("ok" if removed else "miss", "")
        )

    async def _batched_get(self, keys: Sequence[CacheKey]) -> list[MemoryObj | None]:
        text = _batch_text(keys)
        started = time.perf_counter()
        await self._faults("batched_get", text, 0, started)
        verify = self.options.verify
        since = [self._begin_get(key) for key in keys] if verify else []
        try:
            objs = await self.inner.batched_get(keys)
        except BaseException as error:
            if verify:
                for key in keys:
                    self._end_get(key, None)
            self._record("batched_get", text, 0, started, f"error:{type(error).__name__}")
            raise
        results: list[MemoryObj | None] = []
        try:
            for index, (key, obj) in enumerate(zip(keys, objs, strict=True)):
                results.append(await self._checked(key, obj, since[index]) if verify else obj)
        except BaseException:
            # _checked settled the object it failed on; settle the ones before and after it.
            for done in results:
                if done is not None:
                    done.release()
            for key, obj in zip(keys[len(results) + 1 :], objs[len(results) + 1 :], strict=True):
                self._end_get(key, None)
                if obj is not None:
                    obj.release()
            raise
        hits = sum(obj is not None for obj in results)
        corrupt = sum(o is not None and r is None for o, r in zip(objs, results, strict=True))
        size = sum(obj.nbytes for obj in results if obj is not None)
        self._record(
            "batched_get",
            text,
            size,
            started,
            "ok",
            f" hits={hits}/{len(keys)}" + (f" corrupt={corrupt}" if corrupt else ""),
        )
        return results

    async def _batched_put(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]) -> None:
        text = _batch_text(keys)
        size = sum(obj.nbytes for obj in objs)
        started = time.perf_counter()
        await self._faults("batched_put", text, size, started)
        sums = [_checksum(obj) for obj in objs] if self.options.verify else []
        for key, checksum in zip(keys, sums, strict=False):
            self._begin_put(key, checksum)
        ok = False
        try:
            await self.inner.batched_put(keys, objs)
            ok = True
        except BaseException as error:
            self._record("batched_put", text, size, started, f"error:{type(error).__name__}")
            raise
        finally:
            for key, checksum in zip(keys, sums, strict=False):
                self._end_put(key, checksum, ok)
        self._record("batched_put", text, size, started, "ok", f" keys={len(keys)}")

    async def _batched_contains(self, keys: Sequence[CacheKey]) -> int:
        async def call() -> int:
            return await self.inner.batched_contains(keys)

        return await self._audited(
            "batched_contains",
            _batch_text(keys),
            call,
            lambda count: ("ok", f" prefix={count}/{len(keys)}"),
        )

    async def _batched_exists(self, keys: Sequence[CacheKey]) -> list[bool]:
        async def call() -> list[bool]:
            return await self.inner.batched_exists(keys)

        return await self._audited(
            "batched_exists",
            _batch_text(keys),
            call,
            lambda found: ("ok", f" present={sum(found)}/{len(keys)}"),
        )

    async def _pin(self, key: CacheKey) -> bool:
        async def call() -> bool:
            return await self.inner.pin(key)

        return await self._audited(
            "pin",
            key.to_string(),
            call,
            lambda pinned: ("ok" if pinned else "miss", ""),
            inject=False,
        )

    async def _unpin(self, key: CacheKey) -> bool:
        async def call() -> bool:
            return await self.inner.unpin(key)

        return await self._audited(
            "unpin",
            key.to_string(),
            call,
            lambda done: ("ok" if done else "miss", ""),
            inject=False,
        )

    # Reads into the caller's memory are verified like gets: a get, then one copy.
    _get_into = Backend._get_into
    _batched_get_into = Backend._batched_get_into


def _batch_text(keys: Sequence[CacheKey]) -> str:
    if not keys:
        return "-"
    first = keys[0].to_string()
    return first if len(keys) == 1 else f"{first}(+{len(keys) - 1})"


__all__ = ["FAULT_OPS", "LOGGER_NAME", "AuditBackend", "AuditOptions"]
