"""Checks of the ``releases_on_cancel`` capability against a live backend, shared by the tests
of every plugin that declares it (and written to become the contract suite's clause for it).

A backend that declares the capability promises that a cancelled ``get_into`` or put (and their
batched forms) has stopped reading and writing the caller's objects by the time its
cancellation has finished. Each check here holds an operation in flight on a large value,
cancels it, and then acts as an engine would with the buffer it got back:

* :func:`check_cancelled_get_into`: the reply is streaming in when the operation is cancelled
  (the loop is held while the server fills the socket buffers, then the server is paused
  mid-value; a :class:`Tap` pauses after the first MiBs of the reply); right after the
  cancelled call returns, the destination's ``ref_count`` is the caller's 1 again; the caller
  fills it with a sentinel, the server resumes and sends the rest, and the sentinel must stay
  intact;
* :func:`check_cancelled_put`: the request is being sent to a paused server when the put is
  cancelled; right after, the source's ``ref_count`` is 1; the caller rewrites the source, the
  server resumes, and the key must then hold the original bytes or nothing, never the rewritten
  bytes or a mix (nor a damaged value that reads as a counted miss).

Both end by checking that the backend still works. ``hold`` is what keeps an operation in
flight: anything with ``pause()`` and ``resume()`` (the suite's ``ServerControl``; a
``RedisServer``, an ``LMServerProcess``), or ``None`` for a backend without a server (the
operation is then cancelled at its first chance, often before it started, and the same checks
apply).

A server keeps only a complete value, so a backend that goes on sending a little of the
caller's buffer after a cancellation (what a transport still held, then a graceful close) leaves
no trace in the store. :class:`Tap`, a TCP proxy in front of the server that can be paused and
that records what the client sends, sees it: as the ``hold`` of :func:`check_cancelled_put`,
the bytes that reach it after the cancellation must hold nothing written after it.

Example, in a plugin's tests::

    def test_a_cancelled_get_into_lets_go(server):
        async def scenario():
            backend = await kvplug.open_backend(server.url, timeout=60)
            try:
                await check_cancelled_get_into(backend, server)
            finally:
                await backend.close()

        asyncio.run(scenario())
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, Protocol, TypeVar

import torch

import kvplug
from kvplug import Backend, CacheKey, MemoryObj
from kvplug.backend import CountsCorruptObjects
from kvplug_testing import RedisServer, SentinelGroup

T = TypeVar("T")

VALUE_BYTES = 32 << 20
"""Bytes of each value the cancelled operation moves: more than the loopback socket buffers
hold (a few MiB each way, twice through a :class:`Tap`), so the server is surely paused
mid-value."""
SENTINEL = 0xAB
"""What the caller writes into a destination after the cancellation."""
REWRITTEN = 0x5C
"""What the caller writes into a source after the cancellation."""
REQUEST_TURNS = 20
"""Loop turns the operation gets to send its request before the server is paused."""
REPLY_BYTES = 4 << 20
"""Bytes of replies a :class:`Tap` lets through before it pauses, mid-value."""
FILL_SECONDS = 0.2
"""How long the loop is held (nothing read) so that the server fills the socket buffers with its
reply before it is paused."""
SETTLE_SECONDS = 0.3
"""How long the operation runs against the paused server before it is cancelled: it reads what
the socket buffers hold, or sends what they take, and then waits."""
CANCEL_SECONDS = 5.0
"""How long a cancellation may take while the server is still paused."""
AFTER_SECONDS = 0.5
"""How long the resumed server gets to send (or take) the rest before the checks."""


class Hold(Protocol):
    """What keeps an operation in flight: a server that can be paused and resumed."""

    def pause(self) -> None: ...

    def resume(self) -> None: ...


class Tap:
    """A TCP proxy on 127.0.0.1 in front of ``host:port`` (point the backend at :attr:`port`)
    that can be paused like a server (it stops reading from either side, so requests and replies
    wait in the socket buffers), or paused once replies of a given size went through
    (:meth:`pause_after`: mid-reply for sure, however large the client's socket buffers grow),
    and records what clients send from :meth:`mark` on. A context manager; :meth:`close` ends
    every connection."""

    CHUNK = 1 << 20
    """Bytes forwarded at a time: few enough handovers that the threads' turns at the GIL
    (5 ms each at worst) do not slow the transfer much."""
    BUFFER = 256 << 10
    """Receive buffer of the proxy's sockets, fixed (not grown by the kernel, which may take
    tens of MiB on loopback), so that a paused proxy holds back little."""

    def __init__(self, host: str, port: int) -> None:
        self.upstream = (host, port)
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.BUFFER)  # inherited
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen()
        self.port: int = self._listener.getsockname()[1]
        self._running = threading.Event()
        self._running.set()
        self._lock = threading.Lock()
        self._reply_budget: int | None = None
        self._recording = False
        self._recorded = bytearray()
        self._sockets: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def url(self, scheme: str = "redis") -> str:
        return f"{scheme}://127.0.0.1:{self.port}"

    def pause(self) -> None:
        self._running.clear()

    def resume(self) -> None:
        with self._lock:
            self._reply_budget = None
        self._running.set()

    def pause_after(self, nbytes: int) -> None:
        """Pause once ``nbytes`` more bytes of replies went through."""
        with self._lock:
            self._reply_budget = nbytes

    def mark(self) -> None:
        """Record what clients send from now on (forgetting what was recorded before)."""
        with self._lock:
            self._recording = True
            self._recorded = bytearray()

    def sent_since_mark(self) -> bytes:
        with self._lock:
            return bytes(self._recorded)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            upstream = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            upstream.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.BUFFER)
            upstream.settimeout(5)
            try:
                upstream.connect(self.upstream)
            except OSError:
                upstream.close()
                client.close()  # the server is down: so is this connection
                continue
            upstream.settimeout(None)
            with self._lock:
                self._sockets += [client, upstream]
            for source, target, sent in ((client, upstream, True), (upstream, client, False)):
                pump = threading.Thread(target=self._pump, args=(source, target, sent), daemon=True)
                self._threads.append(pump)
                pump.start()

    def _pump(self, source: socket.socket, target: socket.socket, sent: bool) -> None:
        try:
            while data := source.recv(self.CHUNK):
                if not sent:
                    data = self._within_budget(data, target)
                self._running.wait()
                if sent:
                    with self._lock:
                        if self._recording:
                            self._recorded += data
                target.sendall(data)
        except OSError:
            pass
        finally:  # one side ended (or reset): so does the other
            for end in (source, target):
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)

    def _within_budget(self, data: bytes, target: socket.socket) -> bytes:
        """Forward what the reply budget allows of ``data`` now, pausing once it is spent;
        the rest of ``data``."""
        with self._lock:
            budget = self._reply_budget
            if budget is None:
                return data
            self._reply_budget = budget - min(budget, len(data))
            if not self._reply_budget:
                self._reply_budget = None
                self._running.clear()
        target.sendall(data[:budget])
        return data[budget:]

    def close(self) -> None:
        self._running.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        self._listener.close()
        with self._lock:
            ends = list(self._sockets)
        for end in ends:
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join(5)
        for end in ends:
            end.close()

    def __enter__(self) -> Tap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MasterOf:
    """The server a Sentinel group names master now, paused and resumed as one server."""

    def __init__(self, group: SentinelGroup) -> None:
        self.group = group
        self.paused: RedisServer | None = None

    def pause(self) -> None:
        self.paused = self.group.server_at(self.group.master_address())
        self.paused.pause()

    def resume(self) -> None:
        if self.paused is not None:
            self.paused.resume()


def run_on(loop: str, scenario: Coroutine[Any, Any, T]) -> T:
    """Run ``scenario`` on a new event loop of kind ``loop``: ``"asyncio"`` or ``"uvloop"``
    (whose transports keep the buffers they are given, as asyncio's do from Python 3.12)."""
    if loop == "uvloop":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(scenario)
    return asyncio.run(scenario)


def pattern(nbytes: int, seed: int) -> MemoryObj:
    """``nbytes`` random bytes (from ``seed``) in memory of the caller's own."""
    generator = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (nbytes,), generator=generator, dtype=torch.uint8)
    return MemoryObj.from_tensor(data)


def fresh_keys(count: int) -> list[CacheKey]:
    model = f"cancel-{uuid.uuid4().hex[:10]}"
    return [CacheKey(model, 1, 0, n) for n in range(count)]


async def _turns(count: int) -> None:
    for _ in range(count):
        await asyncio.sleep(0)


async def _cancelled(task: asyncio.Future[Any], what: str, *, held: bool) -> None:
    """Cancel ``task`` and wait until it has ended (while the server is still paused, when
    ``held``: then it must end cancelled, not with a result or another error)."""
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=CANCEL_SECONDS)
    assert done, (
        f"the cancelled {what} had not ended {CANCEL_SECONDS} s after its cancellation, with the "
        "server paused: a cancellation must not wait for the server"
    )
    if task.cancelled():
        return
    outcome = task.exception() or task.result()
    assert not held, (
        f"the {what} cancelled mid-flight ended with {outcome!r}, not cancelled: the "
        "cancellation did not reach the caller"
    )
    if isinstance(outcome, BaseException):
        raise outcome  # it had finished (no server held it): its error is the test's


def _assert_let_go(objs: Sequence[MemoryObj], what: str) -> None:
    counts = [obj.ref_count for obj in objs]
    assert counts == [1] * len(objs), (
        f"right after the cancelled {what} ended, the caller's objects have ref_count {counts}, "
        "not 1: the backend still holds them"
    )


async def _cancel_in_flight(
    task: asyncio.Future[Any],
    what: str,
    objs: Sequence[MemoryObj],
    hold: Hold | None,
    finished_too_soon: str,
) -> None:
    """Cancel ``task``, the operation ``what`` on ``objs``, and check that it let go of them.
    Held by ``hold``, it must still be in flight once it settled, or the check proves nothing
    (``finished_too_soon`` says why)."""
    if hold is not None:
        await asyncio.sleep(SETTLE_SECONDS)
        assert not task.done(), finished_too_soon
    await _cancelled(task, what, held=hold is not None)
    _assert_let_go(objs, what)


def _corrupt_count(backend: Backend) -> int | None:
    """Damaged values read so far, seen through wrappers (a torn put reads as one)."""
    seen: Any = backend
    while seen is not None:
        if isinstance(seen, CountsCorruptObjects):
            return seen.corrupt_objects
        seen = getattr(seen, "inner", None)
    return None


async def _remove_all(backend: Backend, keys: Sequence[CacheKey]) -> None:
    if backend.capabilities.remove and not backend.closed:
        for key in keys:
            await backend.remove(key)


async def _while_paused(hold: Hold | None, body: Callable[[], Awaitable[None]]) -> None:
    """``body()`` with the server paused (from now, unless it already is), resumed after."""
    try:
        await body()
    finally:
        if hold is not None:
            hold.resume()
    await asyncio.sleep(AFTER_SECONDS)


async def _read_back(
    backend: Backend,
    keys: Sequence[CacheKey],
    dests: Sequence[MemoryObj],
    values: Sequence[MemoryObj],
    what: str,
) -> None:
    if len(keys) == 1:
        hits = [await backend.get_into(keys[0], dests[0])]
    else:
        hits = await backend.batched_get_into(keys, dests)
    assert hits == [True] * len(keys), f"{what} found {hits}"
    same = [torch.equal(d.raw, v.raw) for d, v in zip(dests, values, strict=True)]
    assert all(same), f"{what} read other bytes: {same}"


async def check_cancelled_get_into(
    backend: Backend,
    hold: Hold | None,
    *,
    nbytes: int = VALUE_BYTES,
    batched: bool = False,
    pause_first: bool = False,
) -> None:
    """Cancel a ``get_into`` (``batched_get_into`` of two keys with ``batched``) of values of
    ``nbytes`` each while the reply streams in; see the module documentation for what must
    hold. With ``pause_first`` the server is paused before the read is asked instead: for a
    server that answers at once, in one piece (no reply streams over a socket to pause it in)."""
    assert backend.capabilities.releases_on_cancel, (
        f"{backend!r} does not declare releases_on_cancel"
    )
    keys = fresh_keys(2 if batched else 1)
    values = [pattern(nbytes, seed) for seed in range(len(keys))]
    dests = [MemoryObj.from_tensor(torch.zeros(nbytes, dtype=torch.uint8)) for _ in keys]
    what = "batched_get_into" if batched else "get_into"
    task: asyncio.Future[Any] | None = None
    try:
        await backend.batched_put(keys, values)
        # The same read once whole: the connections it needs are open (a TLS handshake would
        # otherwise stall against the paused server, before anything was asked).
        await _read_back(backend, keys, dests, values, f"a {what} before the cancelled one")
        reading = (
            backend.batched_get_into(keys, dests)
            if batched
            else backend.get_into(keys[0], dests[0])
        )
        if hold is not None and pause_first:
            hold.pause()
        elif isinstance(hold, Tap):
            hold.pause_after(REPLY_BYTES)
        task = asyncio.ensure_future(reading)
        await _turns(REQUEST_TURNS)
        if hold is not None and not pause_first and not isinstance(hold, Tap):
            time.sleep(FILL_SECONDS)  # the loop reads nothing: the reply fills the buffers
            hold.pause()

        async def cancel() -> None:
            assert task is not None
            await _cancel_in_flight(
                task,
                what,
                dests,
                hold,
                f"the whole {what} of {nbytes} bytes arrived before the server was paused; "
                "the check needs a larger value (nbytes)",
            )
            for dest in dests:
                dest.raw.fill_(SENTINEL)

        await _while_paused(hold, cancel)
        intact = [bool((dest.raw == SENTINEL).all()) for dest in dests]  # no huge repr
        assert all(intact), (
            f"the backend wrote into the caller's memory after the cancelled {what} had ended "
            f"(sentinel intact per destination: {intact})"
        )
        await _read_back(backend, keys, dests, values, f"a {what} after the cancelled one")
    finally:
        if task is not None and not task.done():
            task.cancel()
        await _remove_all(backend, keys)


async def check_cancelled_put(
    backend: Backend, hold: Hold | None, *, nbytes: int = VALUE_BYTES, batched: bool = False
) -> None:
    """Cancel a put (``batched_put`` of two keys with ``batched``) of values of ``nbytes``
    each while it is being sent to the paused server; see the module documentation for what
    must hold."""
    assert backend.capabilities.releases_on_cancel, (
        f"{backend!r} does not declare releases_on_cancel"
    )
    count = 2 if batched else 1
    keys = fresh_keys(2 * count)
    warms, keys = keys[:count], keys[count:]
    sources = [pattern(nbytes, 10 + seed) for seed in range(len(keys))]
    originals = [source.raw.clone() for source in sources]
    what = "batched_put" if batched else "put"
    task: asyncio.Future[Any] | None = None
    try:
        # The same put of small values first: the connections it needs are open and what a
        # first put asks the server is known, so the cancelled put is busy sending its value.
        small = pattern(4096, 99)
        await backend.batched_put(warms, [small] * count)
        corrupt_before = _corrupt_count(backend)
        if hold is not None:
            hold.pause()

        async def cancel() -> None:
            nonlocal task
            writing = (
                backend.batched_put(keys, sources) if batched else backend.put(keys[0], sources[0])
            )
            task = asyncio.ensure_future(writing)
            if hold is None:
                await _turns(REQUEST_TURNS)
            await _cancel_in_flight(
                task,
                what,
                sources,
                hold,
                f"the {what} of {nbytes} bytes ended against a paused server; the check needs "
                "a larger value (nbytes)",
            )
            if isinstance(hold, Tap):
                hold.mark()
            for source in sources:
                source.raw.fill_(REWRITTEN)

        await _while_paused(hold, cancel)
        if isinstance(hold, Tap):
            late = hold.sent_since_mark()
            at = late.find(bytes([REWRITTEN]) * 256)
            assert at < 0, (
                f"after a cancelled {what} had ended, the backend sent bytes the caller wrote "
                f"into its buffer afterwards (from byte {at} of the {len(late)} it sent then)"
            )
        for key, original in zip(keys, originals, strict=True):
            got = await backend.get(key)
            if got is None:
                continue
            try:
                kept = got.nbytes == original.numel() and torch.equal(got.raw, original)
            finally:
                got.release()
            assert kept, (
                f"after a cancelled {what}, {key} holds bytes other than the original ones: the "
                "backend read the caller's buffer after the cancellation had ended"
            )
        assert _corrupt_count(backend) == corrupt_before, (
            f"after a cancelled {what}, a value read as damaged: the backend sent bytes of the "
            "caller's buffer written after the cancellation had ended (a mix of two versions)"
        )
        await backend.put(warms[0], small)
        again = await backend.get(warms[0])
        assert again is not None, f"a put after the cancelled {what} was not stored"
        try:
            assert torch.equal(again.raw.view(torch.uint8), small.raw)
        finally:
            again.release()
    finally:
        if task is not None and not task.done():
            task.cancel()
        await _remove_all(backend, [*warms, *keys])


OPERATIONS: dict[str, tuple[Callable[..., Awaitable[None]], bool]] = {
    "get_into": (check_cancelled_get_into, False),
    "batched_get_into": (check_cancelled_get_into, True),
    "put": (check_cancelled_put, False),
    "batched_put": (check_cancelled_put, True),
}
"""Each operation the capability covers: its check, and whether it is the batched form."""


async def check_operation(
    url: str, hold: Hold | None, operation: str, *, pause_first: bool = False, **options: Any
) -> None:
    """The check of ``operation`` (a name in :data:`OPERATIONS`) on a backend opened from
    ``url`` with ``options`` (and a deadline long enough never to end the operation first);
    ``pause_first``: see :func:`check_cancelled_get_into` (a put always pauses first)."""
    check, batched = OPERATIONS[operation]
    backend = await kvplug.open_backend(url, **{"timeout": 60, **options})
    try:
        if check is check_cancelled_get_into:
            await check_cancelled_get_into(backend, hold, batched=batched, pause_first=pause_first)
        else:
            await check(backend, hold, batched=batched)
    finally:
        await backend.close()


__all__ = [
    "OPERATIONS",
    "VALUE_BYTES",
    "Hold",
    "MasterOf",
    "Tap",
    "check_cancelled_get_into",
    "check_cancelled_put",
    "check_operation",
    "fresh_keys",
    "pattern",
    "run_on",
]
