"""Which server is master: the sentinels' answer, followed as it changes.

A Sentinel failover can leave the old master alive: paused and resumed, cut off and back, or
deposed by a planned ``SENTINEL FAILOVER``. Until the sentinels reconfigure it (seconds later,
or never while it stays unreachable to them) it still says it is master and answers ``GET`` s
with its old data, without the ``READONLY`` error that would tell a client to move. A client
that only re-asks the sentinels when a connection breaks keeps reading, and writing, there.

:class:`MasterTracker` is the one place that decides which server the backend talks to:

* it asks every sentinel for the service's master address and its config epoch (the failover
  generation, which only grows) and takes the address of the highest epoch, the one most
  sentinels name on a tie; a lower epoch than one already seen is a sentinel that has not
  caught up (or the leader of a failover is busy and does not answer), and is not followed
  unless every sentinel answers and names it (they were rebuilt);
* it asks again every ``interval`` seconds, at once when a sentinel publishes
  ``+switch-master``, and when an operation met a connection error or a ``READONLY`` reply;
* a connection to any other server than the one it names is closed before its next use, and
  a reply read on it after a change is dropped and the command sent again to the new master
  (:func:`kvplug_redis.connections.tracked_connection_class`). Direct reads drop their
  connections and such replies at every change (:mod:`kvplug_redis.direct`).

A burst of new connections shares one question to the sentinels: an answer younger than
``interval`` is reused.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("kvplug.redis")

Address = tuple[str, int]

HISTORY = 16
"""Changes of master kept in :attr:`MasterTracker.history`."""
RETRY_LISTEN = 1.0
"""Seconds before a broken ``+switch-master`` subscription is made again."""


@dataclass(frozen=True)
class Answer:
    """What one sentinel said: the master's address and the config epoch it holds."""

    address: Address
    epoch: int


@dataclass(frozen=True)
class MasterChange:
    """One change of master, as :attr:`MasterTracker.history` records it."""

    at: float
    """``time.time()`` of the change."""
    old: Address | None
    new: Address
    epoch: int
    votes: int
    """How many sentinels named ``new``."""
    asked: int
    """How many sentinels were asked."""

    def __str__(self) -> str:
        old = "none" if self.old is None else f"{self.old[0]}:{self.old[1]}"
        return (
            f"{old} -> {self.new[0]}:{self.new[1]} (config epoch {self.epoch}, named by "
            f"{self.votes} of {self.asked} sentinels)"
        )


def choose(
    answers: Sequence[Answer], *, current: Address | None, epoch: int, sentinels: int
) -> Answer | None:
    """The master to follow given the sentinels' ``answers``: the highest config epoch, then
    the address most of them name, then ``current``. A lower epoch than ``epoch`` (already
    followed) is taken only when all ``sentinels`` answer and name it: during a failover the
    ones that have not heard of it yet can be a majority, and the leader may not answer.
    None: no answer to follow (keep ``current``)."""
    if not answers:
        return None
    top = max(answer.epoch for answer in answers)
    votes = collections.Counter(answer.address for answer in answers if answer.epoch == top)
    most = max(votes.values())
    leaders = [address for address, count in votes.items() if count == most]
    address = current if current in leaders else sorted(leaders)[0]
    assert address is not None
    if top < epoch and address != current:
        named = sum(1 for answer in answers if answer.address == address)
        if named < sentinels:
            return None
    return Answer(address, top)


class MasterTracker:
    """Follows the master of one Sentinel service (see the module docstring).

    ``sentinels`` are the client library's clients of each sentinel; ``not_found`` the
    library's ``MasterNotFoundError``, raised by :meth:`locate` when no sentinel names a
    master that is up.
    """

    def __init__(
        self,
        *,
        sentinels: Sequence[Any],
        service: str,
        interval: float,
        timeout: float,
        not_found: type[Exception],
    ) -> None:
        self.sentinels = list(sentinels)
        self.service = service
        self.interval = interval
        self.timeout = timeout
        self._not_found = not_found
        self.current: Address | None = None
        self.epoch = -1
        self.history: collections.deque[MasterChange] = collections.deque(maxlen=HISTORY)
        """The latest changes of master, oldest first."""
        self.questions = 0
        """Rounds of questions asked of the sentinels so far."""
        self._asked_at = -float("inf")
        self._asking: asyncio.Task[None] | None = None
        self._listeners: list[Callable[[], None]] = []
        self._watchers: list[asyncio.Task[None]] = []
        self._closed = False

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` after every change of master (not at the first answer)."""
        self._listeners.append(listener)

    def suspect(self) -> None:
        """An operation met a broken connection or ``READONLY``: ask again at the next
        :meth:`locate` instead of reusing the last answer."""
        self._asked_at = -float("inf")

    async def locate(self) -> Address:
        """The master's address: the last answer if younger than ``interval``, else the
        sentinels' answer now. Raises ``not_found`` when no sentinel names a master that is
        up."""
        self.watch()
        if time.monotonic() - self._asked_at >= self.interval or self.current is None:
            await self.refresh()
        if self.current is None:
            raise self._not_found(
                f"No master found for {self.service!r}: no sentinel names a master that is up"
            )
        return self.current

    async def refresh(self) -> None:
        """Ask every sentinel now (one round at a time: callers that arrive while one is
        asked wait for it)."""
        if self._asking is None or self._asking.done():
            self._asking = asyncio.ensure_future(self._ask_all())
        await asyncio.shield(self._asking)

    async def _ask_all(self) -> None:
        self.questions += 1
        started = time.monotonic()
        replies = await asyncio.gather(*(self._ask(s) for s in self.sentinels))
        answers = [answer for answer in replies if answer is not None]
        chosen = choose(
            answers, current=self.current, epoch=self.epoch, sentinels=len(self.sentinels)
        )
        if not answers:
            if self.current is not None:
                logger.debug("service %s: no sentinel names a master that is up", self.service)
            self._asked_at = -float("inf")
            return
        self._asked_at = started
        if chosen is None:
            return
        self.epoch = max(self.epoch, chosen.epoch)
        if chosen.address == self.current:
            return
        votes = sum(1 for answer in answers if answer.address == chosen.address)
        change = MasterChange(
            time.time(), self.current, chosen.address, chosen.epoch, votes, len(self.sentinels)
        )
        first = self.current is None
        self.current = chosen.address
        self.epoch = chosen.epoch
        self.history.append(change)
        if first:
            return
        logger.warning("service %s: the master moved: %s", self.service, change)
        for listener in self._listeners:
            listener()

    async def _ask(self, sentinel: Any) -> Answer | None:
        """One sentinel's answer, or None when it does not answer in time or names no master
        that is up."""
        try:
            async with sentinel.pipeline(transaction=False) as pipe:
                pipe.sentinel_get_master_addr_by_name(self.service)
                pipe.sentinel_master(self.service)
                address, state = await asyncio.wait_for(pipe.execute(), self.timeout)
        except Exception as error:  # an unreachable sentinel is one missing answer
            logger.debug("service %s: a sentinel did not answer: %r", self.service, error)
            return None
        if not address or not isinstance(state, dict):
            return None
        if not state.get("is_master") or state.get("is_sdown") or state.get("is_odown"):
            return None
        host, port = address
        host = host.decode() if isinstance(host, bytes) else str(host)
        return Answer((host, int(port)), int(state.get("config-epoch", 0)))

    # -- watching ------------------------------------------------------------------------------

    def watch(self) -> None:
        """Start asking every ``interval`` seconds and listening for ``+switch-master`` (once,
        in the running loop)."""
        if self._watchers or self._closed:
            return
        self._watchers = [asyncio.ensure_future(self._poll())]
        self._watchers += [asyncio.ensure_future(self._listen(s)) for s in self.sentinels]

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            if time.monotonic() - self._asked_at < self.interval:
                continue
            try:
                await self.refresh()
            except Exception as error:  # a bug must not stop the watching
                logger.warning("service %s: asking the sentinels failed: %r", self.service, error)

    async def _listen(self, sentinel: Any) -> None:
        while True:
            pubsub = sentinel.pubsub()
            try:
                await pubsub.subscribe("+switch-master")
                while True:
                    message = await pubsub.get_message(
                        ignore_subscribe_messages=True, timeout=self.interval
                    )
                    if message is not None:
                        await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception as error:  # the sentinel is down: subscribe again later
                logger.debug("service %s: +switch-master subscription: %r", self.service, error)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
            await asyncio.sleep(RETRY_LISTEN)

    async def close(self) -> None:
        """Stop watching. Idempotent."""
        self._closed = True
        watchers, self._watchers = self._watchers, []
        for task in watchers:
            task.cancel()
        if watchers:
            await asyncio.gather(*watchers, return_exceptions=True)
        if self._asking is not None and not self._asking.done():
            self._asking.cancel()
            await asyncio.gather(self._asking, return_exceptions=True)


__all__ = ["Address", "Answer", "MasterChange", "MasterTracker", "choose"]
