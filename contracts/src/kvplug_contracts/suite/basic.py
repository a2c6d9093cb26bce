"""Clauses 1, 2, 3, 4, 5 and 7: misses, round trips, overwrites, batching, ownership, remove."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar, cast

import pytest
import torch

import kvplug
from kvplug import (
    Backend,
    BackendClosed,
    CacheKey,
    FreeListAllocator,
    LayoutMismatch,
    MemoryFormat,
    MemoryObj,
)
from kvplug.backend import gather_all
from kvplug.memory import KV_DTYPES
from kvplug.runtime.engine import keeps_objects
from kvplug.runtime.store import layers
from kvplug_contracts.support import (
    ContractTimeout,
    Keyspace,
    Run,
    check_same,
    clause,
    difference,
    make_obj,
    not_applicable,
    release_all,
    violated,
)

T = TypeVar("T")


# One shape per format, as engines produce them (small model: 4 layers, 8 heads x 64).
FORMAT_SHAPES = {
    MemoryFormat.KV_2LTD: (2, 4, 256, 512),
    MemoryFormat.KV_T2D: (256, 2, 512),
    MemoryFormat.KV_2TD: (2, 256, 512),
    MemoryFormat.KV_MLA_FMT: (1, 4, 256, 576),
    MemoryFormat.BINARY_BUFFER: (12345,),
    MemoryFormat.BINARY: (4099,),
}

# From one token to beyond a full chunk of an 8B-class model (32 layers, 8 KV heads x 128).
TOKEN_COUNTS = (1, 17, 256, 300)

# A 256-token chunk of a 70B-class model (80 layers, 8 KV heads x 128) in float16: 80 MiB.
SEVENTY_B_CHUNK_SHAPE = (2, 80, 256, 1024)

# Beyond 2 GiB (--kvplug-large): the object, and room for the backend's copies of it.
LARGE_OBJECT_BYTES = (2 << 30) + (64 << 20)
LARGE_ALLOCATOR_COPIES = 3


def _put_get(run: Run, backend: Backend, keyspace: Keyspace, obj: MemoryObj, n: int = 0) -> None:
    key = keyspace.key(n)
    run(backend.put(key, obj))
    got = run(backend.get(key))
    try:
        check_same(2, obj, got, f"round trip of {tuple(obj.shape)} {obj.dtype} {obj.fmt.name}")
    finally:
        release_all([got])


def _on_a_miss(run: Run, what: str, operation: Coroutine[Any, Any, T]) -> T:
    """Run ``operation``; any exception (but the suite's own time limit) breaks clause 1."""
    try:
        return cast(T, run(operation))
    except ContractTimeout:
        raise
    except Exception as error:
        violated(1, f"{what} raised {type(error).__name__}: {error}; a miss returns None")


def _expect_value(old: MemoryObj | None, new: MemoryObj, got: MemoryObj | None, what: str) -> None:
    """``got`` is ``new``, the object of the last completed put (``old`` is the one before)."""
    if got is None:
        violated(3, f"{what} missed")
    if difference(new, got) is None:
        return
    if old is not None and difference(old, got) is None:
        violated(
            3,
            f"{what} returned the object of the earlier put: an overwrite must replace it "
            "(a hit returns the last completed put)",
        )
    violated(
        3, f"{what} returned another object than the last completed put: {difference(new, got)}"
    )


def _expect_last_put(
    run: Run,
    backend: Backend,
    key: CacheKey,
    new: MemoryObj,
    old: MemoryObj | None,
    what: str,
) -> None:
    got = run(backend.get(key))
    try:
        _expect_value(old, new, got, what)
    finally:
        release_all([got])


class MissContract:
    """Clause 1: a miss returns None, never an exception."""

    @clause(1)
    def test_get_of_a_key_never_stored_returns_none(
        self, backend: Backend, run: Run, keyspace: Keyspace
    ) -> None:
        got = _on_a_miss(run, "get of a key never stored", backend.get(keyspace.key(404)))
        if got is not None:
            got.release()
            violated(1, f"get of a key never stored returned {got!r}, expected None")

    @clause(1)
    def test_contains_of_a_key_never_stored_is_false(
        self, backend: Backend, run: Run, keyspace: Keyspace
    ) -> None:
        found = _on_a_miss(
            run, "contains of a key never stored", backend.contains(keyspace.key(404))
        )
        if found:
            violated(1, "contains of a key never stored returned True")

    @clause(1, 4)
    def test_batched_get_of_missing_keys_returns_one_none_each(
        self, backend: Backend, run: Run, keyspace: Keyspace
    ) -> None:
        got = _on_a_miss(
            run, "batched_get of missing keys", backend.batched_get(keyspace.keys(3, start=900))
        )
        if got != [None, None, None]:
            release_all([g for g in got if isinstance(g, MemoryObj)])
            violated(1, f"batched_get of three missing keys returned {got!r}")


class RoundTripContract:
    """Clause 2: get after a completed put is bit-identical in bytes, dtype, shape, format."""

    @clause(2, central=True)
    @pytest.mark.parametrize("dtype", KV_DTYPES.values(), ids=KV_DTYPES.keys())
    def test_round_trip_is_bit_exact_for_every_dtype(
        self,
        backend: Backend,
        run: Run,
        keyspace: Keyspace,
        allocator: FreeListAllocator,
        dtype: torch.dtype,
    ) -> None:
        obj = make_obj(allocator, (2, 4, 64, 256), dtype, seed=1)
        try:
            _put_get(run, backend, keyspace, obj)
        finally:
            obj.release()

    @clause(2, central=True)
    @pytest.mark.parametrize("fmt", FORMAT_SHAPES, ids=[f.name for f in FORMAT_SHAPES])
    def test_round_trip_is_bit_exact_for_every_format(
        self,
        backend: Backend,
        run: Run,
        keyspace: Keyspace,
        allocator: FreeListAllocator,
        fmt: MemoryFormat,
    ) -> None:
        is_bytes = fmt in (MemoryFormat.BINARY, MemoryFormat.BINARY_BUFFER)
        dtype = torch.uint8 if is_bytes else torch.bfloat16
        obj = make_obj(allocator, FORMAT_SHAPES[fmt], dtype, fmt, seed=2)
        try:
            _put_get(run, backend, keyspace, obj)
        finally:
            obj.release()

    @clause(2, central=True)
    @pytest.mark.parametrize("tokens", TOKEN_COUNTS, ids=[f"{t}-tokens" for t in TOKEN_COUNTS])
    def test_round_trip_is_bit_exact_from_one_token_to_beyond_a_chunk(
        self,
        backend: Backend,
        run: Run,
        keyspace: Keyspace,
        allocator: FreeListAllocator,
        tokens: int,
    ) -> None:
        obj = make_obj(allocator, (2, 32, tokens, 1024), torch.float16, seed=tokens)
        try:
            _put_get(run, backend, keyspace, obj)
        finally:
            obj.release()

    @clause(2)
    def test_round_trip_of_a_full_chunk_of_a_70b_class_model(
        self, backend: Backend, run: Run, keyspace: Keyspace, allocator: FreeListAllocator
    ) -> None:
        obj = make_obj(allocator, SEVENTY_B_CHUNK_SHAPE, torch.float16, seed=70)
        try:
            _put_get(run, backend, keyspace, obj)
        finally:
            obj.release()

    @clause(2)
    def test_round_trip_beyond_two_gib(
        self,
        kvplug_url: str,
        kvplug_options: dict[str, Any],
        run: Run,
        keyspace: Keyspace,
        pytestconfig: pytest.Config,
    ) -> None:
        if not pytestconfig.getoption("--kvplug-large"):
            not_applicable("objects over 2 GiB are checked only with --kvplug-large")
        # The suite's shared allocator is far smaller than this object: the backend gets one of
        # its own, with room for the object, what get returns and a stored copy.
        big = FreeListAllocator(LARGE_OBJECT_BYTES * LARGE_ALLOCATOR_COPIES + (64 << 20), pin=False)
        large = run(kvplug.open_backend(kvplug_url, allocator=big, **kvplug_options))
        try:
            obj = make_obj(big, (LARGE_OBJECT_BYTES,), torch.uint8, MemoryFormat.BINARY_BUFFER, 3)
            try:
                _put_get(run, large, keyspace, obj)
            finally:
                obj.release()
        finally:
            run(large.close())
        if big.stats().used:
            violated(
                5,
                f"{big.stats().object_count} object(s) of the large round trip are still "
                "allocated after the backend's close: a reference was never released",
            )

    @clause(2)
    def test_round_trip_of_objects_from_another_allocator(
        self, backend: Backend, run: Run, keyspace: Keyspace
    ) -> None:
        foreign = FreeListAllocator(16 << 20, pin=False)
        obj = make_obj(foreign, (2, 2, 32, 128), torch.float16, seed=4)
        try:
            _put_get(run, backend, keyspace, obj)
        finally:
            obj.release()

    @clause(5)
    def test_get_returns_an_object_of_the_backends_own_allocator(
        self, backend: Backend, run: Run, keyspace: Keyspace
    ) -> None:
        foreign = FreeListAllocator(16 << 20, pin=False)
        obj = make_obj(foreign, (2, 2, 32, 128), torch.float16, seed=5)
        try:
            run(backend.put(keyspace.key(0), obj))
            got = run(backend.get(keyspace.key(0)))
        finally:
            obj.release()
        if got is None:
            return  # a miss right after a put: the round-trip tests of clauses 1 and 2 say so
        own = [layer.allocator for layer in layers(backend)]
        if keeps_objects(backend):
            own.append(foreign)  # its stored value may be the very object it was given
        try:
            if not any(got.allocator is allocator for allocator in own):
                violated(
                    5,
                    f"get returned an object of {got.allocator!r}, not of the backend's "
                    f"allocator {backend.allocator!r}: callers budget and pin memory by that "
                    "allocator. Allocate what get returns from self.allocator",
                )
        finally:
            got.release()

    @clause(2)
    def test_round_trip_into_the_callers_memory_is_bit_exact(
        self, backend: Backend, run: Run, keyspace: Keyspace, allocator: FreeListAllocator
    ) -> None:
        obj = make_obj(allocator, (2, 4, 64, 256), torch.bfloat16, seed=11)
        # The caller's buffers have their own layout: only the size has to match.
        dests = [
            make_obj(allocator, (obj.nbytes,), torch.uint8, MemoryFormat.BINARY, seed=n)
            for n in (12, 13, 14)
        ]
        short = make_obj(allocator, (obj.nbytes // 2,), torch.uint8, MemoryFormat.BINARY)
        key, absent = keyspace.key(0), keyspace.key(1)
        try:
            run(backend.put(key, obj))
            if (missed := run(backend.get_into(absent, dests[0]))) is not False:
                violated(1, f"get_into of a key never stored returned {missed!r}, not False")
            try:
                wrong = run(backend.get_into(key, short))
            except LayoutMismatch:
                pass
            else:
                violated(
                    2,
                    f"get_into into an object of half the stored size returned {wrong!r}; it "
                    "must raise LayoutMismatch naming both sizes, so an engine with another "
                    "layout does not take the stored object for a miss",
                )
            if (hit := run(backend.get_into(key, dests[0]))) is not True:
                violated(2, f"get_into right after put returned {hit!r}, not True")
            hits = run(backend.batched_get_into([absent, key], dests[1:]))
            if hits != [False, True]:
                violated(4, f"batched_get_into of [absent, stored] returned {hits!r}")
            for dest in (dests[0], dests[2]):
                if not torch.equal(dest.raw.cpu(), obj.raw.cpu()):
                    violated(2, "get_into wrote other bytes than the put stored")
                if dest.ref_count != 1:
                    violated(5, f"get_into still holds the caller's object ({dest.ref_count})")
        finally:
            release_all([obj, *dests, short])


class OverwriteContract:
    """Clause 3: an overwrite replaces atomically: a hit returns the last completed put, and a
    reader never sees a mix."""

    @clause(3)
    def test_a_hit_returns_the_last_completed_put(
        self, backend: Backend, run: Run, keyspace: Keyspace, allocator: FreeListAllocator
    ) -> None:
        key = keyspace.key(1)
        first = make_obj(allocator, (2, 2, 64, 128), torch.float16, seed=10)
        second = make_obj(allocator, (2, 2, 64, 128), torch.float16, seed=11)
        dest = make_obj(allocator, (first.nbytes,), torch.uint8, MemoryFormat.BINARY, seed=12)
        try:
            run(backend.put(key, first))
            _expect_last_put(run, backend, key, first, None, "get after the first put")
            run(backend.put(key, second))
            for attempt in ("get after the second put", "a second get after the second put"):
                _expect_last_put(run, backend, key, second, first, attempt)
            got = run(backend.batched_get([key]))
            try:
                _expect_value(
                    first, second, got[0] if got else None, "batched_get after the second put"
                )
            finally:
                release_all(got)
            if run(backend.get_into(key, dest)) is not True:
                violated(3, "get_into after the second put did not return True")
            if not torch.equal(dest.raw.cpu(), second.raw.cpu()):
                which = "the first put" if torch.equal(dest.raw.cpu(), first.raw.cpu()) else "?"
                violated(3, f"get_into after the second put wrote the object of {which}")
        finally:
            release_all([first, second, dest])

    @clause(3, 15)
    def test_concurrent_writers_and_readers_never_see_a_torn_object(
        self, backend: Backend, run: Run, keyspace: Keyspace, allocator: FreeListAllocator
    ) -> None:
        key = keyspace.key(3)
        writers = [make_obj(allocator, (2, 4, 64, 256), torch.float16, seed=s) for s in range(6)]
        torn: list[str] = []

        async def write(obj: MemoryObj) -> None:
            for _ in range(8):
                await backend.put(key, obj)
                await asyncio.sleep(0)

        async def read() -> None:
            for _ in range(16):
                got = await backend.get(key)
                if got is None:
                    continue
                if all(difference(w, got) is not None for w in writers):
                    torn.append(difference(writers[0], got) or "?")
                got.release()
                await asyncio.sleep(0)

        async def main() -> None:
            await backend.put(key, writers[0])
            await gather_all([*(write(w) for w in writers), *(read() for _ in range(6))])

        try:
            run(main())
        finally:
            release_all(writers)
        if torn:
            violated(3, f"{len(torn)} read(s) matched none of the written objects: {torn[0]}")


class BatchedContract:
    """Clause 4: batched_exists and batched_get are aligned; batched_contains counts the present
    prefix."""

    @clause(4)
    def test_batched_contains_counts_leading_keys_on_gapped_lists(
        self, backend: Backend, run: Run, keyspace: Keyspace, allocator: FreeListAllocator
    ) -> None:
        obj = make_obj(allocator, (2, 1, 16, 64), torch.float16, seed=5)
        keys = keyspace.keys(6)
        try:
            run(backend.batched_put([keys[i] for i in (0, 1, 2, 4)], [obj] * 4))
        finally:
            obj.release()
        cases = {
            "0 1 2 3 4": ([keys[i] for i in (0, 1, 2, 3, 4)], 3),
            "3 0": ([keys[3], keys[0]], 0),
            "0 1 2": (keys[:3], 3),
            "4 0 5": ([keys[4], keys[0], keys[5]], 2),
            "empty": ([], 0),
        }
        for label, (query, expected) in cases.items():
            count = run(backend.batched_contains(query))
            if count != expected:
                violated(
                    4,
                    f"stored keys 0 1 2 4; batched_contains of keys {label} returned {count}, "
                    f"expected {expected}",
                )

    @clause(4)
    def test_batched_exists_answers_each_key_in_its_place(
        self, backend: Backend, run: Run, keyspace: Keyspace, allocator: FreeListAllocator
    ) -> None:
        obj = make_obj(allocator, (2, 1, 16, 64), torch.float16, seed=6)
        keys = keyspace.keys(6)
        try:
            run(backend.batched_put([keys[i] for i in (0, 2, 3, 5)], [obj] * 4))
        finally:
            obj.release()
        cases = {
            "0 1 2 3 4 5": ([0, 1, 2, 3, 4, 5], [True, False, True, True, False, True]),
            "4 1": ([4, 1], [False, False]),
            "1 0 1 0 (duplicates)": ([1, 0, 1, 0], [False, True, False, True]),
            "5 4 3": ([5, 4, 3], [True, False, True]),
            "2": ([2], [True]),
            "empty": ([], []),
        }
        for label, (positions, expected) in cases.items():
            found = run(backend.batched_exists([keys[i] for i in positions]))
            if found != expected:
                violated(
                    4,
                    f"stored keys 0 2 3 5; batched_exists of keys {label} returned {found}, "
                    f"expected {expected}",
                )

    @clause(4)
    def test_batched_get_is_aligned_with_its_keys(
        self, backend: Backend, run: Run, keyspace: Keyspace, allocator: FreeListAllocator
    ) -> None:
        objs = [make_obj(allocator, (2, 1, 16, 64), torch.float16, seed=s) for s in range(3)]
        keys = keyspace.keys(5)
        try:
            run(backend.batched_put([keys[0], keys[2], keys[4]], objs))
            got = run(backend.batched_get([keys[4], keys[1], keys[0], keys[3], keys[2]]))
            try:
                if len(got) != 5:
                    violated(4, f"batched_get of 5 keys returned {len(got)} results")
                expected = [objs[2], None, objs[0], None, objs[1]]
                for position, (want, have) in enumerate(zip(expected, got, strict=True)):
                    if want is None and have is not None:
                        violated(4, f"position {position} is a missing key but got {have!r}")
                    if want is not None:
                        check_same(4, want, have, f"batched_get position {position}")
            finally:
                release_all(got)
        finally:
            release_all(objs)


class OwnershipContract:
    """Clause 5: put keeps the caller's reference, get hands one over, nothing leaks."""

    @clause(5)
    def test_put_does_not_take_the_callers_reference(
        self, backend: Backend, run: Run, keyspace: Keyspace, allocator: FreeListAllocator
    ) -> None:
        obj = make_obj(allocator, (2, 2, 16, 64), torch.float16, seed=6)
        run(backend.put(keyspace.key(1), obj))
        if obj.ref_count < 1 or not obj.is_valid:
            violated(5, f"after put the caller's object has ref_count {obj.ref_count}")
        obj.release()

    @clause(5)
    def test_a_failed_put_releases_what_it_retained(
        self,
        open_contract_backend: Callable[..., Backend],
        run: Run,
        keyspace: Keyspace,
        allocator: FreeListAllocator,
    ) -> None:
        closed = open_contract_backend()
        run(closed.close())
        obj = make_obj(allocator, (2, 2, 16, 64), torch.float16, seed=7)
        try:
            with pytest.raises(BackendClosed):
                run(closed.put(keyspace.key(1), obj))
            if obj.ref_count != 1:
                violated(5, f"after a failed put the object's ref_count is {obj.ref_count}, not 1")
        finally:
            obj.release()

    @clause(5)
    def test_get_returns_an_object_the_caller_owns(
        self, backend: Backend, run: Run, keyspace: Keyspace, allocator: FreeListAllocator
    ) -> None:
        obj = make_obj(allocator, (2, 2, 16, 64), torch.float16, seed=8)
        run(backend.put(keyspace.key(1), obj))
        obj.release()
        first = run(backend.get(keyspace.key(1)))
        second = run(backend.get(keyspace.key(1)))
        if first is None or second is None:
            violated(5, "get after put missed")
        first.release()
        if not second.is_valid:
            violated(5, "releasing one get's result freed the object another get returned")
        second.release()

    @clause(5)
    def test_allocator_returns_to_baseline_after_close(
        self,
        open_contract_backend: Callable[..., Backend],
        run: Run,
        keyspace: Keyspace,
        allocator: FreeListAllocator,
    ) -> None:
        baseline = allocator.stats().used
        backend = open_contract_backend()
        objs = [make_obj(allocator, (2, 2, 32, 64), torch.float16, seed=s) for s in range(8)]
        keys = keyspace.keys(8)
        run(backend.batched_put(keys, objs))
        release_all(objs)
        release_all(run(backend.batched_get(keys)))
        for key in keys[:4]:
            release_all([run(backend.get(key))])
        run(backend.close())
        stats = allocator.stats()
        if stats.used != baseline:
            violated(
                5,
                f"{stats.object_count} object(s), {stats.used - baseline} bytes still allocated "
                "after every reference was released and the backend closed",
            )


class RemoveContract:
    """Clause 7: remove of an absent key is False; contains agrees with get."""

    @clause(7)
    def test_remove_of_an_absent_key_returns_false(
        self, backend: Backend, run: Run, keyspace: Keyspace
    ) -> None:
        if not backend.capabilities.remove:
            not_applicable("the backend does not declare 'remove'")
        if run(backend.remove(keyspace.key(404))) is not False:
            violated(7, "remove of a key never stored did not return False")

    @clause(7)
    def test_remove_deletes_and_then_reports_absence(
        self, backend: Backend, run: Run, keyspace: Keyspace, allocator: FreeListAllocator
    ) -> None:
        if not backend.capabilities.remove:
            not_applicable("the backend does not declare 'remove'")
        key = keyspace.key(1)
        obj = make_obj(allocator, (2, 2, 16, 64), torch.float16, seed=9)
        run(backend.put(key, obj))
        obj.release()
        if run(backend.remove(key)) is not True:
            violated(7, "remove of a stored key did not return True")
        if run(backend.contains(key)):
            violated(7, "contains is True after remove")
        got = run(backend.get(key))
        if got is not None:
            got.release()
            violated(7, "get returned data after remove")
        if run(backend.remove(key)) is not False:
            violated(7, "a second remove of the same key did not return False")

    @clause(7)
    def test_batched_exists_agrees_with_get_after_puts_and_removes(
        self, backend: Backend, run: Run, keyspace: Keyspace, allocator: FreeListAllocator
    ) -> None:
        keys = keyspace.keys(6)
        obj = make_obj(allocator, (2, 1, 16, 64), torch.float16, seed=13)
        try:
            run(backend.batched_put(keys[:4], [obj] * 4))
            removed = []
            if backend.capabilities.remove:
                removed = [keys[1], keys[2]]
                for key in removed:
                    run(backend.remove(key))
            run(backend.put(keys[2], obj))  # stored again after its remove
        finally:
            obj.release()
        found = run(backend.batched_exists(keys))
        for position, (key, present) in enumerate(zip(keys, found, strict=True)):
            got = run(backend.get(key))
            release_all([got])
            if present != (got is not None):
                violated(
                    7,
                    f"batched_exists says {present} at position {position} but get "
                    f"{'missed' if got is None else 'hit'}"
                    + (" (a key removed before)" if key in removed else ""),
                )

    @clause(7)
    def test_contains_agrees_with_get(
        self, backend: Backend, run: Run, keyspace: Keyspace, allocator: FreeListAllocator
    ) -> None:
        keys = keyspace.keys(6)
        obj = make_obj(allocator, (2, 1, 16, 64), torch.float16, seed=12)
        run(backend.batched_put(keys[::2], [obj] * 3))
        obj.release()
        for key in keys:
            present = run(backend.contains(key))
            got = run(backend.get(key))
            release_all([got])
            if present != (got is not None):
                violated(
                    7,
                    f"for key {key.chunk_hash_hex} contains is {present} but get "
                    f"{'missed' if got is None else 'hit'}",
                )
