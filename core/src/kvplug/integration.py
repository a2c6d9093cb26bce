"""What every engine integration shares (kvplug-lmcache, kvplug-sglang, ...): opening kvplug
from an engine's config, the rule for when an engine's buffers may be handed to kvplug without
a copy, and waiting until kvplug has let go of them.

Engines own their buffers and reuse them as soon as an operation is reported done, so an
integration reports a put or a read only once kvplug holds no reference to the engine's memory
(:func:`until_released`), and copies into kvplug's own memory first where a backend keeps the
object (:func:`needs_private_copy`)."""

from __future__ import annotations

import asyncio
import difflib
import logging
import math
import threading
import time
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from kvplug.backend import Backend
from kvplug.config import Config
from kvplug.errors import BackendTimeout, BackendUnavailable, CapacityExceeded, ConfigError
from kvplug.keys import CacheKey
from kvplug.memory import MemoryObj
from kvplug.secrets import mask_text
from kvplug.store import Store
from kvplug.sync import SyncClient

logger = logging.getLogger(__name__)
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
    :class:`~kvplug.sync.SyncClient`, with ``options`` as kvplug backend or Store options.

    The values are checked by :func:`check_target`; kvplug's own errors (unknown scheme,
    unreachable server, bad option) pass through unchanged.
    """
    check_target(url, config, options, what=what)
    if config is not None:
        return SyncClient(Config.from_yaml(Path(config)), **dict(options or {}))
    return SyncClient(str(url), **dict(options or {}))


def tiers_of(backend: Backend) -> list[Backend]:
    """The backends that hold the bytes: a Store's tiers, else ``backend`` itself."""
    return backend.tiers if isinstance(backend, Store) else [backend]


PROBE_KEY = CacheKey("kvplug-probe", 1, 0, b"\x00", "uint8")
"""The key :func:`probe` asks for; never stored."""


def probe(client: SyncClient, timeout: float) -> None:
    """Ask the store behind ``client`` for :data:`PROBE_KEY`, as an engine integration does at
    start. Raises :class:`BackendUnavailable` (with the failing tiers of a Store, which answer
    a lookup even while a tier is down) or :class:`TimeoutError` after ``timeout`` seconds."""
    backend = client.backend

    async def ask() -> None:
        await backend.contains(PROBE_KEY)
        if isinstance(backend, Store):
            failing = [tier for tier in backend.health() if not tier.healthy]
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


def needs_private_copy(backend: Backend) -> bool:
    """Whether a put must copy the engine's buffer into kvplug memory first.

    Engines reuse their buffers once a store is reported done. A backend that keeps the put
    object itself (a ``cpu://`` tier: ``zero_copy``) or writes it to lower tiers later (a Store
    of several tiers, which writes behind) would then hold memory the engine has moved on from;
    every other backend is done with the object when its put returns, so it may read the
    engine's buffer directly.
    """
    if backend.capabilities.zero_copy:
        return True
    return len(tiers_of(backend)) > 1


def private_copies(backend: Backend, objs: Sequence[MemoryObj], target: str) -> list[MemoryObj]:
    """Copies of ``objs`` (same shape, dtype and format) in ``backend``'s own memory, for a
    backend that :func:`needs_private_copy`. Allocated through the backend where it can make
    room (a Store's budget, a ``cpu://`` tier), else from its allocator; call it on the
    backend's event loop. Raises :class:`~kvplug.errors.CapacityExceeded` naming ``target``
    when no room can be made; nothing stays allocated then."""
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


RELEASE_POLL_SECONDS = 0.005


async def until_released(objs: Sequence[MemoryObj], timeout: float, what: str) -> bool:
    """Wait until kvplug holds no reference to ``objs`` beyond the caller's own (a put or read
    that ran past its deadline may still be reading or writing the engine's memory). False,
    with an error logged naming ``what``, when that takes longer than ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while any(obj.ref_count > 1 for obj in objs):
        if time.monotonic() > deadline:
            logger.error(
                "%s: kvplug still holds the engine's buffers %s s after the operation ended; "
                "reporting it anyway.",
                what,
                timeout,
            )
            return False
        await asyncio.sleep(RELEASE_POLL_SECONDS)
    return True


async def within_deadline(work: Awaitable[T], timeout: float, what: str) -> T:
    """``await work``, cancelled after ``timeout`` seconds with a :class:`BackendTimeout` that
    names ``what`` (``"a load on redis://h:6379"``) and the ``task_timeout`` setting."""
    try:
        return await asyncio.wait_for(work, timeout)
    except TimeoutError:
        raise BackendTimeout(
            f"{what} took longer than task_timeout={timeout} s. Check the store, or raise "
            "task_timeout."
        ) from None


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
    "CallHealth",
    "check_keys",
    "check_target",
    "flag",
    "needs_private_copy",
    "open_client",
    "positive_seconds",
    "private_copies",
    "probe",
    "tiers_of",
    "until_released",
    "within_deadline",
]
