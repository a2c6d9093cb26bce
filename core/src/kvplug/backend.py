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

Everything a vendor needs is importable from here; each piece lives in the module named for its
job: the template (:mod:`kvplug.template`) and its hooks (:mod:`kvplug.hooks`), the byte store
(:mod:`kvplug.bytes_backend`), wrappers (:mod:`kvplug.wrapper`), capabilities and protocols
(:mod:`kvplug.capabilities`), argument checks (:mod:`kvplug.checks`), batched helpers
(:mod:`kvplug.batches`), errors' translation (:mod:`kvplug.hook_errors`), the deadline
(:mod:`kvplug.deadline`), loop-bound backends (:mod:`kvplug.home_loop`), inline operations
(:mod:`kvplug.inline`), class-creation checks (:mod:`kvplug.class_checks`) and options
(:mod:`kvplug.option_parsing`). The options models (:mod:`kvplug.options`, pydantic) are loaded
on first use of ``BackendOptions`` or ``BytesBackendOptions``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvplug.batches import fill_into, gather_all, leading_present
from kvplug.bytes_backend import Buffer, BytesBackend
from kvplug.capabilities import Capabilities, CountsCorruptObjects, RawValues, StoredFiles, Wraps
from kvplug.home_loop import HOME_POLL_SECONDS as HOME_POLL_SECONDS
from kvplug.hook_errors import error_text
from kvplug.lazy import lazy_exports
from kvplug.stats import OperationStats
from kvplug.template import Backend
from kvplug.wrapper import Wrapper

if TYPE_CHECKING:
    from kvplug.options import BackendOptions, BytesBackendOptions

__getattr__ = lazy_exports(__name__, {"kvplug.options": ("BackendOptions", "BytesBackendOptions")})

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
