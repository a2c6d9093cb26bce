"""The template every backend derives from: :class:`Backend`, whose public operations check
their arguments and the open state, keep the deadline, hold the caller's objects, check what
the hook returns, translate its errors and count every call, around the hooks a vendor
implements (:class:`~kvplug.hooks.BackendHooks`).

Vendors import it from :mod:`kvplug.backend`, where the contract is described.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import reprlib
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn, TypeVar, cast

from kvplug.batches import release_objects
from kvplug.capabilities import Capabilities
from kvplug.checks import check_key, check_keys, check_obj, check_pairs, memory_module
from kvplug.class_checks import check_backend_class
from kvplug.deadline import finish_within
from kvplug.errors import BackendClosed, BackendError, BackendTimeout, NotSupported
from kvplug.home_loop import run_on_home_loop
from kvplug.hook_errors import kvplug_error_for, of_keys
from kvplug.hooks import BackendHooks
from kvplug.inline import running_loop
from kvplug.keys import CacheKey
from kvplug.option_parsing import DefaultOptions, parse_backend_options
from kvplug.secrets import install_log_filter
from kvplug.stats import OperationCounters, OperationStats
from kvplug.url import BackendURL

if TYPE_CHECKING:
    from kvplug.memory import Allocator, MemoryObj
    from kvplug.options import BackendOptions

T = TypeVar("T")
logger = logging.getLogger("kvplug.backend")


class Backend(BackendHooks):
    """An asynchronous store of memory objects. Subclass it, implement its hooks and register
    it with a plugin.

    Construction takes the parsed URL, an optional allocator for the objects ``get`` returns
    (the process-wide host allocator when none is given) and the options, validated against
    :attr:`Options`. Construction does not connect; :meth:`open` does, once, before the
    first operation (``kvplug.open_backend`` awaits it for you).

    Hooks to implement: ``_get``, ``_put`` and ``_contains`` always; ``_remove``, ``_pin`` /
    ``_unpin`` and ``_list_keys`` with the capability that gates them; ``_open`` and
    ``_close`` when there is something to connect or release; the batched hooks and
    ``_get_into`` when the store does them better than the defaults (one call per key, and a
    copy). The hooks receive checked arguments, run only while the backend is open, and may
    rely on the caller's objects staying alive while they are awaited; one that hands an
    object's memory to work that outlives its own await (a thread still running after a
    deadline cancelled the await, a socket still receiving) retains it for that work.

    Contract clauses that hold for every method:

    * Keys are isolated per namespace (model name, world size, worker id, chunk hash and
      tags): a key never reads or writes another key's data, and no key content escapes into
      paths or other key spaces (clause 12).
    * Every method is safe under concurrency from many tasks, and from threads or event loops
      other than the one that opened the backend, one at a time (clause 15).
    * After :meth:`close`, every method raises :class:`~kvplug.errors.BackendClosed`
      (clause 11).
    * Operations finish within ``options.timeout`` with a result, a
      :class:`~kvplug.errors.BackendTimeout` or a :class:`~kvplug.errors.BackendUnavailable`,
      and recover without reopening when the server returns (clause 10).

    A store of memory objects in a dict, complete and correct (it keeps a reference to each
    object it stores and gives every reader one of its own)::

        >>> import asyncio, torch, kvplug
        >>> from kvplug.backend import Backend, Capabilities
        >>> class HeldObjects(Backend):
        ...     capabilities = Capabilities(remove=True, zero_copy=True)
        ...
        ...     def __init__(self, url, **kwargs):
        ...         super().__init__(url, **kwargs)
        ...         self._held: dict[kvplug.CacheKey, kvplug.MemoryObj] = {}
        ...
        ...     async def _get(self, key):
        ...         obj = self._held.get(key)
        ...         return None if obj is None else obj.retain()
        ...
        ...     async def _put(self, key, obj):
        ...         old, self._held[key] = self._held.get(key), obj.retain()
        ...         if old is not None:
        ...             old.release()
        ...
        ...     async def _contains(self, key):
        ...         return key in self._held
        ...
        ...     async def _remove(self, key):
        ...         obj = self._held.pop(key, None)
        ...         if obj is not None:
        ...             obj.release()
        ...         return obj is not None
        ...
        ...     async def _close(self):
        ...         for obj in self._held.values():
        ...             obj.release()
        ...         self._held.clear()
        >>> async def demo() -> list[object]:
        ...     backend = HeldObjects("held://")
        ...     key = kvplug.CacheKey("llama", 1, 0, 7)
        ...     await backend.put(key, kvplug.MemoryObj.from_tensor(torch.ones(2)))
        ...     got = await backend.get(key)
        ...     found = [got.tensor.tolist(), await backend.remove(key), await backend.remove(key)]
        ...     got.release()
        ...     await backend.close()
        ...     return found
        >>> asyncio.run(demo())
        [[1.0, 1.0], True, False]
    """

    loop_bound: ClassVar[bool] = False
    """True for a backend whose state (clients, tasks, asyncio primitives) belongs to the event
    loop it is first used on: the template then runs every hook on that loop, also for callers
    on other loops and threads (while that loop runs). False: hooks run on the caller's loop,
    so the backend must not keep loop-bound state."""

    runs_inline: ClassVar[bool] = False
    """True for a backend whose operations never wait (no I/O, no asyncio primitives, no need
    for a running loop) and whose state is guarded by thread locks, so that any thread can run
    an operation to its end by stepping the coroutine once.
    :class:`~kvplug.runtime.sync.SyncClient` then runs operations on the caller's thread
    (:func:`kvplug.inline.run_inline`) instead of handing each to its IO thread and back, which
    costs about 100 µs per call, far more than an in-memory operation. While an operation is
    stepped there, the thread's running loop is kvplug's stand-in, which raises at any request
    (a future, a timer, a task), and a step that suspends instead of finishing is caught as
    such: an operation that waits after all is abandoned and fails with
    :class:`~kvplug.errors.KvplugError`, told apart by its type, never by an error's text.
    Example: ``kvplug-cpu`` sets it; a network backend must not."""

    capabilities: Capabilities = Capabilities()
    """What this backend can do; a class attribute, or set per instance (a wrapper's are its
    inner backend's)."""
    Options: ClassVar[type[BackendOptions]] = cast(
        "type[BackendOptions]", DefaultOptions("BackendOptions")
    )

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        check_backend_class(cls)

    def __init__(
        self,
        url: BackendURL | str,
        *,
        allocator: Allocator | None = None,
        **options: Any,
    ) -> None:
        install_log_filter()  # also on the logger of the plugin module that defines this class
        self.url = BackendURL.parse(url)
        self._allocator = allocator
        self.options = self.parse_options(self.url, options)
        self._closed = False
        self._opened = False
        self._home_loop: asyncio.AbstractEventLoop | None = None
        self._close_lock = threading.Lock()
        self._counters = OperationCounters()

    @classmethod
    def parse_options(cls, url: BackendURL, explicit: dict[str, Any]) -> BackendOptions:
        """The URL's query merged with ``explicit`` (explicit wins), validated by
        :attr:`Options`; unknown or bad values raise with the valid names listed."""
        return parse_backend_options(cls, cls.Options, url, explicit)

    @property
    def allocator(self) -> Allocator:
        """Where objects returned by ``get`` are allocated."""
        if self._allocator is None:
            self._allocator = memory_module().shared_host_allocator()
        return self._allocator

    @property
    def closed(self) -> bool:
        return self._closed

    def deadline(self) -> float | None:
        """Seconds one operation may take before it raises ``BackendTimeout``:
        ``options.timeout``. A backend whose operations only call other backends that keep
        deadlines of their own (a wrapper, a tiered store) returns ``None``."""
        return self.options.timeout

    def operation_stats(self) -> dict[str, OperationStats]:
        """Counters of each public operation called so far, by operation name: a consistent
        copy, taken while no operation is being counted (each call is counted once, when it
        returns or raises, so ``calls == errors + hits + misses`` for ``get``, ``contains``
        and ``get_into``)."""
        return self._counters.snapshot()

    def describe(self) -> dict[str, str]:
        """What ``kvplug check`` prints about this backend once it is open, beyond its URL and
        capabilities (for example how data moves: ``{"mode": "compat"}``). Default: nothing."""
        return {}

    # -- the template ------------------------------------------------------------------------

    def ensure_open(self) -> None:
        """Raise :class:`~kvplug.errors.BackendClosed` if :meth:`close` was called (the
        template checks before every hook; a hook that waits long may check again)."""
        if self._closed:
            raise BackendClosed(f"{self.url} is closed; open a new backend with open_backend().")

    def translate_error(
        self, operation: str, error: Exception, args: Sequence[object] = ()
    ) -> Exception:
        """The kvplug error the template raises, ``from error``, when a hook of ``operation``
        (called with ``args``, which name the keys) raised ``error``:

        * a :class:`~kvplug.errors.KvplugError`: ``error`` itself;
        * ``ConnectionError`` (refused, reset, broken pipe):
          :class:`~kvplug.errors.BackendUnavailable`, retryable;
        * ``TimeoutError``: :class:`~kvplug.errors.BackendTimeout`;
        * any other ``OSError``: :class:`~kvplug.errors.BackendError`, a failing store;
        * ``MemoryError``: ``error`` itself (the process is out of memory, not the backend
          failing);
        * anything else (``AttributeError``, ``KeyError``, ``RuntimeError`` ...):
          :class:`~kvplug.errors.UnexpectedBackendError`.

        Messages name the operation, the backend's URL and the original error, masked
        (:func:`~kvplug.secrets.mask_text`). A plugin that knows more (a client library's
        error that means a failover) translates it in its hooks, before this sees it; one with
        public methods of its own outside the template (a health check) may call this too.

        Example::

            >>> import kvplug
            >>> backend = kvplug.create_backend("cpu://")
            >>> key = kvplug.CacheKey("llama", 1, 0, 7)
            >>> error = backend.translate_error("get", KeyError("slot 7"), [key])
            >>> type(error).__name__
            'UnexpectedBackendError'
            >>> print(str(error)[:68])
            get of llama@1@0@7@half on cpu:// failed: CpuBackend raised KeyError
            >>> type(backend.translate_error("put", ConnectionResetError(104, "reset"))).__name__
            'BackendUnavailable'
        """
        return kvplug_error_for(self, operation, error, args)

    def _hook_failed(
        self, operation: str, args: Sequence[object], error: BaseException
    ) -> NoReturn:
        """Raise what a hook's ``error`` becomes (:meth:`translate_error`)."""
        if isinstance(error, Exception):
            translated = self.translate_error(operation, error, args)
            if translated is not error:
                raise translated from error
        raise error

    async def _run_hook(self, operation: str, hook: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``hook(*args)`` as ``operation``: open check, deadline, the hook's exceptions as
        kvplug errors, and one count of the call (calls, errors, time)."""
        started = time.perf_counter()
        result = await self._call_hook(operation, started, hook, *args)
        self._counters.count(operation, started)
        return result

    async def _call_hook(
        self, operation: str, started: float, hook: Callable[..., Awaitable[T]], *args: Any
    ) -> T:
        """:meth:`_run_hook` without counting a success: the public operation counts it, once,
        with what it found. A failure is counted here."""
        if self._closed:
            self.ensure_open()
        if self.loop_bound:
            home = self._home_loop
            loop = running_loop()
            if home is None:
                self._home_loop = loop
            elif home is not loop:
                return await self._run_on_home_loop(
                    home, self._call_hook(operation, started, hook, *args)
                )
        try:
            limit = self.deadline()
            if limit is None:
                return await hook(*args)
            # Armed at the hook's first wait (kvplug.deadline): a hook that finishes in its
            # first step needs none.
            coroutine = cast("Coroutine[Any, Any, T]", hook(*args))
            try:
                awaited = coroutine.send(None)
            except StopIteration as done:
                return cast(T, done.value)
            expired = functools.partial(_deadline_passed, self.url, operation, args, limit)
            return await finish_within(coroutine, awaited, limit, expired)
        except BaseException as error:
            self._counters.count(operation, started, errors=1)
            self._hook_failed(operation, args, error)

    def _refused_result(
        self, operation: str, started: float, message: str, others: Iterable[object] = ()
    ) -> TypeError:
        """The error for a hook's result the template refuses (counted as a failed call),
        once the objects in ``others`` are released."""
        release_objects(others)
        self._counters.count(operation, started, errors=1)
        return TypeError(message)

    def _check_result(
        self, operation: str, started: float, obj: object, hook: str, others: Sequence[object] = ()
    ) -> None:
        if not isinstance(obj, memory_module().MemoryObj):
            raise self._refused_result(
                operation,
                started,
                f"{type(self).__qualname__}.{hook} returned {type(obj).__name__}; it must "
                "return a kvplug.MemoryObj (the caller's reference) or None for a miss.",
                others,
            )

    async def _run_on_home_loop(
        self, home: asyncio.AbstractEventLoop, work: Coroutine[Any, Any, T]
    ) -> T:
        """Await ``work`` on the loop a :attr:`loop_bound` backend belongs to."""
        return await run_on_home_loop(self.url, home, work)

    async def open(self) -> None:
        """Connect or prepare (the ``_open`` hook), once; ``kvplug.open_backend`` calls it.
        A second call does nothing."""
        if self._opened:
            self.ensure_open()
            return
        await self._run_hook("open", self._open)
        self._opened = True

    async def close(self) -> None:
        """Release every resource (the ``_close`` hook). Idempotent; bounded in time even with
        operations in flight: a ``_close`` that outlasts the deadline is abandoned with a
        warning. Later operations raise :class:`~kvplug.errors.BackendClosed` (clause 11)."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        limit = self.deadline()
        home = self._home_loop
        closing = self._close()
        if home is not None and home is not asyncio.get_running_loop() and home.is_running():
            closing = self._run_on_home_loop(home, closing)
        try:
            async with asyncio.timeout(limit):
                await closing
        except TimeoutError:
            logger.warning(
                "closing %s took longer than %s s and was abandoned; some of its resources "
                "may be released late",
                self.url,
                limit,
            )
        except Exception as error:
            self._hook_failed("close", (), error)

    async def get(self, key: CacheKey) -> MemoryObj | None:
        """The object stored under ``key``, or ``None`` for a miss.

        * A miss is ``None``, never an exception (clause 1).
        * A hit is bit-identical to what the last completed ``put`` of ``key`` stored: bytes,
          dtype, shape and format (clause 2); never a mix of two puts (clause 3). Put v1, put
          v2, get gives v2 (read-your-writes): an overwrite never keeps the old value.
        * The caller owns one reference of the returned object and releases it (clause 5).
        * Stored data that is corrupt, torn or truncated reads as a miss, is counted and is
          removed (clause 6).
        """
        check_key(key, "get")
        started = time.perf_counter()
        obj = await self._call_hook("get", started, self._get, key)
        if obj is None:
            self._counters.count("get", started, 0, 1)
            return None
        self._check_result("get", started, obj, "_get")
        self._counters.count("get", started, 1, 0, obj.nbytes)
        return obj

    async def put(self, key: CacheKey, obj: MemoryObj) -> None:
        """Store ``obj`` under ``key``; when this returns, ``get`` finds it.

        * ``put`` of an existing key replaces it atomically: a reader never sees a mix
          (clause 3).
        * ``put`` does not take the caller's reference: the base holds one of its own while
          the hook runs and releases it when done, on success and on failure (clause 5).
        * A full store raises :class:`~kvplug.errors.CapacityExceeded` or evicts by policy;
          reads keep working (clause 9).
        """
        check_key(key, "put")
        check_obj(obj, "put")
        started = time.perf_counter()
        obj.retain()
        try:
            await self._call_hook("put", started, self._put, key, obj)
        finally:
            obj.release()
        self._counters.count("put", started, 0, 0, obj.nbytes, keys=1)

    async def contains(self, key: CacheKey) -> bool:
        """Whether ``get`` would hit now (clause 7: no "exists but cannot be read")."""
        check_key(key, "contains")
        started = time.perf_counter()
        found = bool(await self._call_hook("contains", started, self._contains, key))
        self._counters.count("contains", started, int(found), int(not found))
        return found

    async def remove(self, key: CacheKey) -> bool:
        """Delete ``key``: True if it was there, False if absent (clause 7). Needs the
        ``remove`` capability; without it raises :class:`~kvplug.errors.NotSupported`."""
        check_key(key, "remove")
        self.ensure_open()
        self._require_capability("remove", "cannot remove keys")
        return bool(await self._run_hook("remove", self._remove, key))

    async def get_into(self, key: CacheKey, dest: MemoryObj) -> bool:
        """Read the bytes stored under ``key`` into ``dest``'s memory (an engine's own buffer).

        True when ``dest`` now holds exactly the stored bytes; False for a miss and for
        anything :meth:`get` would turn into a miss (clause 6). A stored object whose size is
        not ``dest.nbytes`` raises :class:`~kvplug.errors.LayoutMismatch`, naming both
        layouts: the reader's layout is not the one that stored it, which recomputing would
        hide (``dest`` is left as it was). After False, ``dest``'s contents are undefined: use
        it only after True. Of objects of the same size, the stored shape, dtype and format are
        not checked: the caller knows its layout (a flat byte buffer reads any object).

        ``dest`` stays the caller's; the backend retains it while it may write into it, so a
        caller that stopped waiting (a deadline) can wait for ``dest.ref_count`` to drop back
        before reusing the buffer.

        Example::

            >>> import asyncio, torch, kvplug
            >>> async def demo() -> list[bool]:
            ...     backend = await kvplug.open_backend("cpu://")
            ...     key = kvplug.CacheKey("llama", 1, 0, 7)
            ...     await backend.put(key, kvplug.MemoryObj.from_tensor(torch.ones(8)))
            ...     dest = kvplug.MemoryObj.from_tensor(torch.zeros(8))
            ...     hits = [await backend.get_into(key, dest), bool(dest.tensor.sum() == 8)]
            ...     short = kvplug.MemoryObj.from_tensor(torch.zeros(4))
            ...     try:
            ...         await backend.get_into(key, short)
            ...     except kvplug.LayoutMismatch as error:
            ...         hits.append(str(error).split(", but")[0])
            ...     await backend.close()
            ...     return hits
            >>> asyncio.run(demo())
            [True, True, 'llama@1@0@7@half is stored as [8] torch.float32 (32 bytes)']
        """
        check_key(key, "get_into")
        check_obj(dest, "get_into")
        started = time.perf_counter()
        dest.retain()
        try:
            hit = bool(await self._call_hook("get_into", started, self._get_into, key, dest))
        finally:
            dest.release()
        self._counters.count("get_into", started, int(hit), int(not hit), dest.nbytes if hit else 0)
        return hit

    async def batched_get(self, keys: Sequence[CacheKey]) -> list[MemoryObj | None]:
        """``get`` of each key; the result is aligned with ``keys`` (clause 4). If the
        operation fails, no object read so far is left allocated."""
        check_keys(keys, "batched_get")
        if not keys:
            self.ensure_open()
            return []
        started = time.perf_counter()
        objs = list(await self._call_hook("batched_get", started, self._batched_get, keys))
        if len(objs) != len(keys):
            raise self._refused_result(
                "batched_get",
                started,
                f"{type(self).__qualname__}._batched_get returned {len(objs)} results for "
                f"{len(keys)} keys; it must return one per key, None for a miss (clause 4).",
                objs,
            )
        for obj in objs:
            if obj is not None:
                self._check_result("batched_get", started, obj, "_batched_get", objs)
        hits = [obj for obj in objs if obj is not None]
        self._counters.count(
            "batched_get", started, len(hits), len(objs) - len(hits), sum(o.nbytes for o in hits)
        )
        return objs

    async def batched_put(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]) -> None:
        """``put`` of each pair. Raises the first error once every put has finished."""
        check_pairs(keys, objs, "batched_put")
        if not keys:
            self.ensure_open()
            return
        started = time.perf_counter()
        held = [obj.retain() for obj in objs]
        try:
            await self._call_hook("batched_put", started, self._batched_put, keys, objs)
        except BackendError as error:
            if error.stored is not None and len(error.stored) == len(keys) and any(error.stored):
                kept = [obj for obj, done in zip(objs, error.stored, strict=True) if done]
                self._counters.count(  # the failed call is counted; here what it stored
                    "batched_put", None, nbytes=sum(o.nbytes for o in kept), calls=0, keys=len(kept)
                )
            raise
        finally:
            for obj in held:
                obj.release()
        self._counters.count(
            "batched_put", started, 0, 0, sum(obj.nbytes for obj in objs), keys=len(keys)
        )

    async def batched_contains(self, keys: Sequence[CacheKey]) -> int:
        """How many leading keys are present: the prefix length up to the first miss
        (clause 4)."""
        check_keys(keys, "batched_contains")
        if not keys:
            self.ensure_open()
            return 0
        started = time.perf_counter()
        count = await self._call_hook("batched_contains", started, self._batched_contains, keys)
        if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count <= len(keys):
            raise self._refused_result(
                "batched_contains",
                started,
                f"{type(self).__qualname__}._batched_contains returned {count!r} for "
                f"{len(keys)} keys; it must return the count of leading keys present (clause 4).",
            )
        self._counters.count("batched_contains", started, count, len(keys) - count)
        return count

    async def batched_exists(self, keys: Sequence[CacheKey]) -> list[bool]:
        """Whether each key is present: :meth:`contains` of every key, aligned with ``keys``
        (a key given twice is answered twice), in one round trip where the store allows it
        (clause 4). What engines ask to learn which chunks of a request they may load and
        which they must store.

        Example::

            >>> import asyncio, torch, kvplug
            >>> from kvplug import CacheKey, MemoryObj
            >>> async def demo():
            ...     async with await kvplug.open_backend("cpu://?max_size=1MiB") as cache:
            ...         keys = [CacheKey("demo", 1, 0, n) for n in range(3)]
            ...         await cache.put(keys[1], MemoryObj.from_tensor(torch.ones(4)))
            ...         return await cache.batched_exists(keys)
            >>> asyncio.run(demo())
            [False, True, False]
        """
        check_keys(keys, "batched_exists")
        if not keys:
            self.ensure_open()
            return []
        started = time.perf_counter()
        found = await self._call_hook("batched_exists", started, self._batched_exists, keys)
        if not isinstance(found, list) or len(found) != len(keys):
            raise self._refused_result(
                "batched_exists",
                started,
                f"{type(self).__qualname__}._batched_exists returned "
                f"{reprlib.repr(found)} for {len(keys)} keys; it must return a list of one "
                "bool per key (clause 4).",
            )
        present = [bool(there) for there in found]
        hits = sum(present)
        self._counters.count("batched_exists", started, hits, len(present) - hits)
        return present

    async def batched_get_into(
        self, keys: Sequence[CacheKey], dests: Sequence[MemoryObj]
    ) -> list[bool]:
        """:meth:`get_into` of each pair; aligned with ``keys``."""
        check_pairs(keys, dests, "batched_get_into")
        if not keys:
            self.ensure_open()
            return []
        started = time.perf_counter()
        held = [dest.retain() for dest in dests]
        try:
            hits = [
                bool(hit)
                for hit in await self._call_hook(
                    "batched_get_into", started, self._batched_get_into, keys, dests
                )
            ]
        finally:
            for dest in held:
                dest.release()
        if len(hits) != len(keys):
            raise self._refused_result(
                "batched_get_into",
                started,
                f"{type(self).__qualname__}._batched_get_into returned {len(hits)} results for "
                f"{len(keys)} keys; it must return one per key.",
            )
        nbytes = sum(dest.nbytes for dest, hit in zip(dests, hits, strict=True) if hit)
        self._counters.count("batched_get_into", started, sum(hits), len(hits) - sum(hits), nbytes)
        return hits

    async def pin(self, key: CacheKey) -> bool:
        """Keep ``key`` from eviction until :meth:`unpin` or the pin's expiry; False if absent
        (clause 8). Needs the ``pin`` capability."""
        check_key(key, "pin")
        self.ensure_open()
        self._require_capability("pin", "cannot pin keys")
        return bool(await self._run_hook("pin", self._pin, key))

    async def unpin(self, key: CacheKey) -> bool:
        """Undo one :meth:`pin`. Always succeeds; True if a pin was released (clause 8)."""
        check_key(key, "unpin")
        self.ensure_open()
        self._require_capability("pin", "cannot pin keys")
        return bool(await self._run_hook("unpin", self._unpin, key))

    def list_keys(self) -> AsyncIterator[CacheKey]:
        """Every stored key, in no particular order. Needs the ``list_keys`` capability.
        The call is counted when it is made; an error while iterating counts as its error."""
        self.ensure_open()
        self._require_capability("list_keys", "cannot list keys")
        started = time.perf_counter()
        try:
            keys = self._list_keys()
        except BaseException as error:
            self._counters.count("list_keys", started, errors=1)
            self._hook_failed("list_keys", (), error)
        self._counters.count("list_keys", started)
        return self._listing(keys)

    async def _listing(self, keys: AsyncIterator[CacheKey]) -> AsyncIterator[CacheKey]:
        """``keys``, the hook's iterator, with its exceptions as kvplug errors; closed with
        this one."""
        try:
            try:
                async for key in keys:
                    yield key
            finally:
                close = getattr(keys, "aclose", None)
                if close is not None:
                    await close()
        except Exception as error:
            self._counters.count("list_keys", None, errors=1, calls=0)
            self._hook_failed("list_keys", (), error)

    def _require_capability(self, capability: str, cannot: str) -> None:
        if not getattr(self.capabilities, capability):
            raise NotSupported(
                f"{type(self).__name__} ({self.url.scheme}://) {cannot}: it does not declare "
                f"the {capability!r} capability."
            )

    async def __aenter__(self) -> Backend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.url)!r})"


def _deadline_passed(
    url: BackendURL, operation: str, args: Sequence[object], limit: float
) -> BackendTimeout:
    """The error of a call of ``operation`` that ran past its deadline of ``limit`` s."""
    # Not a closure in _call_hook: one would make every call of it pay for its cells.
    return BackendTimeout(
        f"{operation}{of_keys(args)} on {url} took longer than {limit} s; the "
        "store is slow or unreachable. Raise the 'timeout' option or check the store."
    )


__all__ = ["Backend"]
