"""The backend contract: what every storage backend of kvplug does, and how.

A backend stores :class:`~kvplug.memory.MemoryObj` s under :class:`~kvplug.keys.CacheKey` s and
returns them bit-exact, or reports a miss. It is ``async``: engines reach it from worker threads
through :class:`~kvplug.sync.SyncClient`, so vendors never write synchronous code.

There are two ways to write one:

* subclass :class:`Backend` when the store can hold memory objects directly (host memory, local
  files, GPU-direct storage);
* subclass :class:`BytesBackend` when the store moves bytes only (Redis, Valkey, Mooncake, an
  HTTP object store): implement four byte operations and the core does framing, checksums,
  serde and allocation.

The numbered clauses of the contract (DESIGN.md §4) are stated on the methods they govern; the
``kvplug-contracts`` suite checks every one of them.

A minimal byte store, complete and correct::

    import asyncio
    from kvplug.backend import BytesBackend, Capabilities

    class DictBackend(BytesBackend):
        capabilities = Capabilities(delete=True)

        def __init__(self, url, **kwargs):
            super().__init__(url, **kwargs)
            self._data: dict[str, bytes] = {}

        async def get_bytes(self, key):
            return self._data.get(key)

        async def put_bytes(self, key, parts):
            self._data[key] = b"".join(parts)   # one assignment: readers never see a mix

        async def contains_bytes(self, key):
            return key in self._data

        async def remove_bytes(self, key):
            return self._data.pop(key, None) is not None

        async def close(self):
            self.mark_closed()

Registered through an entry point (see :mod:`kvplug.registry`), it is opened with
``kvplug.open_backend("dict://")``.
"""

from __future__ import annotations

import abc
import asyncio
import difflib
import threading
from collections.abc import AsyncIterator, Awaitable, Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar, TypeVar, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvplug.errors import (
    BackendClosed,
    BackendTimeout,
    CorruptObject,
    NotSupported,
    UnknownOption,
)
from kvplug.frame import decode_frame, encode_frame
from kvplug.keys import CacheKey
from kvplug.memory import Allocator, MemoryObj, shared_host_allocator
from kvplug.secrets import MASK, install_log_filter, is_secret_name, mask_repr, mask_text, remember
from kvplug.serde import get_serde
from kvplug.url import BackendURL

T = TypeVar("T")
Buffer = bytes | bytearray | memoryview


async def gather_all(operations: Iterable[Awaitable[T]]) -> list[T]:
    """Await ``operations`` concurrently; once every one has finished, raise the first error,
    else return the results in order. Nothing is left running when it raises."""
    results = await asyncio.gather(*operations, return_exceptions=True)
    error = next((r for r in results if isinstance(r, BaseException)), None)
    if error is not None:
        raise error
    return cast(list[T], results)


def fill_into(found: Sequence[MemoryObj | None], dests: Sequence[MemoryObj]) -> list[bool]:
    """Copy each object of ``found`` into the ``dests`` object at its position when the sizes
    match (one that already is its destination is left as it is), release every object of
    ``found``, and say which destinations now hold their object: the end of a ``get_into``
    that read into memory of its own."""
    hits = []
    try:
        for got, dest in zip(found, dests, strict=True):
            hits.append(got is not None and got.nbytes == dest.nbytes)
            if got is not None and got is not dest and hits[-1]:
                dest.raw.copy_(got.raw)
    finally:
        for got in found:
            if got is not None:
                got.release()
    return hits


@dataclass(frozen=True)
class Capabilities:
    """What a backend declares it can do. Declared means it works; undeclared operations raise
    :class:`~kvplug.errors.NotSupported` (clause 13)."""

    pin: bool = False
    """``pin``/``unpin`` keep keys from eviction (clause 8)."""
    persistent: bool = False
    """Data survives ``close`` and a new ``open_backend`` of the same URL (clause 14)."""
    shared_across_processes: bool = False
    """Another process opening the same URL sees the same objects."""
    zero_copy: bool = False
    """``get`` can return memory without copying it (host-memory tiers)."""
    native_batching: bool = False
    """The batched operations are one round trip, not a loop."""
    delete: bool = False
    """``remove`` deletes stored objects. Without it ``remove`` raises ``NotSupported``."""
    list: bool = False
    """``list_keys`` enumerates stored keys."""
    device_memory: bool = False
    """``get`` may return objects in GPU memory."""

    def declared(self) -> tuple[str, ...]:
        """Names of the declared capabilities."""
        return tuple(f.name for f in fields(self) if getattr(self, f.name))


class BackendOptions(BaseModel):
    """Options every backend accepts. A backend extends this model with its own fields.

    Values arrive as URL query strings or config values and are converted by the model
    (``"2.5"`` becomes ``2.5``, ``"true"`` becomes ``True``); unknown names are rejected.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    timeout: float = Field(10.0, gt=0, description="deadline of one operation, in seconds")


class Backend(abc.ABC):
    """An asynchronous store of memory objects. Subclass it and register it with a plugin.

    Construction takes the parsed URL, an optional allocator for the objects ``get`` returns
    (the process-wide host allocator when none is given) and the options, validated against
    :attr:`Options`. Construction does not connect; :meth:`open` does, once, before the
    first operation (``kvplug.open_backend`` awaits it for you).

    Contract clauses that hold for every method:

    * Keys are isolated per namespace (model name, world size, worker id): a key never reads or
      writes another key's data, and no key content escapes into paths or other key spaces
      (clause 12).
    * Every method is safe under concurrency from many tasks (clause 15).
    * After :meth:`close`, every method raises :class:`~kvplug.errors.BackendClosed`
      (clause 11).
    * Remote operations finish within ``options.timeout`` with a result, a
      :class:`~kvplug.errors.BackendTimeout` or a :class:`~kvplug.errors.BackendUnavailable`,
      and recover without reopening when the server returns (clause 10).
    """

    capabilities: ClassVar[Capabilities] = Capabilities()
    Options: ClassVar[type[BackendOptions]] = BackendOptions

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
        self._close_lock = threading.Lock()

    @classmethod
    def parse_options(cls, url: BackendURL, explicit: dict[str, Any]) -> BackendOptions:
        """The URL's query merged with ``explicit`` (explicit wins), validated by
        :attr:`Options`; unknown or bad values raise with the valid names listed."""
        merged: dict[str, Any] = {**url.options, **explicit}
        remember(*(value for name, value in merged.items() if is_secret_name(name)))
        known = sorted(cls.Options.model_fields)
        for name in merged:
            if name not in cls.Options.model_fields:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise UnknownOption(
                    f"{cls.__name__} ({url.scheme}://) has no option {name!r}.{hint} "
                    f"Valid options: {', '.join(known)}."
                )
        try:
            return cls.Options.model_validate(merged)
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
            self._allocator = shared_host_allocator()
        return self._allocator

    @property
    def closed(self) -> bool:
        return self._closed

    def mark_closed(self) -> bool:
        """Mark the backend closed; True only for the first call (so ``close`` is idempotent)."""
        with self._close_lock:
            first = not self._closed
            self._closed = True
            return first

    def ensure_open(self) -> None:
        """Raise :class:`BackendClosed` if :meth:`close` was called."""
        if self._closed:
            raise BackendClosed(f"{self.url} is closed; open a new backend with open_backend().")

    async def with_deadline(self, operation: Awaitable[T], what: str) -> T:
        """Await ``operation`` within ``options.timeout``, else raise ``BackendTimeout``."""
        try:
            return await asyncio.wait_for(operation, self.options.timeout)
        except TimeoutError:
            raise BackendTimeout(
                f"{what} on {self.url} took longer than {self.options.timeout} s; "
                "the store is slow or unreachable. Raise the 'timeout' option or check it."
            ) from None

    async def open(self) -> None:
        """Connect or prepare; called once before the first operation. Default: nothing."""

    def describe(self) -> dict[str, str]:
        """What ``kvplug check`` prints about this backend once it is open, beyond its URL and
        capabilities (for example how data moves: ``{"mode": "compat"}``). Default: nothing."""
        return {}

    # -- required ---------------------------------------------------------------------------

    @abc.abstractmethod
    async def get(self, key: CacheKey) -> MemoryObj | None:
        """The object stored under ``key``, or ``None`` for a miss.

        * A miss is ``None``, never an exception (clause 1).
        * A hit is bit-identical to what the last completed ``put`` stored: bytes, dtype,
          shape and format (clause 2); never a mix of two puts (clause 3).
        * The caller owns one reference of the returned object and releases it (clause 5).
        * Stored data that is corrupt, torn or truncated reads as a miss, is counted and is
          removed (clause 6).
        """

    @abc.abstractmethod
    async def put(self, key: CacheKey, obj: MemoryObj) -> None:
        """Store ``obj`` under ``key``; when this returns, ``get`` finds it.

        * ``put`` of an existing key replaces it or keeps the old value, atomically (clause 3).
        * ``put`` does not take the caller's reference: it retains ``obj`` while it needs it
          and releases that reference when done, on success and on failure (clause 5).
        * A full store raises :class:`~kvplug.errors.CapacityExceeded` or evicts by policy;
          reads keep working (clause 9).
        """

    @abc.abstractmethod
    async def contains(self, key: CacheKey) -> bool:
        """Whether ``get`` would hit now (clause 7: no "exists but cannot be read")."""

    @abc.abstractmethod
    async def remove(self, key: CacheKey) -> bool:
        """Delete ``key``: True if it was there, False if absent (clause 7). Backends without
        the ``delete`` capability raise :class:`~kvplug.errors.NotSupported`."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release every resource. Idempotent; bounded in time even with operations in flight;
        later operations raise :class:`~kvplug.errors.BackendClosed` (clause 11). Use
        :meth:`mark_closed` to make it idempotent."""

    # -- batched forms (correct defaults; override when the store batches natively) --------

    async def batched_get(self, keys: Sequence[CacheKey]) -> list[MemoryObj | None]:
        """``get`` of each key, concurrently; the result is aligned with ``keys`` (clause 4).
        If any get fails, the objects already read are released and the error is raised."""
        results = await asyncio.gather(*(self.get(k) for k in keys), return_exceptions=True)
        error = next((r for r in results if isinstance(r, BaseException)), None)
        if error is not None:
            for result in results:
                if isinstance(result, MemoryObj):
                    result.release()
            raise error
        return [r for r in results if not isinstance(r, BaseException)]

    async def get_into(self, key: CacheKey, dest: MemoryObj) -> bool:
        """Read the bytes stored under ``key`` into ``dest``'s memory (an engine's own buffer).

        True when ``dest`` now holds exactly the stored bytes; False for a miss, for a stored
        object whose size is not ``dest.nbytes``, and for anything :meth:`get` would turn into
        a miss (clause 6). After False, ``dest``'s contents are undefined: use it only after
        True. The stored shape, dtype and format are not checked: the caller knows its layout.

        ``dest`` stays the caller's; the backend retains it while it may write into it, so a
        caller that stopped waiting (a deadline) can wait for ``dest.ref_count`` to drop back
        before reusing the buffer. The default reads with :meth:`get` and copies once; a
        backend that can read straight into the caller's memory overrides it.

        Example::

            >>> import asyncio, torch, kvplug
            >>> async def demo() -> list[bool]:
            ...     backend = await kvplug.open_backend("cpu://")
            ...     key = kvplug.CacheKey("llama", 1, 0, 7)
            ...     await backend.put(key, kvplug.MemoryObj.from_tensor(torch.ones(8)))
            ...     dest = kvplug.MemoryObj.from_tensor(torch.zeros(8))
            ...     hits = [await backend.get_into(key, dest), bool(dest.tensor.sum() == 8)]
            ...     short = kvplug.MemoryObj.from_tensor(torch.zeros(4))
            ...     hits.append(await backend.get_into(key, short))
            ...     await backend.close()
            ...     return hits
            >>> asyncio.run(demo())
            [True, True, False]
        """
        return fill_into([await self.get(key)], [dest])[0]

    async def batched_get_into(
        self, keys: Sequence[CacheKey], dests: Sequence[MemoryObj]
    ) -> list[bool]:
        """:meth:`get_into` of each pair; aligned with ``keys``. The default is one
        :meth:`batched_get` (the backend's own batching) and one copy per hit."""
        if len(keys) != len(dests):
            raise ValueError(f"batched_get_into got {len(keys)} keys but {len(dests)} objects.")
        return fill_into(await self.batched_get(keys), dests)

    async def batched_put(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]) -> None:
        """``put`` of each pair, concurrently. Raises the first error after all have finished."""
        if len(keys) != len(objs):
            raise ValueError(f"batched_put got {len(keys)} keys but {len(objs)} objects.")
        await gather_all(self.put(k, o) for k, o in zip(keys, objs, strict=True))

    async def batched_contains(self, keys: Sequence[CacheKey]) -> int:
        """How many leading keys are present: the prefix length up to the first miss
        (clause 4)."""
        count = 0
        for key in keys:
            if not await self.contains(key):
                break
            count += 1
        return count

    # -- capability-gated ----------------------------------------------------------------------

    async def pin(self, key: CacheKey) -> bool:
        """Keep ``key`` from eviction until :meth:`unpin` or the pin's expiry; False if absent
        (clause 8). Needs the ``pin`` capability."""
        raise NotSupported(f"{type(self).__name__} ({self.url.scheme}://) cannot pin keys.")

    async def unpin(self, key: CacheKey) -> bool:
        """Undo one :meth:`pin`. Always succeeds; True if a pin was released (clause 8)."""
        raise NotSupported(f"{type(self).__name__} ({self.url.scheme}://) cannot pin keys.")

    def list_keys(self) -> AsyncIterator[CacheKey]:
        """Every stored key, in no particular order. Needs the ``list`` capability."""
        raise NotSupported(f"{type(self).__name__} ({self.url.scheme}://) cannot list keys.")

    async def __aenter__(self) -> Backend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.url)!r})"


def _shown_input(location: tuple[int | str, ...], value: object) -> str:
    """An option's rejected value as an error shows it: masked when any name on its path
    looks secret, whatever its type."""
    if any(is_secret_name(name) for name in location):
        return MASK
    return mask_repr(value)


class BytesBackendOptions(BackendOptions):
    """Options of every :class:`BytesBackend`."""

    serde: str = Field("naive", description="serde that turns objects into payload bytes")
    key_prefix: str = Field("", description="prepended to every stored key")


class BytesBackend(Backend):
    """Base of stores that move bytes only. Implement the four ``*_bytes`` methods and
    :meth:`close`; the core frames each object (header, checksums, payload), applies the
    serde, allocates what ``get`` returns and turns damaged frames into counted misses.

    Each object is stored as **one** value holding the whole frame, so data and metadata can
    never disagree, and a value is written in one store operation, so readers never see a mix.
    """

    Options: ClassVar[type[BackendOptions]] = BytesBackendOptions
    options: BytesBackendOptions

    def __init__(
        self, url: BackendURL | str, *, allocator: Allocator | None = None, **options: Any
    ) -> None:
        super().__init__(url, allocator=allocator, **options)
        self.serde = get_serde(self.options.serde)
        self.corrupt_objects = 0

    def key_string(self, key: CacheKey) -> str:
        """The store key for ``key``: the prefix and LMCache's string form."""
        return self.options.key_prefix + key.to_string()

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

    @abc.abstractmethod
    async def remove_bytes(self, key: str) -> bool:
        """Delete ``key``'s value; True if it was there."""

    async def get(self, key: CacheKey) -> MemoryObj | None:
        self.ensure_open()
        store_key = self.key_string(key)
        data = await self.get_bytes(store_key)
        if data is None:
            return None
        try:
            return decode_frame(data, self.allocator)
        except CorruptObject:
            self.corrupt_objects += 1
            await self.remove_bytes(store_key)
            return None

    async def put(self, key: CacheKey, obj: MemoryObj) -> None:
        self.ensure_open()
        obj.retain()
        try:
            header, payload = encode_frame(obj, self.serde)
            await self.put_bytes(self.key_string(key), (header, payload))
        finally:
            obj.release()

    async def contains(self, key: CacheKey) -> bool:
        self.ensure_open()
        return await self.contains_bytes(self.key_string(key))

    async def remove(self, key: CacheKey) -> bool:
        self.ensure_open()
        if not self.capabilities.delete:
            raise NotSupported(f"{type(self).__name__} ({self.url.scheme}://) cannot delete.")
        return await self.remove_bytes(self.key_string(key))


__all__ = [
    "Backend",
    "BackendOptions",
    "BytesBackend",
    "BytesBackendOptions",
    "Capabilities",
    "fill_into",
    "gather_all",
]
