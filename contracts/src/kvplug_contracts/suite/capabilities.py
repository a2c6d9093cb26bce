"""Clause 13: a capability a backend declares works, and one it does not declare raises
NotSupported."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvplug import Backend, CacheKey, FreeListAllocator, MemoryObj, NotSupported
from kvplug_contracts.suite.operations import SHAPE, Operation, listed_keys, release_result
from kvplug_contracts.support import (
    Keyspace,
    Run,
    check_same,
    clause,
    difference,
    innermost,
    make_obj,
    not_applicable,
    release_all,
    violated,
)


def _not_supported(run: Run, capability: str, what: str, operation: Operation) -> None:
    """``operation`` must raise NotSupported, since ``capability`` is not declared."""
    try:
        result = run(operation())
    except NotSupported:
        return
    except Exception as error:
        violated(
            13,
            f"'{capability}' is not declared, so {what} must raise NotSupported; it raised "
            f"{type(error).__name__}: {error}",
        )
    release_result(result)
    violated(
        13,
        f"'{capability}' is not declared, so {what} must raise NotSupported; it returned "
        f"{result!r}",
    )


def _works(run: Run, capability: str, what: str, operation: Operation) -> Any:
    """``operation`` must work, since ``capability`` is declared."""
    try:
        return run(operation())
    except NotSupported as error:
        violated(13, f"the backend declares '{capability}' but {what} raised NotSupported: {error}")
    except Exception as error:
        violated(
            13,
            f"the backend declares '{capability}' but {what} raised "
            f"{type(error).__name__}: {error}",
        )


class CapabilityContract:
    """Clause 13: a declared capability works; an undeclared one raises NotSupported.

    ``persistent`` is checked by the persistence clause (14).
    """

    @clause(13)
    def test_pin_and_unpin_match_the_pin_capability(
        self, backend: Backend, run: Run, keyspace: Keyspace, allocator: FreeListAllocator
    ) -> None:
        key, absent = keyspace.key(1), keyspace.key(2)
        if not backend.capabilities.pin:
            _not_supported(run, "pin", "pin", lambda: backend.pin(key))
            _not_supported(run, "pin", "unpin", lambda: backend.unpin(key))
            return
        obj = make_obj(allocator, SHAPE, seed=70)
        try:
            run(backend.put(key, obj))
        finally:
            obj.release()
        present = run(backend.contains(key))
        expected = {
            "pin of a stored key": (lambda: backend.pin(key), present),
            "unpin of that key": (lambda: backend.unpin(key), present),
            "pin of a key never stored": (lambda: backend.pin(absent), False),
            "unpin of a key never stored": (lambda: backend.unpin(absent), False),
        }
        for what, (operation, want) in expected.items():
            answer = _works(run, "pin", what, operation)
            if not isinstance(answer, bool) or answer != want:
                violated(
                    13, f"the backend declares 'pin'; {what} returned {answer!r}, expected {want}"
                )

    @clause(13)
    def test_list_keys_matches_the_list_capability(
        self, backend: Backend, run: Run, keyspace: Keyspace, allocator: FreeListAllocator
    ) -> None:
        if not backend.capabilities.list_keys:
            _not_supported(run, "list_keys", "list_keys", lambda: listed_keys(backend))
            return
        keys = keyspace.keys(3)
        obj = make_obj(allocator, SHAPE, seed=71)
        try:
            run(backend.batched_put(keys, [obj] * 3))
        finally:
            obj.release()
        stored = {key for key in keys if run(backend.contains(key))}
        listed = _works(run, "list_keys", "list_keys", lambda: listed_keys(backend))
        foreign = [key for key in listed if not isinstance(key, CacheKey)]
        if foreign:
            violated(13, f"list_keys yielded {foreign[0]!r}, which is not a CacheKey")
        mine = {key for key in listed if key.model_name == keyspace.model}
        if mine != stored:
            violated(
                13,
                f"list_keys yielded chunk hashes {sorted(k.chunk_hash_hex for k in mine)} of this "
                f"test's keys; stored (contains is True): "
                f"{sorted(k.chunk_hash_hex for k in stored)}",
            )

    @clause(13)
    def test_remove_matches_the_remove_capability(
        self, backend: Backend, run: Run, keyspace: Keyspace, allocator: FreeListAllocator
    ) -> None:
        key = keyspace.key(1)
        obj = make_obj(allocator, SHAPE, seed=72)
        try:
            run(backend.put(key, obj))
        finally:
            obj.release()
        if not backend.capabilities.remove:
            _not_supported(run, "remove", "remove of a stored key", lambda: backend.remove(key))
            _not_supported(
                run,
                "remove",
                "remove of a key never stored",
                lambda: backend.remove(keyspace.key(2)),
            )
            return
        present = run(backend.contains(key))
        removed = _works(run, "remove", "remove", lambda: backend.remove(key))
        if removed is not present:
            violated(
                13,
                f"the backend declares 'remove'; remove of a key whose contains is {present} "
                f"returned {removed!r}",
            )
        got = run(backend.get(key))
        if got is not None or run(backend.contains(key)):
            release_all([got])
            violated(13, "the backend declares 'remove' but the key is still there after remove")

    @clause(13)
    def test_objects_are_in_host_memory_without_device_memory(
        self, backend: Backend, run: Run, keyspace: Keyspace, allocator: FreeListAllocator
    ) -> None:
        if backend.capabilities.device_memory:
            not_applicable("the backend declares 'device_memory': get may return GPU memory")
        keys = keyspace.keys(2)
        obj = make_obj(allocator, SHAPE, seed=73)
        try:
            run(backend.batched_put(keys, [obj, obj]))
        finally:
            obj.release()
        got = [run(backend.get(keys[0])), *run(backend.batched_get(keys))]
        try:
            returned = [g for g in got if g is not None]
            if not returned:
                not_applicable("the backend kept none of the objects put; nothing to inspect")
            devices = sorted({str(g.device) for g in returned if g.device.type != "cpu"})
            if devices:
                violated(
                    13,
                    f"'device_memory' is not declared, but get returned objects on {devices}",
                )
        finally:
            release_all(got)

    @clause(5, 13)
    def test_get_results_stay_intact_when_the_key_changes_or_the_backend_closes(
        self,
        open_contract_backend: Callable[..., Backend],
        run: Run,
        keyspace: Keyspace,
        allocator: FreeListAllocator,
    ) -> None:
        """What makes ``zero_copy`` honest (and every other backend correct): an object get
        returned is the caller's, whatever happens to the key or the backend afterwards."""
        backend = open_contract_backend()
        key = keyspace.key(1)
        first = make_obj(allocator, SHAPE, seed=74)
        second = make_obj(allocator, SHAPE, seed=75)
        expected = MemoryObj(first.raw.clone(), first.shape, first.dtype, first.fmt)
        got: MemoryObj | None = None
        try:
            run(backend.put(key, first))
            got = run(backend.get(key))
            if got is None:
                not_applicable("the backend kept nothing that was put; nothing to inspect")
            run(backend.put(key, second))
            if backend.capabilities.remove:
                run(backend.remove(key))
            run(backend.close())
            if not got.is_valid:
                violated(5, "an object returned by get was freed when the key changed or closed")
            problem = difference(expected, got)
            if problem is not None:
                violated(
                    5,
                    "an object returned by get changed after its key was overwritten, removed "
                    f"and the backend closed: {problem}",
                )
        finally:
            release_all([got, first, second])

    @clause(13)
    def test_native_batching_overrides_the_batched_operations(self, backend: Backend) -> None:
        if not backend.capabilities.native_batching:
            not_applicable("the backend does not declare 'native_batching'")
        inner = type(innermost(backend))
        defaults = inner.missing_hooks("native_batching")
        if defaults:
            violated(
                13,
                f"{inner.__name__} declares 'native_batching' but keeps the per-key default "
                f"of {', '.join(defaults)}",
            )

    @clause(13)
    def test_a_second_backend_sees_the_same_objects_when_shared_across_processes(
        self,
        open_contract_backend: Callable[..., Backend],
        run: Run,
        keyspace: Keyspace,
        allocator: FreeListAllocator,
    ) -> None:
        """Approximated within one process: a second backend opened on the same URL shares no
        Python state with the first, only the store behind the URL."""
        first = open_contract_backend()
        if not first.capabilities.shared_across_processes:
            not_applicable("the backend does not declare 'shared_across_processes'")
        second = open_contract_backend()
        objs = [make_obj(allocator, SHAPE, seed=s) for s in (76, 77)]
        try:
            for writer, reader, n, obj in (
                (first, second, 1, objs[0]),
                (second, first, 2, objs[1]),
            ):
                run(writer.put(keyspace.key(n), obj))
                got = run(reader.get(keyspace.key(n)))
                try:
                    check_same(
                        13,
                        obj,
                        got,
                        "the backend declares 'shared_across_processes'; another backend on the "
                        "same URL read what one put",
                    )
                finally:
                    release_all([got])
        finally:
            release_all(objs)


__all__ = ["CapabilityContract"]
