"""Clauses 1, 2, 3, 4 and 7 at once: a Hypothesis state machine checked against a dict model."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvplug import Backend, FreeListAllocator, MemoryObj
from kvplug_contracts.support import Keyspace, Run, clause, difference, make_obj, violated

# Tiny objects and few keys, so no store ever needs to evict: every miss is a violation.
SHAPE = (2, 1, 4, 16)
DTYPES = (torch.float16, torch.bfloat16)
KEYS = 8
MACHINE_SETTINGS = settings(
    max_examples=25,
    stateful_step_count=30,
    deadline=None,
    # No example database: it would write .hypothesis/ into the caller's directory and replay
    # one backend's failing examples against the next backend checked there.
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

indexes = st.integers(0, KEYS - 1)
seeds = st.integers(0, 2**16)
dtypes = st.sampled_from(DTYPES)
index_lists = st.lists(indexes, max_size=KEYS, unique=True)


@dataclass(frozen=True)
class Value:
    """One object put: its seed and dtype (to name it) and a private copy of it."""

    seed: int
    dtype: torch.dtype
    copy: MemoryObj

    def __str__(self) -> str:
        return f"seed {self.seed} {str(self.dtype).removeprefix('torch.')}"


def _names(values: Sequence[Value]) -> str:
    return " or ".join(str(v) for v in values)


class ModelContract:
    """Clauses 1, 2, 3, 4 and 7: random sequences of put, get, contains, remove and the
    batched forms over eight keys, each answer checked against a dict model.

    A key the model holds holds the object of its last completed put (clause 3: an overwrite
    replaces).
    """

    @clause(1, 2, 3, 4, 7)
    def test_random_operations_agree_with_a_dict_model(
        self, backend: Backend, run: Run, allocator: FreeListAllocator
    ) -> None:
        delete = backend.capabilities.remove

        class DictModelMachine(RuleBasedStateMachine):
            def __init__(self) -> None:
                super().__init__()
                self.keyspace = Keyspace("model")  # an empty namespace for each example
                self.model: dict[int, list[Value]] = {}
                """index -> the object the key holds now (a list of the one object its last
                put stored)."""
                self.history: dict[int, list[Value]] = {}
                self.removed: set[int] = set()

            def _put(self, index: int, seed: int, dtype: torch.dtype) -> None:
                obj = make_obj(allocator, SHAPE, dtype, seed=seed)
                try:
                    run(backend.put(self.keyspace.key(index), obj))
                    value = Value(seed, dtype, MemoryObj(obj.raw.clone(), SHAPE, dtype, obj.fmt))
                finally:
                    obj.release()
                self._stored(index, value)

            def _stored(self, index: int, value: Value) -> None:
                self.model[index] = [value]
                self.history.setdefault(index, []).append(value)
                self.removed.discard(index)

            def _check(self, index: int, got: MemoryObj | None, what: str) -> None:
                """A read of ``index`` returned ``got``: the model must allow it."""
                allowed = self.model.get(index)
                if allowed is None:
                    if got is not None:
                        if index in self.removed:
                            violated(7, f"{what} of key {index} hit after it was removed")
                        violated(1, f"{what} of key {index}, never put, returned {got!r}")
                    return
                if got is None:
                    violated(
                        2,
                        f"{what} of key {index} missed; it holds {_names(allowed)} (put and not "
                        "removed; the objects are too few and small to be evicted)",
                    )
                for value in allowed:
                    if difference(value.copy, got) is None:
                        self.model[index] = [value]
                        return
                earlier = [v for v in self.history[index] if difference(v.copy, got) is None]
                if earlier:
                    violated(
                        3,
                        f"{what} of key {index} returned {earlier[-1]}, put before; the key "
                        f"holds {_names(allowed)} now (the last completed put replaced it): "
                        "stale data",
                    )
                for other, values in self.history.items():
                    for value in values:
                        if other != index and difference(value.copy, got) is None:
                            violated(
                                2, f"{what} of key {index} returned {value}, put under key {other}"
                            )
                violated(
                    2,
                    f"{what} of key {index} returned an object that was never put: "
                    f"{difference(allowed[-1].copy, got)} (compared with {allowed[-1]})",
                )

            @rule(index=indexes, seed=seeds, dtype=dtypes)
            def put(self, index: int, seed: int, dtype: torch.dtype) -> None:
                self._put(index, seed, dtype)

            @rule(items=st.lists(st.tuples(indexes, seeds), max_size=4, unique_by=lambda t: t[0]))
            def batched_put(self, items: list[tuple[int, int]]) -> None:
                objs = [make_obj(allocator, SHAPE, seed=seed) for _, seed in items]
                try:
                    run(backend.batched_put([self.keyspace.key(i) for i, _ in items], objs))
                    values = [
                        Value(seed, obj.dtype, MemoryObj(obj.raw.clone(), SHAPE, obj.dtype))
                        for (_, seed), obj in zip(items, objs, strict=True)
                    ]
                finally:
                    for obj in objs:
                        obj.release()
                for (index, _), value in zip(items, values, strict=True):
                    self._stored(index, value)

            @rule(index=indexes)
            def get(self, index: int) -> None:
                got = run(backend.get(self.keyspace.key(index)))
                try:
                    self._check(index, got, "get")
                finally:
                    if got is not None:
                        got.release()

            @rule(chosen=index_lists)
            def batched_get(self, chosen: list[int]) -> None:
                got = run(backend.batched_get([self.keyspace.key(i) for i in chosen]))
                try:
                    if len(got) != len(chosen):
                        violated(4, f"batched_get of keys {chosen} returned {len(got)} results")
                    for position, (index, obj) in enumerate(zip(chosen, got, strict=True)):
                        self._check(index, obj, f"batched_get (position {position} of {chosen})")
                finally:
                    for obj in got:
                        if obj is not None:
                            obj.release()

            @rule(index=indexes)
            def contains(self, index: int) -> None:
                found = run(backend.contains(self.keyspace.key(index)))
                if found is not (index in self.model):
                    violated(
                        7,
                        f"contains of key {index} returned {found!r}; the key "
                        + (
                            f"holds {_names(self.model[index])}"
                            if index in self.model
                            else "was removed"
                            if index in self.removed
                            else "was never put"
                        ),
                    )

            @rule(chosen=index_lists)
            def batched_contains(self, chosen: list[int]) -> None:
                count = run(backend.batched_contains([self.keyspace.key(i) for i in chosen]))
                expected = next(
                    (n for n, index in enumerate(chosen) if index not in self.model), len(chosen)
                )
                if count != expected:
                    violated(
                        4,
                        f"batched_contains of keys {chosen} returned {count}, expected {expected}"
                        f" (keys put and not removed: {sorted(self.model)})",
                    )

            @precondition(lambda _: delete)
            @rule(index=indexes)
            def remove(self, index: int) -> None:
                removed = run(backend.remove(self.keyspace.key(index)))
                expected = index in self.model
                if removed is not expected:
                    violated(
                        7,
                        f"remove of key {index} returned {removed!r}, expected {expected} (the "
                        + ("key holds an object)" if expected else "key is absent)"),
                    )
                self.model.pop(index, None)
                self.removed.add(index)

            @invariant()
            def contains_agrees_with_the_model(self) -> None:
                keys = [self.keyspace.key(i) for i in range(KEYS)]

                async def every_contains() -> list[bool]:
                    return [await backend.contains(key) for key in keys]

                found = run(every_contains())
                wrong = [i for i in range(KEYS) if found[i] is not (i in self.model)]
                if wrong:
                    violated(
                        7,
                        f"contains disagrees with the model for keys {wrong}: returned "
                        f"{[found[i] for i in wrong]}; keys put and not removed: "
                        f"{sorted(self.model)}",
                    )

        try:
            run_state_machine_as_test(DictModelMachine, settings=MACHINE_SETTINGS)
        except pytest.fail.Exception as failure:
            # Hypothesis attaches the shrunk steps as notes, which a pytrace=False failure
            # would not show; they are the reproduction.
            notes: list[str] = getattr(failure, "__notes__", [])
            failure.msg = "\n".join([failure.msg or "", *notes])
            failure.__notes__ = []
            raise


__all__ = ["MACHINE_SETTINGS", "ModelContract"]
