"""What a backend declares it can do (:class:`Capabilities`), and the protocols through which
the contract suite and tools look inside one (:class:`Wraps`, :class:`CountsCorruptObjects`,
:class:`StoredFiles`, :class:`RawValues`).

Example::

    >>> Capabilities(remove=True, zero_copy=True).declared()
    ('zero_copy', 'remove')
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from kvplug.keys import CacheKey

if TYPE_CHECKING:
    from kvplug.template import Backend


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
    """A backend over another: :class:`~kvplug.backend.Wrapper` s and anything else with an
    ``inner``."""

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
    contract (so the suite can damage it, clause 6). Every
    :class:`~kvplug.backend.BytesBackend` is one."""

    async def read_raw(self, key: CacheKey) -> bytes | None:
        """The bytes stored for ``key``, or ``None`` when absent."""
        ...

    async def write_raw(self, key: CacheKey, data: bytes) -> None:
        """Replace what is stored for ``key`` with ``data`` as it is (no framing)."""
        ...


__all__ = ["Capabilities", "CountsCorruptObjects", "RawValues", "StoredFiles", "Wraps"]
