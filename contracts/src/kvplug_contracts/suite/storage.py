"""Clauses 6, 8, 9 and 14: corrupt data, pins, a full store, persistence."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from kvplug import Backend, CacheKey, CapacityExceeded, FreeListAllocator, MemoryFormat, MemoryObj
from kvplug.backend import CountsCorruptObjects
from kvplug.memory import nbytes_of
from kvplug.units import parse_size
from kvplug_contracts.support import (
    ContractTimeout,
    Keyspace,
    Run,
    check_same,
    clause,
    difference,
    innermost,
    layers,
    make_obj,
    not_applicable,
    not_run,
    release_all,
    violated,
)

Damage = Callable[..., Any]

DAMAGE_MODES = ("flip", "truncate", "garbage")

# 256 KiB in float16: sixteen of them fill the default 4 MiB small store.
STORE_SHAPE = (2, 2, 64, 512)
# 8 KiB in float16: for tests that need no pressure.
SMALL_SHAPE = (2, 1, 16, 64)

# How much a pressure loop puts: three times the small store, at most this many objects.
PRESSURE_FACTOR = 3
PRESSURE_MAX_OBJECTS = 256
PRESSURE_DEFAULT_OBJECTS = 64
# The largest "larger than the whole store" object the suite allocates.
TOO_BIG_MAX = 128 << 20
TOO_BIG_DEFAULT = 32 << 20

PIN_TTL = 0.2
PIN_WAIT = 0.4

NO_DAMAGE = "the suite cannot damage this backend's stored data; override the damage_stored fixture"
NO_SMALL_STORE = (
    "the suite cannot make this store small enough to fill: declare contract_small_options "
    '(e.g. {"max_size": "4MiB"}) on the backend class, pass --kvplug-small-option NAME=VALUE, '
    "or override the small_store_options fixture"
)


# -- helpers ---------------------------------------------------------------------------------


def _corrupt_count(backend: Backend) -> int | None:
    """The sum of the ``corrupt_objects`` counters of ``backend`` and the backends it wraps,
    or None when none of them has one."""
    counts = [
        layer.corrupt_objects
        for layer in layers(backend)
        if isinstance(layer, CountsCorruptObjects)
    ]
    return sum(counts) if counts else None


def _capacity(options: dict[str, Any]) -> int | None:
    """The store size ``options`` give, when they name it with ``max_size``."""
    if "max_size" not in options:
        return None
    try:
        return parse_size(options["max_size"], what="max_size")
    except Exception:
        return None


def _pressure_count(options: dict[str, Any], nbytes: int) -> int:
    """How many objects of ``nbytes`` to put so that the small store overflows."""
    capacity = _capacity(options)
    if capacity is None:
        return PRESSURE_DEFAULT_OBJECTS
    return min(PRESSURE_FACTOR * capacity // nbytes + 4, PRESSURE_MAX_OBJECTS)


def _size_text(options: dict[str, Any]) -> str:
    capacity = _capacity(options)
    return f"a store of {capacity} bytes" if capacity is not None else f"a store opened {options}"


def _put_or_full(run: Run, backend: Backend, key: CacheKey, obj: MemoryObj, what: str) -> bool:
    """Put; True when stored, False when the store said ``CapacityExceeded``. Any other error
    violates clause 9."""
    try:
        run(backend.put(key, obj))
    except CapacityExceeded:
        return False
    except ContractTimeout:
        raise
    except Exception as error:
        violated(
            9,
            f"{what}: put raised {type(error).__name__}: {error}; a full store must evict by "
            "policy or raise CapacityExceeded",
        )
    return True


def _read(run: Run, backend: Backend, key: CacheKey, number: int, what: str) -> MemoryObj | None:
    """Get that reports an exception as a violation of clause ``number``."""
    try:
        got: MemoryObj | None = run(backend.get(key))
    except ContractTimeout:
        raise
    except Exception as error:
        violated(number, f"{what}: get raised {type(error).__name__}: {error}")
    return got


def _check_none_or_same(
    run: Run, backend: Backend, key: CacheKey, expected: MemoryObj, what: str
) -> bool:
    """``key`` reads as a miss or bit-exact and contains agrees with get (clause 9: reads keep
    working in a full store). Returns whether it was a hit."""
    got = _read(run, backend, key, 9, what)
    try:
        if got is not None:
            problem = difference(expected, got)
            if problem is not None:
                violated(
                    9,
                    f"{what}: get returned damaged data ({problem}); expected the object "
                    "put or a miss",
                )
        present = run(backend.contains(key))
        if present != (got is not None):
            violated(
                9,
                f"{what}: contains is {present} but get {'missed' if got is None else 'hit'}",
            )
        return got is not None
    finally:
        release_all([got])


def _present(run: Run, backend: Backend, keys: Sequence[CacheKey]) -> int:
    return sum(1 for key in keys if run(backend.contains(key)))


def _damage(
    run: Run, damage_stored: Damage | None, backend: Backend, key: CacheKey, mode: str
) -> None:
    if damage_stored is None:
        not_run(NO_DAMAGE)
    if not run(damage_stored(backend, key, mode)):
        not_run(NO_DAMAGE)


def _require_pin(backend: Backend) -> None:
    if not backend.capabilities.pin:
        not_applicable("the backend does not declare 'pin'")


def _require_small(small_store_options: dict[str, Any] | None) -> dict[str, Any]:
    if small_store_options is None:
        not_run(NO_SMALL_STORE)
    return small_store_options


# -- clause 6 --------------------------------------------------------------------------------


class CorruptionContract:
    """Clause 6: damaged stored data reads as a miss, is counted and is removed."""

    @clause(6, central=True)
    @pytest.mark.parametrize("mode", DAMAGE_MODES)
    def test_damaged_data_reads_as_a_counted_miss_and_is_removed(
        self,
        backend: Backend,
        run: Run,
        keyspace: Keyspace,
        allocator: FreeListAllocator,
        damage_stored: Damage | None,
        mode: str,
    ) -> None:
        key = keyspace.key(1)
        obj = make_obj(allocator, SMALL_SHAPE, torch.float16, seed=60)
        try:
            run(backend.put(key, obj))
        finally:
            obj.release()
        before = _corrupt_count(backend)
        _damage(run, damage_stored, backend, key, mode)
        got = _read(run, backend, key, 6, f"get of data damaged by {mode!r}")
        if got is not None:
            shown = f"{tuple(got.shape)} {got.dtype} {got.fmt.name}"
            got.release()
            violated(6, f"get of data damaged by {mode!r} returned an object ({shown}), not a miss")
        if run(backend.contains(key)):
            violated(
                6,
                f"after get read data damaged by {mode!r} as a miss, contains is still True: "
                "the damaged object was not removed",
            )
        after = _corrupt_count(backend)
        if before is not None and after is not None and after <= before:
            violated(
                6,
                f"corrupt_objects was {before} before reading data damaged by {mode!r} and "
                f"{after} after: the damaged object was not counted",
            )

    @clause(6)
    def test_batched_get_of_damaged_data_is_an_aligned_miss(
        self,
        backend: Backend,
        run: Run,
        keyspace: Keyspace,
        allocator: FreeListAllocator,
        damage_stored: Damage | None,
    ) -> None:
        keys = keyspace.keys(3)
        objs = [make_obj(allocator, SMALL_SHAPE, torch.float16, seed=61 + s) for s in range(3)]
        try:
            run(backend.batched_put(keys, objs))
            before = _corrupt_count(backend)
            _damage(run, damage_stored, backend, keys[1], "flip")
            try:
                got: list[MemoryObj | None] = run(backend.batched_get(keys))
            except ContractTimeout:
                raise
            except Exception as error:
                violated(
                    6, f"batched_get with one damaged object raised {type(error).__name__}: {error}"
                )
            try:
                if len(got) != 3:
                    violated(6, f"batched_get of 3 keys, one damaged, returned {len(got)} results")
                if got[1] is not None:
                    violated(
                        6,
                        "batched_get returned an object for the damaged key (position "
                        "1), not a miss",
                    )
                check_same(6, objs[0], got[0], "batched_get position 0, next to a damaged key")
                check_same(6, objs[2], got[2], "batched_get position 2, next to a damaged key")
            finally:
                release_all(got)
            if run(backend.contains(keys[1])):
                violated(
                    6,
                    "after batched_get read the damaged key as a miss, contains is "
                    "still True: it was not removed",
                )
            after = _corrupt_count(backend)
            if before is not None and after is not None and after <= before:
                violated(
                    6,
                    f"corrupt_objects was {before} before batched_get read a damaged "
                    f"object and {after} after: it was not counted",
                )
        finally:
            release_all(objs)


# -- clause 8 --------------------------------------------------------------------------------


class PinContract:
    """Clause 8: pinned keys survive eviction; unpin always succeeds; pins expire."""

    @clause(8, central=True)
    def test_pinned_keys_survive_eviction_pressure(
        self,
        backend: Backend,
        run: Run,
        keyspace: Keyspace,
        allocator: FreeListAllocator,
        open_contract_backend: Callable[..., Backend],
        small_store_options: dict[str, Any] | None,
    ) -> None:
        _require_pin(backend)
        options = _require_small(small_store_options)
        small = open_contract_backend(**options)
        pinned_keys = keyspace.keys(3)
        pinned = [make_obj(allocator, STORE_SHAPE, torch.float16, seed=80 + s) for s in range(3)]
        filler = make_obj(allocator, STORE_SHAPE, torch.float16, seed=89)
        count = _pressure_count(options, filler.nbytes)
        filler_keys = keyspace.keys(count, start=100)
        try:
            for key, obj in zip(pinned_keys, pinned, strict=True):
                run(small.put(key, obj))
                result = run(small.pin(key))
                if result is not True:
                    violated(8, f"pin of stored key {key} returned {result!r}, not True")
            for n, key in enumerate(filler_keys):
                _put_or_full(run, small, key, filler, f"put {n + 1} of {count} into {options}")
            for n, (key, obj) in enumerate(zip(pinned_keys, pinned, strict=True)):
                got = _read(run, small, key, 8, f"get of pinned key {n}")
                try:
                    check_same(
                        8,
                        obj,
                        got,
                        f"pinned key {n} after {count} puts of {filler.nbytes} bytes into "
                        f"{_size_text(options)}",
                    )
                finally:
                    release_all([got])
            if _present(run, small, filler_keys) == count:
                not_run(
                    f"{_size_text(options)} held all {count} objects of {filler.nbytes} bytes: "
                    "nothing was evicted, so pins were never tested; give smaller "
                    "contract_small_options or override small_store_options"
                )
        finally:
            release_all([*pinned, filler])

    @clause(8)
    def test_unpin_always_succeeds(
        self, backend: Backend, run: Run, keyspace: Keyspace, allocator: FreeListAllocator
    ) -> None:
        _require_pin(backend)
        key = keyspace.key(1)

        def unpin(case: str) -> None:
            try:
                result = run(backend.unpin(key))
            except ContractTimeout:
                raise
            except Exception as error:
                violated(8, f"unpin of {case} raised {type(error).__name__}: {error}")
            if not isinstance(result, bool):
                violated(8, f"unpin of {case} returned {result!r}, not a bool")

        unpin("a key never stored")
        obj = make_obj(allocator, SMALL_SHAPE, torch.float16, seed=81)
        try:
            run(backend.put(key, obj))
        finally:
            obj.release()
        unpin("a stored key never pinned")
        if run(backend.pin(key)) is not True:
            violated(8, "pin of a stored key did not return True")
        unpin("a pinned key")
        unpin("a key already unpinned (a second unpin)")
        if backend.capabilities.remove:
            run(backend.pin(key))
            run(backend.remove(key))
            unpin("a pinned key that was removed")

    @clause(8)
    def test_pin_of_an_absent_key_returns_false(
        self, backend: Backend, run: Run, keyspace: Keyspace, allocator: FreeListAllocator
    ) -> None:
        _require_pin(backend)
        result = run(backend.pin(keyspace.key(404)))
        if result is not False:
            violated(8, f"pin of a key never stored returned {result!r}, expected False")
        if not backend.capabilities.remove:
            return
        key = keyspace.key(1)
        obj = make_obj(allocator, SMALL_SHAPE, torch.float16, seed=82)
        try:
            run(backend.put(key, obj))
        finally:
            obj.release()
        run(backend.remove(key))
        result = run(backend.pin(key))
        if result is not False:
            violated(8, f"pin of a removed key returned {result!r}, expected False")

    @clause(8)
    def test_pins_expire_after_the_configured_time(
        self,
        backend: Backend,
        run: Run,
        keyspace: Keyspace,
        allocator: FreeListAllocator,
        open_contract_backend: Callable[..., Backend],
        small_store_options: dict[str, Any] | None,
    ) -> None:
        _require_pin(backend)
        options = _require_small(small_store_options)
        if "pin_ttl" not in innermost(backend).Options.model_fields:
            not_applicable("the backend has no 'pin_ttl' option, so pin expiry cannot be set")
        small = open_contract_backend(**{**options, "pin_ttl": PIN_TTL})
        key, control = keyspace.key(1), keyspace.key(2)
        obj = make_obj(allocator, STORE_SHAPE, torch.float16, seed=83)
        count = _pressure_count(options, obj.nbytes)
        filler_keys = keyspace.keys(count, start=100)
        try:
            run(small.put(key, obj))
            run(small.put(control, obj))
            if run(small.pin(key)) is not True:
                violated(8, "pin of a stored key did not return True")
            started = time.monotonic()
            run(asyncio.sleep(PIN_WAIT))
            puts = 0
            for puts, filler in enumerate(filler_keys, start=1):
                _put_or_full(run, small, filler, obj, f"put {puts} of {count} into {options}")
                if not run(small.contains(key)):
                    return
            waited = time.monotonic() - started
            if run(small.contains(control)):
                not_applicable(
                    f"after {puts} puts of {obj.nbytes} bytes into {_size_text(options)} neither "
                    "the key whose pin expired nor an unpinned key put with it was evicted; the "
                    "suite cannot tell whether the pin expired"
                )
            violated(
                8,
                f"a key pinned with pin_ttl={PIN_TTL} s was still stored {waited:.2f} s later "
                f"after {puts} puts of {obj.nbytes} bytes into {_size_text(options)}, while an "
                "unpinned key put with it was evicted: the pin never expired",
            )
        finally:
            obj.release()


# -- clause 9 --------------------------------------------------------------------------------


class CapacityContract:
    """Clause 9: a full store raises CapacityExceeded or evicts; reads keep working."""

    @clause(9, central=True)
    def test_a_full_store_evicts_or_raises_capacity_exceeded(
        self,
        backend: Backend,
        run: Run,
        keyspace: Keyspace,
        allocator: FreeListAllocator,
        open_contract_backend: Callable[..., Backend],
        small_store_options: dict[str, Any] | None,
    ) -> None:
        options = _require_small(small_store_options)
        small = open_contract_backend(**options)
        nbytes = nbytes_of(STORE_SHAPE, torch.float16)
        count = _pressure_count(options, nbytes)
        keys = keyspace.keys(count)
        objs = [make_obj(allocator, STORE_SHAPE, torch.float16, seed=200 + n) for n in range(count)]
        try:
            stored = [
                _put_or_full(run, small, key, obj, f"put {n + 1} of {count} into {options}")
                for n, (key, obj) in enumerate(zip(keys, objs, strict=True))
            ]
            if not any(stored):
                violated(
                    9,
                    f"every one of {count} puts of {nbytes} bytes into "
                    f"{_size_text(options)} raised CapacityExceeded, even into the "
                    "empty store",
                )
            last = max(n for n, ok in enumerate(stored) if ok)
            hits = [
                _check_none_or_same(
                    run,
                    small,
                    key,
                    obj,
                    f"key {n} of {count} after the store "
                    f"filled ({'stored' if stored[n] else 'CapacityExceeded'})",
                )
                for n, (key, obj) in enumerate(zip(keys, objs, strict=True))
            ]
            if not hits[last]:
                violated(
                    9,
                    f"put {last + 1} of {count} succeeded but its key reads as a miss "
                    "right after the store filled: reads stopped working",
                )
            if all(hits):
                not_run(
                    f"{_size_text(options)} held all {count} objects of {nbytes} bytes, so it "
                    "never filled; give smaller contract_small_options or override "
                    "small_store_options"
                )
        finally:
            release_all(objs)

    @clause(9)
    def test_an_object_larger_than_the_whole_store_never_corrupts(
        self,
        backend: Backend,
        run: Run,
        keyspace: Keyspace,
        allocator: FreeListAllocator,
        open_contract_backend: Callable[..., Backend],
        small_store_options: dict[str, Any] | None,
    ) -> None:
        options = _require_small(small_store_options)
        small = open_contract_backend(**options)
        capacity = _capacity(options)
        size = min(2 * capacity, TOO_BIG_MAX) if capacity is not None else TOO_BIG_DEFAULT
        keys = keyspace.keys(4)
        before = [make_obj(allocator, STORE_SHAPE, torch.float16, seed=300 + s) for s in range(2)]
        big = make_obj(allocator, (size,), torch.uint8, MemoryFormat.BINARY_BUFFER, seed=302)
        after = make_obj(allocator, STORE_SHAPE, torch.float16, seed=303)
        try:
            for key, obj in zip(keys, before, strict=False):
                run(small.put(key, obj))
            _put_or_full(
                run, small, keys[2], big, f"put of {size} bytes into {_size_text(options)}"
            )
            _check_none_or_same(run, small, keys[2], big, f"the {size}-byte object")
            for n, obj in enumerate(before):
                _check_none_or_same(
                    run, small, keys[n], obj, f"key {n}, put before the {size}-byte object"
                )
            if _put_or_full(run, small, keys[3], after, "put after the too-large object"):
                got = _read(run, small, keys[3], 9, "get after the too-large object")
                try:
                    check_same(9, after, got, "an object put after the too-large one")
                finally:
                    release_all([got])
        finally:
            release_all([*before, big, after])


# -- clause 14 -------------------------------------------------------------------------------


class PersistenceContract:
    """Clause 14: persistent backends keep data across a close and reopen."""

    @clause(14, central=True)
    def test_data_survives_close_and_reopen(
        self,
        backend: Backend,
        run: Run,
        keyspace: Keyspace,
        allocator: FreeListAllocator,
        open_contract_backend: Callable[..., Backend],
    ) -> None:
        if not backend.capabilities.persistent:
            not_applicable("the backend does not declare 'persistent'")
        keys = keyspace.keys(4)
        objs = [make_obj(allocator, SMALL_SHAPE, torch.float16, seed=400 + s) for s in range(4)]
        try:
            first = open_contract_backend()
            run(first.batched_put(keys, objs))
            run(first.close())
            second = open_contract_backend()
            for n, key in enumerate(keys):
                if not run(second.contains(key)):
                    violated(14, f"after close and reopen, contains of key {n} of 4 is False")
            count = run(second.batched_contains(keys))
            if count != len(keys):
                violated(
                    14,
                    f"after close and reopen, batched_contains of the 4 keys put returned {count}",
                )
            for n, (key, obj) in enumerate(zip(keys, objs, strict=True)):
                got = _read(run, second, key, 14, f"get of key {n} after reopen")
                try:
                    check_same(14, obj, got, f"key {n} after close and reopen")
                finally:
                    release_all([got])
            if second.capabilities.list_keys:
                listed = run(_collect(second, keyspace.model))
                missing = [k.chunk_hash_hex for k in keys if k not in listed]
                if missing:
                    violated(14, f"after close and reopen, list_keys lacks keys {missing}")
        finally:
            release_all(objs)


async def _collect(backend: Backend, model: str) -> set[CacheKey]:
    return {key async for key in backend.list_keys() if key.model_name == model}


__all__ = [
    "CapacityContract",
    "CorruptionContract",
    "PersistenceContract",
    "PinContract",
]
