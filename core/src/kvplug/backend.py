"""The backend contract: what every storage backend of kvplug does, and how.

A backend stores :class:`~kvplug.memory.MemoryObj` s under :class:`~kvplug.keys.CacheKey` s and
returns them bit-exact, or reports a miss. It is ``async``: engines reach it from worker threads
through :class:`~kvplug.runtime.sync.SyncClient`, so vendors never write synchronous code.

:class:`Backend` is a template. Users call its public operations (``get``, ``put``,
``contains``, ``remove``, the batched forms, ``get_into``, ``pin``/``unpin``, ``list_keys``,
``open``, ``close``); vendors implement protected hooks (``_get``, ``_put``, ...). The public
operation does, for every backend, what each would otherwise do by hand or forget: it checks the
arguments, raises :class:`~kvplug.errors.BackendClosed` after ``close``, applies the deadline
(``options.timeout``), holds a reference to the caller's object while the hook runs, checks what
the hook returns, turns an exception of the hook that is not a kvplug error into one
(:meth:`Backend.translate_error`), gates operations on the declared :class:`Capabilities`, and
counts calls, errors, hits, misses, bytes and time (:meth:`Backend.operation_stats`). A
subclass that defines a public operation itself is refused when the class is created, and so is
one that declares a capability without its hook.

There are three bases to start from:

* :class:`Backend` when the store can hold memory objects directly (host memory, local files,
  GPU-direct storage): implement ``_get``, ``_put``, ``_contains`` (and the hooks of what it
  declares);
* :class:`BytesBackend` when the store moves bytes only (Redis, Valkey, Mooncake, an HTTP object
  store): implement four byte operations and the core does framing, checksums, serde,
  allocation and damage handling; batched and zero-copy byte hooks are optional;
* :class:`Wrapper` for a backend that wraps another (``audit::redis://h:6379``).

The numbered clauses of the contract (docs/concepts.md, "Backends") are stated on the methods
they govern; the ``kvplug-contracts`` suite checks every one of them.

A minimal byte store, complete and correct::

    >>> import asyncio, torch, kvplug
    >>> from kvplug.backend import BytesBackend, Capabilities
    >>> class DictBackend(BytesBackend):
    ...     capabilities = Capabilities(remove=True)
    ...
    ...     def __init__(self, url, **kwargs):
    ...         super().__init__(url, **kwargs)
    ...         self._data: dict[str, bytes] = {}
    ...
    ...     async def get_bytes(self, key):
    ...         return self._data.get(key)
    ...
    ...     async def put_bytes(self, key, parts):
    ...         self._data[key] = b"".join(parts)  # one assignment: readers never see a mix
    ...
    ...     async def contains_bytes(self, key):
    ...         return key in self._data
    ...
    ...     async def remove_bytes(self, key):
    ...         return self._data.pop(key, None) is not None
    >>> async def demo() -> list[object]:
    ...     backend = DictBackend("dict://")
    ...     key = kvplug.CacheKey("llama", 1, 0, 7)
    ...     await backend.put(key, kvplug.MemoryObj.from_tensor(torch.ones(4)))
    ...     got = await backend.get(key)
    ...     await backend.close()
    ...     return [got.tensor.tolist(), backend.operation_stats()["get"].hits]
    >>> asyncio.run(demo())
    [[1.0, 1.0, 1.0, 1.0], 1]

Registered through an entry point (see :mod:`kvplug.registry`), it is opened with
``kvplug.open_backend("dict://")``.
"""

from __future__ import annotations

import abc
import asyncio
import difflib
import dis
import logging
import reprlib
import threading
import time
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Generator,
    Iterable,
    Sequence,
)
from dataclasses import dataclass, fields
from pathlib import Path
from types import CodeType, ModuleType
from typing import (
    TYPE_CHECKING,
    Any,
    ClassVar,
    Generic,
    NoReturn,
    Protocol,
    TypeVar,
    cast,
    runtime_checkable,
)

from kvplug.damage import DamagedValues
from kvplug.errors import (
    BackendClosed,
    BackendError,
    BackendTimeout,
    BackendUnavailable,
    CorruptObject,
    KvplugError,
    LayoutMismatch,
    NotSupported,
    RefCountError,
    UnexpectedBackendError,
    UnknownOption,
)
from kvplug.keys import CacheKey
from kvplug.lazy import lazy_exports
from kvplug.secrets import MASK, install_log_filter, is_secret_name, mask_repr, mask_text, remember
from kvplug.stats import OperationCounters, OperationStats
from kvplug.url import BackendURL

if TYPE_CHECKING:
    from kvplug.frame import FrameReceiver
    from kvplug.memory import Allocator, MemoryObj
    from kvplug.options import BackendOptions, BytesBackendOptions
    from kvplug.serde import Serde

T = TypeVar("T")
Buffer = bytes | bytearray | memoryview
logger = logging.getLogger(__name__)
HOME_POLL_SECONDS = 0.001
"""How often a cancelled call of a :attr:`~Backend.loop_bound` backend from another loop looks
whether the operation has ended on the backend's own loop."""


_memory_module: ModuleType | None = None


def _memory() -> ModuleType:
    """:mod:`kvplug.memory`, imported on first use (it imports torch)."""
    global _memory_module
    if _memory_module is None:
        import kvplug.memory

        _memory_module = kvplug.memory
    return _memory_module


class _Resumed(Generic[T]):
    """The rest of a coroutine that was stepped once by hand and is waiting on ``awaited``:
    awaiting this continues it in the current task, as ``await coroutine`` would have."""

    __slots__ = ("_awaited", "_coroutine")

    def __init__(self, coroutine: Coroutine[Any, Any, T], awaited: Any) -> None:
        self._coroutine = coroutine
        self._awaited = awaited

    def __await__(self) -> Generator[Any, Any, T]:
        coroutine, awaited = self._coroutine, self._awaited
        while True:
            try:
                sent = yield awaited
            except GeneratorExit:
                coroutine.close()
                raise
            except BaseException as error:
                try:
                    awaited = coroutine.throw(error)
                except StopIteration as done:
                    return cast(T, done.value)
            else:
                try:
                    awaited = coroutine.send(sent)
                except StopIteration as done:
                    return cast(T, done.value)


__getattr__ = lazy_exports(__name__, {"kvplug.options": ("BackendOptions", "BytesBackendOptions")})


def error_text(error: BaseException, limit: int = 500) -> str:
    """The text of ``error`` as a message of kvplug's shows it: secrets masked
    (:func:`~kvplug.secrets.mask_text`) and cut to about ``limit`` characters, since a client
    library may put a whole command, value and all, into its error.

    Example::

        >>> text = error_text(ValueError("redis://app:s3cret@h:1 refused: " + "x" * 900))
        >>> text[:32], text[-12:], len(text)
        ('redis://app:***@h:1 refused: xxx', 'xxx... (cut)', 509)
    """
    text = str(error)
    if len(text) > 4 * limit:  # masking reads it all: the part shown, with room to spare
        text = text[: 4 * limit]
    text = mask_text(text)
    if len(text) > limit:
        text = f"{text[:limit]}... (cut)"
    return text


async def gather_all(operations: Iterable[Awaitable[T]]) -> list[T]:
    """Await ``operations`` concurrently; once every one has finished, raise the first error,
    else return the results in order. Nothing is left running when it raises."""
    results = await asyncio.gather(*operations, return_exceptions=True)
    error = next((r for r in results if isinstance(r, BaseException)), None)
    if error is not None:
        raise error
    return cast(list[T], results)


async def _gather_reads(reads: Iterable[Awaitable[MemoryObj | None]]) -> list[MemoryObj | None]:
    """The objects ``reads`` return, awaited concurrently, in order. When one fails, or the
    caller is cancelled, nothing they read stays allocated: the reads still running are
    cancelled and awaited, every object read is released, and the error (or cancellation) is
    raised."""
    tasks = [asyncio.ensure_future(read) for read in reads]
    try:
        results = await asyncio.gather(*tasks, return_exceptions=True)
    except asyncio.CancelledError as first:
        # gather cancelled the reads; some may have finished first, holding an object each.
        last = first
        while not all(task.done() for task in tasks):
            try:
                await asyncio.wait(tasks)
            except asyncio.CancelledError as again:
                last = again
        _release_objects(
            task.result() for task in tasks if not task.cancelled() and task.exception() is None
        )
        raise last from None
    error = next((r for r in results if isinstance(r, BaseException)), None)
    objs = [r for r in results if not isinstance(r, BaseException)]
    if error is not None:
        _release_objects(objs)
        raise error
    return objs


async def _put_each(
    backend: Backend, keys: Sequence[object], puts: Iterable[Awaitable[None]]
) -> None:
    """Await ``puts`` (one per key) concurrently; once all have finished, raise the first error
    as a kvplug error (:meth:`Backend.translate_error`) whose ``stored`` tells which keys were
    stored, and whose message says so when some were."""
    results = await asyncio.gather(*puts, return_exceptions=True)
    error = next((r for r in results if isinstance(r, BaseException)), None)
    if error is None:
        return
    if not isinstance(error, Exception):
        raise error
    translated = backend.translate_error("batched_put", error, [keys])
    stored = tuple(not isinstance(r, BaseException) for r in results)
    if isinstance(translated, BackendError) and translated.stored is None and any(stored):
        position = results.index(error)
        message = (
            f"batched_put of {len(keys)} objects into {backend.url}: {sum(stored)} stored and "
            f"{stored.count(False)} not; the stored ones stay stored and readable. The first "
            f"failure, of {keys[position]} (position {position}): {translated}"
        )
        try:
            translated = type(translated)(message)
        except TypeError:  # a plugin's error class with arguments of its own
            translated = BackendError(message)
    if isinstance(translated, BackendError) and translated.stored is None:
        translated.stored = stored
    if translated is error:
        raise error
    raise translated from error


def fill_into(
    found: Sequence[MemoryObj | None], dests: Sequence[MemoryObj], keys: Sequence[CacheKey]
) -> list[bool]:
    """Copy each object of ``found`` into the ``dests`` object at its position (one that
    already is its destination is left as it is), release every object of ``found``, and say
    which destinations now hold their object: the end of a ``get_into`` that read into memory
    of its own. An object of another size than its destination raises
    :class:`~kvplug.errors.LayoutMismatch` naming its key (``keys`` are aligned with
    ``found``)."""
    hits = []
    try:
        for key, got, dest in zip(keys, found, dests, strict=True):
            if got is not None and got.nbytes != dest.nbytes:
                raise LayoutMismatch.between(
                    key, (got.shape, got.dtype, got.nbytes), (dest.shape, dest.dtype, dest.nbytes)
                )
            hits.append(got is not None)
            if got is not None and got is not dest:
                dest.raw.copy_(got.raw)
    finally:
        for got in found:
            if got is not None:
                got.release()
    return hits


def leading_present(found: Sequence[bool]) -> int:
    """How many leading entries of ``found`` are true: ``batched_contains`` from
    ``batched_exists``."""
    return next((i for i, present in enumerate(found) if not present), len(found))


@dataclass(frozen=True)
class Capabilities:
    """What a backend declares it can do. Declared means it works; undeclared operations raise
    :class:`~kvplug.errors.NotSupported` (clause 13). A capability named like a method gates
    that method, and declaring it requires the method's hook."""

    pin: bool = False
    """``pin``/``unpin`` keep keys from eviction (clause 8). Hooks: ``_pin``, ``_unpin``."""
    persistent: bool = False
    """Data survives ``close`` and a new ``open_backend`` of the same URL (clause 14)."""
    shared_across_processes: bool = False
    """Another process opening the same URL sees the same objects."""
    zero_copy: bool = False
    """``get`` can return memory without copying it (host-memory tiers)."""
    native_batching: bool = False
    """The batched operations are one round trip, not a loop: the backend implements their
    hooks (``_batched_get``, ``_batched_put``, ``_batched_exists``, or a byte store's
    ``batched_*_bytes``)."""
    remove: bool = False
    """``remove`` deletes stored objects; without it ``remove`` raises ``NotSupported``.
    Hook: ``_remove`` (a byte store's ``remove_bytes``)."""
    list_keys: bool = False
    """``list_keys`` enumerates stored keys. Hook: ``_list_keys``."""
    device_memory: bool = False
    """``get`` may return objects in GPU memory."""
    releases_on_cancel: bool = False
    """An operation that is cancelled (a caller's deadline) has stopped reading and writing the
    caller's objects by the time its cancellation has finished: the caller may reuse a buffer
    as soon as the cancelled call returns, and nothing the backend does afterwards touches it
    (``put`` and ``get_into`` and their batched forms; a put that was cancelled stores nothing
    read from the buffer after the cancellation). Engine integrations lend such a backend
    their own buffers; others get a copy taken at submit (stores) and read into kvplug's own
    memory (loads). A backend whose threads touch caller memory declares it only with
    :class:`~kvplug.lease.Lease`: every access inside :meth:`~kvplug.lease.Lease.use`, and the
    cancellation awaiting :meth:`~kvplug.lease.Lease.revoke`. The contract suite checks it."""

    def declared(self) -> tuple[str, ...]:
        """Names of the declared capabilities."""
        return tuple(f.name for f in fields(self) if getattr(self, f.name))


# -- protocols the contract suite (and tools) use to look inside a backend ------------------


@runtime_checkable
class Wraps(Protocol):
    """A backend over another: :class:`Wrapper` s and anything else with an ``inner``."""

    inner: Backend


@runtime_checkable
class CountsCorruptObjects(Protocol):
    """A backend that counts the damaged objects it read as misses (clause 6); keep the count
    in a :class:`~kvplug.damage.DamagedValues`, which also logs and removes them."""

    @property
    def corrupt_objects(self) -> int:
        """Damaged values read as misses so far."""
        ...


@runtime_checkable
class StoredFiles(Protocol):
    """A backend that keeps each key in local files, and can say which ones (so the suite can
    damage them, clause 6)."""

    def stored_files(self, key: CacheKey) -> list[Path]:
        """The files that hold ``key`` now (none when it is absent)."""
        ...


@runtime_checkable
class RawValues(Protocol):
    """A backend whose stored value for a key can be read and overwritten as bytes, under the
    contract (so the suite can damage it, clause 6). Every :class:`BytesBackend` is one."""

    async def read_raw(self, key: CacheKey) -> bytes | None:
        """The bytes stored for ``key``, or ``None`` when absent."""
        ...

    async def write_raw(self, key: CacheKey, data: bytes) -> None:
        """Replace what is stored for ``key`` with ``data`` as it is (no framing)."""
        ...


_TEMPLATE_METHODS = frozenset(
    {
        "open",
        "close",
        "get",
        "put",
        "contains",
        "remove",
        "get_into",
        "batched_get",
        "batched_put",
        "batched_contains",
        "batched_exists",
        "batched_get_into",
        "pin",
        "unpin",
        "list_keys",
    }
)

_TEMPLATE_STATE = frozenset({"_closed", "_opened", "_home_loop", "_close_lock", "_counters"})
"""The instance attributes the template keeps its own state in (``_allocator`` is not one: an
``allocator`` property of a subclass may set it)."""


def _template_internals(cls: type) -> set[str]:
    """The private names the template classes ``cls`` derives from use for their own workings:
    their helpers (``_run_hook``, a byte store's ``_read``) and their state, not the hooks."""
    hooks = {"_" + name for name in _TEMPLATE_METHODS}
    names = set(_TEMPLATE_STATE)
    for base in cls.__mro__[1:]:
        if base.__module__ == __name__:
            names.update(
                name
                for name in base.__dict__
                if name.startswith("_")
                and not name.startswith("__")
                and name not in hooks
                and name not in {"_GATES", "_abc_impl"}
            )
    return names


def _assigned_on_self(cls: type) -> set[str]:
    """The attributes the functions ``cls`` defines assign on ``self`` (``self.x = ...``), in
    nested functions too."""
    assigned: set[str] = set()
    codes: list[CodeType] = []
    for value in cls.__dict__.values():
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        parts = (value.fget, value.fset, value.fdel) if isinstance(value, property) else (value,)
        codes.extend(code for part in parts if (code := getattr(part, "__code__", None)))
    while codes:
        code = codes.pop()
        codes.extend(const for const in code.co_consts if isinstance(const, CodeType))
        previous = None
        for instruction in dis.get_instructions(code):
            if (
                instruction.opname == "STORE_ATTR"
                and previous is not None
                and previous.opname in {"LOAD_FAST", "LOAD_DEREF"}
                and previous.argval == "self"
            ):
                assigned.add(instruction.argval)
            previous = instruction
    return assigned


class _DefaultOptions:
    """``Backend.Options`` until a subclass names its own: the options model, imported on
    first use so that importing the contract does not import pydantic."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, instance: object, owner: type) -> type[BackendOptions]:
        import kvplug.options

        return cast("type[BackendOptions]", getattr(kvplug.options, self.name))


class Backend(abc.ABC):
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

    _GATES: ClassVar[dict[str, tuple[str, ...]]] = {
        "pin": ("_pin", "_unpin"),
        "remove": ("_remove",),
        "list_keys": ("_list_keys",),
        "native_batching": ("_batched_get", "_batched_put", "_batched_exists"),
    }
    """The hooks each capability needs (``a|b``: either); a class that declares the capability
    and keeps the default of a hook (the one of the class defining ``_GATES``) is refused."""

    loop_bound: ClassVar[bool] = False
    """True for a backend whose state (clients, tasks, asyncio primitives) belongs to the event
    loop it is first used on: the template then runs every hook on that loop, also for callers
    on other loops and threads (while that loop runs). False: hooks run on the caller's loop,
    so the backend must not keep loop-bound state."""

    runs_inline: ClassVar[bool] = False
    """True for a backend whose operations never wait (no I/O, no asyncio primitives, no need
    for a running loop) and whose state is guarded by thread locks, so that any thread can run
    an operation to its end by stepping the coroutine once. :class:`~kvplug.runtime.sync.SyncClient`
    then runs operations on the caller's thread instead of handing each to its IO thread and
    back, which costs about 100 µs per call, far more than an in-memory operation. An
    operation that waits after all fails there with :class:`~kvplug.errors.KvplugError`.
    Example: ``kvplug-cpu`` sets it; a network backend must not."""

    capabilities: Capabilities = Capabilities()
    """What this backend can do; a class attribute, or set per instance (a wrapper's are its
    inner backend's)."""
    Options: ClassVar[type[BackendOptions]] = cast(
        "type[BackendOptions]", _DefaultOptions("BackendOptions")
    )

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        overridden = sorted(_TEMPLATE_METHODS & cls.__dict__.keys())
        if overridden:
            raise TypeError(
                f"{cls.__qualname__} defines {', '.join(overridden)}, which kvplug.Backend "
                "implements for every backend (open check, deadline, argument checks, counters, "
                "references). Implement the hook instead: "
                f"{', '.join('_' + name for name in overridden)}."
            )
        if cls.__module__.partition(".")[0] != "kvplug":  # kvplug's own (Store) are template
            internals = _template_internals(cls)
            clashes = sorted(
                (internals & cls.__dict__.keys()) | (internals & _assigned_on_self(cls))
            )
            if clashes:
                raise TypeError(
                    f"{cls.__qualname__} defines or assigns {', '.join(clashes)}, which the "
                    "kvplug template it derives from uses for its own workings; yours would "
                    "replace it and break every operation. Rename yours (for example "
                    f"{clashes[0][0]}{cls.__name__.lower()}{clashes[0]})."
                )
        capabilities = cls.__dict__.get("capabilities")
        if isinstance(capabilities, Capabilities):
            for name in capabilities.declared():
                missing = cls.missing_hooks(name)
                if missing:
                    raise TypeError(
                        f"{cls.__qualname__} declares the {name!r} capability but does not "
                        f"implement {', '.join(missing)}. Implement them, or do not declare "
                        f"{name!r} (undeclared, the operation raises NotSupported)."
                    )

    @classmethod
    def missing_hooks(cls, capability: str) -> list[str]:
        """The hooks ``capability`` needs that this class leaves at their defaults (``a|b``:
        neither is implemented); empty when it implements them all."""
        base = next(c for c in cls.__mro__ if "_GATES" in c.__dict__)
        return [
            hook
            for hook in cls._GATES.get(capability, ())
            if all(getattr(cls, h) is getattr(base, h) for h in hook.split("|"))
        ]

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
        from pydantic import ValidationError

        merged: dict[str, Any] = {**url.options, **explicit}
        remember(*(value for name, value in merged.items() if is_secret_name(name)))
        model = cls.Options
        known = sorted(model.model_fields)
        for name in merged:
            if name == "serde" and name not in model.model_fields:
                raise UnknownOption(
                    f"{cls.__name__} ({url.scheme}://) stores each object's own bytes and has "
                    f"no 'serde' option, so serde {merged[name]!r} cannot apply. Leave it out "
                    "(in an LMCache config: remote_serde: naive)."
                )
            if name not in model.model_fields:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise UnknownOption(
                    f"{cls.__name__} ({url.scheme}://) has no option {name!r}.{hint} "
                    f"Valid options: {', '.join(known)}."
                )
        try:
            return model.model_validate(merged)
        except ValidationError as error:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc'])}={_shown_input(e['loc'], e.get('input'))}: "
                + mask_text(e["msg"])
                for e in error.errors()
            )
            raise UnknownOption(
                f"{cls.__name__} ({url}) got an invalid option: {problems}. "
                "Fix the value in the URL query or the config."
            ) from None

    @property
    def allocator(self) -> Allocator:
        """Where objects returned by ``get`` are allocated."""
        if self._allocator is None:
            self._allocator = _memory().shared_host_allocator()
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
          failing), and so is the ``RuntimeError`` of a hook that needs an event loop where
          none runs (:class:`~kvplug.runtime.sync.SyncClient` reports it for a :attr:`runs_inline`
          backend that waited);
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
        if isinstance(error, (KvplugError, MemoryError)) or _needs_a_loop(error):
            return error
        where = f"{operation}{_of_keys(args)} on {self.url}"
        cause = f"{type(error).__name__}: {error_text(error)}"
        if isinstance(error, ConnectionError):
            return BackendUnavailable(
                f"{where} failed: the connection to the store broke ({cause}). Retryable: "
                "operations succeed again once the store answers; check it if this persists."
            )
        if isinstance(error, TimeoutError):
            return BackendTimeout(
                f"{where} timed out ({cause}): the store is slow or unreachable. Check it, or "
                "raise the 'timeout' option."
            )
        if isinstance(error, OSError):
            return BackendError(
                f"{where} failed: the system refused it ({cause}). Check the device, path, "
                "permissions or free space the backend uses."
            )
        owner = type(self).__module__.partition(".")[0]
        return UnexpectedBackendError(
            f"{where} failed: {type(self).__qualname__} raised {cause}, which is not a kvplug "
            "error: a bug in the backend or its client library, or a failure it does not "
            "translate (a connection closed under it during a failover, say); the original "
            f"error is this one's cause. Retry; if it persists, report it to the maintainers "
            f"of {owner} with this message."
        )

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
            loop = asyncio.get_running_loop()
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
            # A timer per call costs more than a whole in-memory operation, and only a hook
            # that waits can overrun: the deadline (from the call's start) is armed at the
            # hook's first wait, and a hook that finishes without waiting needs none.
            coroutine = cast("Coroutine[Any, Any, T]", hook(*args))
            try:
                awaited = coroutine.send(None)
            except StopIteration as done:
                return cast(T, done.value)
            deadline = asyncio.timeout_at(asyncio.get_running_loop().time() + limit)
            try:
                async with deadline:
                    return await _Resumed(coroutine, awaited)
            except TimeoutError:
                if not deadline.expired():
                    raise  # the hook's own, not the deadline: translated below
                raise BackendTimeout(
                    f"{operation}{_of_keys(args)} on {self.url} took longer than {limit} s; the "
                    "store is slow or unreachable. Raise the 'timeout' option or check the store."
                ) from None
        except BaseException as error:
            self._counters.count(operation, started, errors=1)
            self._hook_failed(operation, args, error)

    def _refused_result(
        self, operation: str, started: float, message: str, others: Iterable[object] = ()
    ) -> TypeError:
        """The error for a hook's result the template refuses (counted as a failed call),
        once the objects in ``others`` are released."""
        _release_objects(others)
        self._counters.count(operation, started, errors=1)
        return TypeError(message)

    def _check_result(
        self, operation: str, started: float, obj: object, hook: str, others: Sequence[object] = ()
    ) -> None:
        if not isinstance(obj, _memory().MemoryObj):
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
        if home.is_closed() or not home.is_running():
            work.close()
            raise BackendUnavailable(
                f"{self.url} belongs to an event loop that is no longer running, so it cannot "
                "serve this one. Use a backend from the loop that first used it, or keep that "
                "loop running (kvplug.runtime.sync.SyncClient does)."
            )
        ended = threading.Event()

        async def tracked() -> T:
            try:
                return await work
            finally:
                ended.set()

        running = asyncio.run_coroutine_threadsafe(tracked(), home)
        try:
            return await asyncio.wrap_future(running)
        except asyncio.CancelledError:
            # The cancellation reaches the home loop's task later: the caller's objects are
            # handed back only once that task has ended (a cancelled get_into or put there
            # must not outlive the call), or once the home loop is gone.
            running.cancel()
            interrupted = None
            while not ended.is_set() and not home.is_closed():
                try:
                    await asyncio.sleep(HOME_POLL_SECONDS)
                except asyncio.CancelledError as again:
                    interrupted = again
            if interrupted is not None:
                raise interrupted from None
            raise

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
        _check_key(key, "get")
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
        _check_key(key, "put")
        _check_obj(obj, "put")
        started = time.perf_counter()
        obj.retain()
        try:
            await self._call_hook("put", started, self._put, key, obj)
        finally:
            obj.release()
        self._counters.count("put", started, 0, 0, obj.nbytes, keys=1)

    async def contains(self, key: CacheKey) -> bool:
        """Whether ``get`` would hit now (clause 7: no "exists but cannot be read")."""
        _check_key(key, "contains")
        started = time.perf_counter()
        found = bool(await self._call_hook("contains", started, self._contains, key))
        self._counters.count("contains", started, int(found), int(not found))
        return found

    async def remove(self, key: CacheKey) -> bool:
        """Delete ``key``: True if it was there, False if absent (clause 7). Needs the
        ``remove`` capability; without it raises :class:`~kvplug.errors.NotSupported`."""
        _check_key(key, "remove")
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
        _check_key(key, "get_into")
        _check_obj(dest, "get_into")
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
        _check_keys(keys, "batched_get")
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
        _check_keys(keys, "batched_put")
        if len(keys) != len(objs):
            raise ValueError(f"batched_put got {len(keys)} keys but {len(objs)} objects.")
        for obj in objs:
            _check_obj(obj, "batched_put")
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
        _check_keys(keys, "batched_contains")
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
        _check_keys(keys, "batched_exists")
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
        _check_keys(keys, "batched_get_into")
        if len(keys) != len(dests):
            raise ValueError(f"batched_get_into got {len(keys)} keys but {len(dests)} objects.")
        for dest in dests:
            _check_obj(dest, "batched_get_into")
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
        _check_key(key, "pin")
        self.ensure_open()
        self._require_capability("pin", "cannot pin keys")
        return bool(await self._run_hook("pin", self._pin, key))

    async def unpin(self, key: CacheKey) -> bool:
        """Undo one :meth:`pin`. Always succeeds; True if a pin was released (clause 8)."""
        _check_key(key, "unpin")
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

    def _unsupported(self, capability: str) -> NotSupported:
        """The error of a hook this backend does not implement: reached only past the
        template's capability gate (a backend that declares ``capability`` is refused at class
        creation unless it implements the hook)."""
        return NotSupported(
            f"{type(self).__name__} ({self.url.scheme}://) does not implement the hooks of "
            f"the {capability!r} capability ({', '.join(self.missing_hooks(capability))})."
        )

    # -- hooks -----------------------------------------------------------------------------

    async def _open(self) -> None:
        """Connect or prepare. Default: nothing."""

    async def _close(self) -> None:
        """Release every resource; called once. Default: nothing."""

    @abc.abstractmethod
    async def _get(self, key: CacheKey) -> MemoryObj | None:
        """The object stored under ``key`` (a new reference, the caller's) or ``None``."""

    @abc.abstractmethod
    async def _put(self, key: CacheKey, obj: MemoryObj) -> None:
        """Store ``obj`` under ``key``, atomically. Retain ``obj`` to keep it after this
        returns; the caller's reference is not this hook's to release."""

    @abc.abstractmethod
    async def _contains(self, key: CacheKey) -> bool:
        """Whether ``key`` is stored and readable."""

    async def _remove(self, key: CacheKey) -> bool:
        """Delete ``key``; True if it was there. Required with the ``remove`` capability."""
        raise self._unsupported("remove")

    async def _get_into(self, key: CacheKey, dest: MemoryObj) -> bool:
        """Read ``key`` into ``dest``; the default is :meth:`_get` and one copy."""
        return fill_into([await self._get(key)], [dest], [key])[0]

    async def _batched_get(self, keys: Sequence[CacheKey]) -> list[MemoryObj | None]:
        """``_get`` of each key, concurrently; every object read is released if one fails or
        the call is cancelled."""
        return await _gather_reads(self._get(k) for k in keys)

    async def _batched_put(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]) -> None:
        """``_put`` of each pair, concurrently; once all have finished, the first error, which
        tells which keys were stored (``stored``)."""
        await _put_each(self, keys, (self._put(k, o) for k, o in zip(keys, objs, strict=True)))

    async def _batched_contains(self, keys: Sequence[CacheKey]) -> int:
        """The count of leading keys present, from :meth:`_batched_exists`."""
        return leading_present(await self._batched_exists(keys))

    async def _batched_exists(self, keys: Sequence[CacheKey]) -> list[bool]:
        """``_contains`` of each key, concurrently, aligned with ``keys``. Override it with one
        round trip (a pipeline, a multi-exists, one pass over an index); ``batched_contains``
        follows from it."""
        return [bool(found) for found in await gather_all(self._contains(k) for k in keys)]

    async def _batched_get_into(
        self, keys: Sequence[CacheKey], dests: Sequence[MemoryObj]
    ) -> list[bool]:
        """The default is one :meth:`_batched_get` and one copy per hit."""
        return fill_into(await self._batched_get(keys), dests, keys)

    async def _pin(self, key: CacheKey) -> bool:
        """Pin ``key``; False if absent. Required with the ``pin`` capability."""
        raise self._unsupported("pin")

    async def _unpin(self, key: CacheKey) -> bool:
        """Release one pin of ``key``; never raises for a key without pins."""
        raise self._unsupported("pin")

    def _list_keys(self) -> AsyncIterator[CacheKey]:
        """Every stored key. Required with the ``list_keys`` capability."""
        raise self._unsupported("list_keys")

    async def __aenter__(self) -> Backend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.url)!r})"


def _needs_a_loop(error: Exception) -> bool:
    """Whether ``error`` is what a hook that waits meets when stepped on a thread where no event
    loop runs (:class:`~kvplug.runtime.sync.SyncClient`'s inline path reports it as such)."""
    if not (isinstance(error, RuntimeError) and "no running event loop" in str(error)):
        return False
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return True
    return False


def _of_keys(args: Sequence[object]) -> str:
    """`` of <key>`` (or of the first of several keys) for a message about an operation."""
    for arg in args:
        if isinstance(arg, CacheKey):
            return f" of {arg}"
        if isinstance(arg, Sequence) and arg and isinstance(arg[0], CacheKey):
            more = f" and {len(arg) - 1} more key(s)" if len(arg) > 1 else ""
            return f" of {arg[0]}{more}"
    return ""


def _check_key(key: object, operation: str) -> None:
    if not isinstance(key, CacheKey):
        raise TypeError(
            f"{operation} needs a kvplug.CacheKey, got {type(key).__name__}; build one with "
            "CacheKey(model_name, world_size, worker_id, chunk_hash)."
        )


def _check_keys(keys: object, operation: str) -> None:
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
        raise TypeError(
            f"{operation} needs a sequence of kvplug.CacheKey, got {type(keys).__name__}."
        )
    for key in keys:
        _check_key(key, operation)


def _check_obj(obj: object, operation: str) -> None:
    memory = _memory()
    if not isinstance(obj, memory.MemoryObj):
        raise TypeError(
            f"{operation} needs a kvplug.MemoryObj, got {type(obj).__name__}; wrap a tensor "
            "with MemoryObj.from_tensor() or allocate one from an allocator."
        )
    if not obj.is_valid:
        raise RefCountError(
            f"{operation} got a memory object that was already freed ({obj!r}); keep a "
            "reference until the operation returns."
        )


def _release_objects(objs: Iterable[object]) -> None:
    memory_obj = _memory().MemoryObj
    for obj in objs:
        if isinstance(obj, memory_obj):
            obj.release()


def _shown_input(location: tuple[int | str, ...], value: object) -> str:
    """An option's rejected value as an error shows it: masked when any name on its path
    looks secret, whatever its type."""
    if any(is_secret_name(name) for name in location):
        return MASK
    return mask_repr(value)


class Wrapper(Backend):
    """Base of wrappers: a backend over another backend, written before it with ``::``
    (``audit::redis://h:6379``). The registry constructs it with its own URL and
    ``inner=<the wrapped backend>``.

    Every hook forwards to the same public operation of :attr:`inner` (so its batching,
    zero-copy reads and deadlines are kept); a wrapper overrides the hooks it adds behaviour to
    and calls ``self.inner``. Its capabilities and allocator are the inner backend's, its
    ``open`` and ``close`` open and close the inner backend, and it keeps no deadline of its
    own (the inner backend's applies).

    Example::

        >>> import asyncio, kvplug
        >>> from kvplug.backend import Wrapper
        >>> class CountingWrapper(Wrapper):
        ...     async def _get(self, key):
        ...         self.reads = getattr(self, "reads", 0) + 1
        ...         return await self.inner.get(key)
        >>> async def demo() -> int:
        ...     inner = await kvplug.open_backend("cpu://")
        ...     wrapper = CountingWrapper("count://", inner=inner)
        ...     await wrapper.get(kvplug.CacheKey("llama", 1, 0, 7))
        ...     await wrapper.close()
        ...     return wrapper.reads
        >>> asyncio.run(demo())
        1
    """

    def __init__(
        self,
        url: BackendURL | str,
        *,
        inner: Backend,
        allocator: Allocator | None = None,
        **options: Any,
    ) -> None:
        super().__init__(url, allocator=allocator, **options)
        self.inner = inner
        self.capabilities = inner.capabilities

    @property
    def allocator(self) -> Allocator:
        """The inner backend's allocator: objects from ``get`` come from there."""
        return self.inner.allocator

    def deadline(self) -> float | None:
        return None

    def describe(self) -> dict[str, str]:
        return self.inner.describe()

    async def _open(self) -> None:
        await self.inner.open()

    async def _close(self) -> None:
        await self.inner.close()

    async def _get(self, key: CacheKey) -> MemoryObj | None:
        return await self.inner.get(key)

    async def _put(self, key: CacheKey, obj: MemoryObj) -> None:
        await self.inner.put(key, obj)

    async def _contains(self, key: CacheKey) -> bool:
        return await self.inner.contains(key)

    async def _remove(self, key: CacheKey) -> bool:
        return await self.inner.remove(key)

    async def _get_into(self, key: CacheKey, dest: MemoryObj) -> bool:
        return await self.inner.get_into(key, dest)

    async def _batched_get(self, keys: Sequence[CacheKey]) -> list[MemoryObj | None]:
        return await self.inner.batched_get(keys)

    async def _batched_put(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]) -> None:
        await self.inner.batched_put(keys, objs)

    async def _batched_contains(self, keys: Sequence[CacheKey]) -> int:
        return await self.inner.batched_contains(keys)

    async def _batched_exists(self, keys: Sequence[CacheKey]) -> list[bool]:
        return await self.inner.batched_exists(keys)

    async def _batched_get_into(
        self, keys: Sequence[CacheKey], dests: Sequence[MemoryObj]
    ) -> list[bool]:
        return await self.inner.batched_get_into(keys, dests)

    async def _pin(self, key: CacheKey) -> bool:
        return await self.inner.pin(key)

    async def _unpin(self, key: CacheKey) -> bool:
        return await self.inner.unpin(key)

    def _list_keys(self) -> AsyncIterator[CacheKey]:
        return self.inner.list_keys()


class BytesBackend(Backend):
    """Base of stores that move bytes only. Implement the four ``*_bytes`` hooks; the core
    frames each object (header, checksums, payload; :mod:`kvplug.frame`), applies the serde,
    allocates what ``get`` returns and turns damaged frames into counted, deleted misses.

    Each object is stored as **one** value holding the whole frame, so data and metadata can
    never disagree, and a value is written in one store operation, so readers never see a mix.

    Optional hooks, for stores that do better than one call per key or than a copy:

    * :meth:`batched_get_bytes`, :meth:`batched_put_bytes`, :meth:`batched_exists_bytes`:
      one round trip for many keys (a pipeline, a multi-get);
    * :meth:`receive_frames`: zero-copy reads. A transport that receives a value in pieces
      (a socket, a file) hands each piece to a :class:`~kvplug.frame.FrameReceiver`, which
      puts the payload straight into the memory the caller gets (``get_into``'s buffer, or the
      object ``get`` returns), verifies it and reports damage.

    Every hook receives the store key (:meth:`key_string`: ``key_prefix`` and LMCache's key
    string), already checked, only while the backend is open and within its deadline.
    """

    Options: ClassVar[type[BackendOptions]] = cast(
        "type[BackendOptions]", _DefaultOptions("BytesBackendOptions")
    )
    options: BytesBackendOptions
    _GATES: ClassVar[dict[str, tuple[str, ...]]] = {
        **Backend._GATES,
        "remove": ("remove_bytes",),
        "native_batching": (
            "batched_get_bytes|receive_frames",
            "batched_put_bytes",
            "batched_exists_bytes",
        ),
    }

    def __init__(
        self, url: BackendURL | str, *, allocator: Allocator | None = None, **options: Any
    ) -> None:
        super().__init__(url, allocator=allocator, **options)
        from kvplug.serde import get_serde

        self.serde: Serde = get_serde(self.options.serde)
        # Deleted with remove_bytes also where the store does not declare remove but has it.
        self.damaged_values = DamagedValues[str](
            self.url, remove=None if self.missing_hooks("remove") else self.remove_bytes
        )
        """Damaged values read as misses, counted, logged and deleted (clause 6)."""

    @property
    def corrupt_objects(self) -> int:
        """:class:`CountsCorruptObjects`: damaged values read as misses so far."""
        return self.damaged_values.count

    def key_string(self, key: CacheKey) -> str:
        """The store key for ``key``: the prefix and LMCache's string form."""
        return self.options.key_prefix + key.to_string()

    # -- byte hooks ------------------------------------------------------------------------

    @abc.abstractmethod
    async def get_bytes(self, key: str) -> Buffer | None:
        """The stored value, or ``None`` when absent."""

    @abc.abstractmethod
    async def put_bytes(self, key: str, parts: Sequence[Buffer]) -> None:
        """Store the concatenation of ``parts`` as one value, replacing any old one atomically.
        The parts are valid only until this returns."""

    @abc.abstractmethod
    async def contains_bytes(self, key: str) -> bool:
        """Whether a value is stored under ``key``."""

    async def remove_bytes(self, key: str) -> bool:
        """Delete ``key``'s value; True if it was there. Required with the ``remove``
        capability; without it, damaged values cannot be deleted and are only counted."""
        raise self._unsupported("remove")

    async def batched_get_bytes(self, keys: Sequence[str]) -> list[Buffer | None]:
        """:meth:`get_bytes` of each key, aligned; default: concurrently, one call each."""
        return await gather_all(self.get_bytes(key) for key in keys)

    async def batched_put_bytes(
        self, keys: Sequence[str], values: Sequence[Sequence[Buffer]]
    ) -> None:
        """:meth:`put_bytes` of each pair; default: concurrently, one call each, and the first
        error once all have finished, telling which keys were stored (``stored``)."""
        await _put_each(
            self, keys, (self.put_bytes(k, v) for k, v in zip(keys, values, strict=True))
        )

    async def batched_exists_bytes(self, keys: Sequence[str]) -> list[bool]:
        """:meth:`contains_bytes` of each key, aligned; default: concurrently, one call each."""
        return await gather_all(self.contains_bytes(key) for key in keys)

    async def receive_frames(self, keys: Sequence[str], receivers: Sequence[FrameReceiver]) -> None:
        """Read the value of each key into its receiver: for a stored value call
        ``receivers[i].start(length)`` and feed it (see :class:`~kvplug.frame.FrameReceiver`);
        for an absent key leave it untouched. The default is one :meth:`batched_get_bytes` and
        :meth:`~kvplug.frame.FrameReceiver.receive` of each value (one copy of the payload).

        A transport that may still write into a receiver's memory after this returns or
        raises (a socket buffer) must be stopped first: abort it before raising."""
        for value, receiver in zip(await self.batched_get_bytes(keys), receivers, strict=True):
            if value is not None:
                receiver.receive(value)

    # -- the object hooks, on the byte hooks -----------------------------------------------

    async def read_raw(self, key: CacheKey) -> bytes | None:
        """:class:`RawValues`: the stored frame of ``key`` as it is."""
        self.ensure_open()
        try:
            value = await self.get_bytes(self.key_string(key))
        except Exception as error:
            self._hook_failed("read_raw", (key,), error)
        return None if value is None else bytes(value)

    async def write_raw(self, key: CacheKey, data: bytes) -> None:
        """:class:`RawValues`: overwrite the stored value of ``key`` with ``data``."""
        self.ensure_open()
        try:
            await self.put_bytes(self.key_string(key), [data])
        except Exception as error:
            self._hook_failed("write_raw", (key,), error)

    async def _read(
        self, keys: Sequence[CacheKey], dests: Sequence[MemoryObj | None]
    ) -> list[MemoryObj | None]:
        from kvplug.frame import FrameReceiver

        names = [self.key_string(key) for key in keys]
        receivers = [FrameReceiver(self.allocator, into=dest) for dest in dests]
        results: list[MemoryObj | None] = []
        damaged: dict[str, CorruptObject] = {}
        try:
            await self.receive_frames(names, receivers)
            for name, receiver in zip(names, receivers, strict=True):
                try:
                    results.append(receiver.finish())
                except CorruptObject as error:
                    results.append(None)
                    damaged[name] = error
        except BaseException:
            for receiver in receivers:
                receiver.abandon()
            _release_objects(results)
            raise
        await self.damaged_values.drop(damaged)
        for key, receiver in zip(keys, receivers, strict=True):
            if receiver.mismatch is not None and receiver.into is not None:
                _release_objects(results)
                header, into = receiver.mismatch, receiver.into
                raise LayoutMismatch.between(
                    key,
                    (header.shape, header.dtype, header.payload_len),
                    (into.shape, into.dtype, into.nbytes),
                )
        return results

    async def _get(self, key: CacheKey) -> MemoryObj | None:
        return (await self._read([key], [None]))[0]

    async def _batched_get(self, keys: Sequence[CacheKey]) -> list[MemoryObj | None]:
        return await self._read(keys, [None] * len(keys))

    async def _get_into(self, key: CacheKey, dest: MemoryObj) -> bool:
        return fill_into(await self._read([key], [dest]), [dest], [key])[0]

    async def _batched_get_into(
        self, keys: Sequence[CacheKey], dests: Sequence[MemoryObj]
    ) -> list[bool]:
        return fill_into(await self._read(keys, dests), dests, keys)

    async def _put(self, key: CacheKey, obj: MemoryObj) -> None:
        from kvplug.frame import encode_frame

        await self.put_bytes(self.key_string(key), encode_frame(obj, self.serde))

    async def _batched_put(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]) -> None:
        from kvplug.frame import encode_frame

        await self.batched_put_bytes(
            [self.key_string(key) for key in keys], [encode_frame(obj, self.serde) for obj in objs]
        )

    async def _contains(self, key: CacheKey) -> bool:
        return await self.contains_bytes(self.key_string(key))

    async def _batched_exists(self, keys: Sequence[CacheKey]) -> list[bool]:
        return await self.batched_exists_bytes([self.key_string(key) for key in keys])

    async def _remove(self, key: CacheKey) -> bool:
        return await self.remove_bytes(self.key_string(key))


__all__ = [
    "Backend",
    "BackendOptions",
    "Buffer",
    "BytesBackend",
    "BytesBackendOptions",
    "Capabilities",
    "CountsCorruptObjects",
    "OperationStats",
    "RawValues",
    "StoredFiles",
    "Wrapper",
    "Wraps",
    "error_text",
    "fill_into",
    "gather_all",
    "leading_present",
]
