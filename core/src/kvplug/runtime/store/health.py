"""Tier health: every operation a Store runs on a tier goes through :class:`TierGuard`, which
times it, isolates a tier that fails (skipped with an exponential back-off until it serves
again) and counts the puts a tier drops, warning about a tier that receives none."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from kvplug.errors import (
    BackendClosed,
    BackendError,
    CapacityExceeded,
    NotSupported,
    UnexpectedBackendError,
)
from kvplug.runtime.metrics import StoreMetrics
from kvplug.secrets import mask_text

if TYPE_CHECKING:
    from kvplug.runtime.store.tier import Tier

T = TypeVar("T")
logger = logging.getLogger("kvplug.store")

DROP_REASONS = (
    "write_behind_full",
    "tier_failing",
    "full",
    "tier_error",
    "closed",
    "untracked",
)
"""Why a put did not reach a tier: the write-behind queue had no room; the tier was skipped
after failing; the tier was full (``CapacityExceeded``); the tier failed on this put; the store
closed before it was written; too many removals were queued to track the older value."""
STARVED_AFTER = 4
"""Puts in a row a tier must drop (for a reason other than a busy write-behind) with none
written in between before the store warns that the tier receives nothing."""
ADVICE = {
    "write_behind_full": "raise the store's write_behind_size or write_behind_wait",
    "tier_failing": "bring the tier back (its last error is in Store.health())",
    "full": "raise the tier's max_size (or free its space): the objects do not fit in it",
    "tier_error": "check the tier: its puts fail (the error is in Store.health())",
    "untracked": "let the tier catch up with its queued removals",
    "closed": "do not close the store while it is used",
}
"""What to change when a tier drops puts, by drop reason."""


@dataclass
class TierHealth:
    """A tier's state: healthy, or failing and skipped until ``retry_at`` (monotonic time)."""

    name: str
    healthy: bool = True
    consecutive_errors: int = 0
    retry_at: float = 0.0
    last_error: str | None = None
    last_dropped: str | None = None
    """Why the last put that did not reach this tier was dropped."""


def stored_keys(error: BaseException, count: int) -> list[bool] | None:
    """Which of the ``count`` keys of a failed batched put were stored, when the error says
    (:attr:`~kvplug.errors.BackendError.stored`); None when that is unknown."""
    stored = error.stored if isinstance(error, BackendError) else None
    if stored is None or len(stored) != count:
        return None
    return list(stored)


class TierGuard:
    """Runs tier operations with timing and failure isolation, and keeps each tier's
    :class:`TierHealth` and streak of dropped puts."""

    def __init__(
        self,
        metrics: StoreMetrics,
        progress: asyncio.Event,
        *,
        backoff: float,
        max_backoff: float,
        on_latency: Callable[[str, str, float, int], None] | None = None,
    ) -> None:
        self.metrics = metrics
        self.on_latency = on_latency
        """Called as ``(tier, op, seconds, nbytes)`` after each tier operation that succeeded."""
        self._progress = progress
        self._backoff = backoff
        self._max_backoff = max_backoff

    async def call(
        self, tier: Tier, op: str, operation: Awaitable[T], nbytes: int = 0
    ) -> tuple[bool, T | None]:
        """Run one tier operation with timing and failure isolation: ``(ok, result)``."""
        start = time.perf_counter()
        try:
            result = await operation
        except (BackendClosed, NotSupported, CapacityExceeded, UnexpectedBackendError):
            raise  # the caller's or the data's problem, or a bug: not a failing tier
        except (BackendError, OSError) as error:
            self.failed(tier, op, error)
            return False, None
        self.succeeded(tier)
        if self.on_latency is not None:
            self.on_latency(tier.name, op, time.perf_counter() - start, nbytes)
        return True, result

    def succeeded(self, tier: Tier) -> None:
        if not tier.health.healthy:
            logger.info("tier %s is serving again", tier.name)
            self.metrics.healthy.labels(tier.name).set(1)
        tier.health.healthy = True
        tier.health.consecutive_errors = 0

    def failed(self, tier: Tier, op: str, error: BaseException) -> None:
        health = tier.health
        health.consecutive_errors += 1
        delay = min(self._max_backoff, self._backoff * 2 ** (health.consecutive_errors - 1))
        health.retry_at = time.monotonic() + delay
        health.last_error = mask_text(f"{type(error).__name__}: {error}")
        if health.healthy:
            logger.warning(
                "tier %s failed on %s (%s); skipped for %.1f s",
                tier.name,
                op,
                health.last_error,
                delay,
            )
        health.healthy = False
        self._progress.set()  # removals waiting for a failing tier no longer hold up a flush
        self.metrics.healthy.labels(tier.name).set(0)

    def dropped(self, tier: Tier, reason: str, detail: str, count: int = 1) -> None:
        """``count`` puts did not reach ``tier``, for ``reason`` (one of :data:`DROP_REASONS`)."""
        tier.health.last_dropped = mask_text(f"{reason}: {detail}")
        self.metrics.dropped.labels(tier.name, reason).inc(count)
        if reason in ("write_behind_full", "closed"):
            return  # shedding load while the tier writes, or shutting down: not starvation
        tier.drop_streak += count
        if tier.drop_streak >= STARVED_AFTER and not tier.starved:
            tier.starved = True
            logger.warning(
                "tier %s took none of the last %d puts it was offered (%s); a tier that "
                "receives nothing serves nothing. To fix it: %s.",
                tier.name,
                tier.drop_streak,
                tier.health.last_dropped,
                ADVICE[reason],
            )

    def wrote(self, tier: Tier) -> None:
        """A put reached ``tier``: end a streak of drops."""
        tier.drop_streak = 0
        if tier.starved:
            tier.starved = False
            logger.info("tier %s receives puts again", tier.name)
