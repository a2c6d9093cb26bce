"""Clause 15: safe under concurrency, from many tasks of one loop and many threads at once."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from kvplug import Backend, CacheKey, FreeListAllocator, MemoryObj
from kvplug.runtime.sync import SyncClient
from kvplug_contracts.support import (
    CANCEL_GRACE,
    Keyspace,
    LoopRunner,
    Run,
    clause,
    difference,
    make_obj,
    not_applicable,
    release_all,
    violated,
)

T = TypeVar("T")

# Small objects, few of them: the store never needs to evict, so every read must hit.
SHAPE = (2, 1, 8, 64)
TASKS = 200
THREADS = 8
OPS_PER_THREAD = 25
SHARED_VALUES = 4
# Rounds of put, then remove racing reads of the key, in both orders: the remove first and the
# reads 0 to 3 loop steps after it, or the reads first and the remove 0 to 3 steps after them,
# so that some reads land inside a remove that takes several steps, and some removes inside a
# read that has found the value but not yet read it.
RACE_ROUNDS = 32


def _report(problems: list[str], what: str) -> None:
    if problems:
        shown = "; ".join(problems[:3])
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        violated(15, f"{len(problems)} problem(s) with {what}: {shown}{more}")


def _compare(expected: MemoryObj, got: MemoryObj | None, what: str) -> str | None:
    if got is None:
        return f"{what} missed after its put completed"
    problem = difference(expected, got)
    return None if problem is None else f"{what}: {problem}"


def _on_another_loop(
    operation: Callable[[], Coroutine[Any, Any, list[str]]], where: str, limit: float
) -> list[str]:
    """The problems ``operation`` reports when run by ``asyncio.run`` in a thread of its own,
    cancelled after ``limit`` seconds (a daemon thread: one whose loop a hook blocks is
    abandoned, not joined)."""
    outcome: list[str] = []

    async def within_limit() -> list[str]:
        deadline = asyncio.timeout(limit)
        try:
            async with deadline:
                return await operation()
        except TimeoutError:
            if not deadline.expired():
                raise
            return [f"a round trip {where} did not finish within {limit:g} s"]

    def in_a_thread() -> None:
        try:
            outcome.extend(asyncio.run(within_limit()))
        except Exception as error:
            outcome.append(f"a round trip {where} raised {type(error).__name__}: {error}")

    thread = threading.Thread(target=in_a_thread, name="kvplug-contract-other-loop", daemon=True)
    thread.start()
    thread.join(limit + CANCEL_GRACE)
    if thread.is_alive():
        return [
            f"a round trip {where} did not finish within {limit:g} s, nor end "
            f"{CANCEL_GRACE:g} s after its cancel: a hook blocks that loop's thread"
        ]
    return outcome


class ConcurrencyContract:
    """Clause 15: many tasks and many threads at once get exactly what they put."""

    @clause(15)
    def test_many_tasks_at_once_read_back_exactly_what_they_put(
        self, backend: Backend, run: Run, keyspace: Keyspace, allocator: FreeListAllocator
    ) -> None:
        # Task i works on key i alone; every fifth task batches two keys of its own instead.
        singles = [i for i in range(TASKS) if i % 5 != 4]
        pairs = {
            i: (keyspace.key(10_000 + 2 * i), keyspace.key(10_001 + 2 * i))
            for i in range(TASKS)
            if i % 5 == 4
        }
        keys: dict[CacheKey, MemoryObj] = {}
        for i in singles:
            keys[keyspace.key(i)] = make_obj(allocator, SHAPE, seed=i)
        for i, (a, b) in pairs.items():
            keys[a] = make_obj(allocator, SHAPE, seed=10_000 + 2 * i)
            keys[b] = make_obj(allocator, SHAPE, seed=10_001 + 2 * i)
        problems: list[str] = []

        async def single(i: int) -> None:
            key = keyspace.key(i)
            await backend.put(key, keys[key])
            await asyncio.sleep(0)
            got = await backend.get(key)
            try:
                problem = _compare(keys[key], got, f"get of key {i}")
            finally:
                release_all([got])
            if problem:
                problems.append(problem)
            if await backend.contains(key) is not True:
                problems.append(f"contains of key {i} is not True after its put completed")

        async def batched(i: int) -> None:
            pair = list(pairs[i])
            await backend.batched_put(pair, [keys[k] for k in pair])
            await asyncio.sleep(0)
            count = await backend.batched_contains(pair)
            if count != 2:
                problems.append(f"batched_contains of the pair of task {i} returned {count}, not 2")
            found = await backend.batched_exists([pair[1], keyspace.key(20_000 + i), pair[0]])
            if found != [True, False, True]:
                problems.append(
                    f"batched_exists of the pair of task {i} around a key never stored returned "
                    f"{found}, not [True, False, True]"
                )
            got = await backend.batched_get(pair)
            try:
                if len(got) != 2:
                    problems.append(f"batched_get of 2 keys returned {len(got)} results")
                for key, obj in zip(pair, got, strict=False):
                    problem = _compare(keys[key], obj, f"batched_get of key {key.chunk_hash_hex}")
                    if problem:
                        problems.append(problem)
            finally:
                release_all(got)

        async def everything() -> list[BaseException | None]:
            return await asyncio.gather(
                *(batched(i) if i in pairs else single(i) for i in range(TASKS)),
                return_exceptions=True,
            )

        try:
            outcomes = run(everything())
            errors = [e for e in outcomes if e is not None]
            if errors:
                violated(
                    15,
                    f"{len(errors)} of {TASKS} concurrent tasks raised, e.g. "
                    f"{type(errors[0]).__name__}: {errors[0]}",
                )
            _report(problems, f"{TASKS} concurrent tasks")
            # Every write must still be there once all are done (no lost writes).
            ordered = list(keys)
            got = run(backend.batched_get(ordered))
            try:
                for key, obj in zip(ordered, got, strict=False):
                    problem = _compare(keys[key], obj, f"key {key.chunk_hash_hex} after all tasks")
                    if problem:
                        problems.append(problem)
            finally:
                release_all(got)
            _report(problems, f"reading back what {TASKS} concurrent tasks put")
        finally:
            release_all(list(keys.values()))

    @clause(15)
    def test_get_racing_remove_of_the_same_key_returns_the_object_or_none(
        self, backend: Backend, run: Run, keyspace: Keyspace, allocator: FreeListAllocator
    ) -> None:
        if not backend.capabilities.remove:
            not_applicable("the backend does not declare 'remove'")
        key = keyspace.key(7)
        obj = make_obj(allocator, (2, 2, 64, 128), seed=7)
        problems: list[str] = []

        async def read(steps: int, batched: bool) -> None:
            for _ in range(steps):
                await asyncio.sleep(0)
            what = "batched_get" if batched else "get"
            try:
                got = (await backend.batched_get([key]))[0] if batched else await backend.get(key)
            except Exception as error:
                problems.append(f"{what} during remove raised {type(error).__name__}: {error}")
                return
            if got is not None:
                problem = difference(obj, got)
                got.release()
                if problem is not None:
                    problems.append(f"{what} during remove returned a damaged object: {problem}")

        async def remove_after(steps: int) -> bool:
            for _ in range(steps):
                await asyncio.sleep(0)
            return await backend.remove(key)

        async def race(round_: int) -> None:
            await backend.put(key, obj)
            offset = round_ // 2
            if round_ % 2 == 0:
                remover = remove_after(0)
                readers = [read((offset + n) % 4, batched=n == 3) for n in range(4)]
            else:
                readers = [read(0, batched=n == 3) for n in range(4)]
                remover = remove_after(offset % 4 + 1)
            outcomes = await asyncio.gather(remover, *readers, return_exceptions=True)
            if isinstance(outcomes[0], Exception):
                error = outcomes[0]
                problems.append(f"remove racing gets raised {type(error).__name__}: {error}")

        async def rounds() -> None:
            for round_ in range(RACE_ROUNDS):
                await race(round_)

        try:
            run(rounds())
        finally:
            obj.release()
        _report(
            problems, f"get and batched_get racing remove of the same key ({RACE_ROUNDS} rounds)"
        )

    @clause(15)
    def test_a_backend_opened_on_one_loop_works_from_other_threads_and_loops(
        self,
        backend: Backend,
        run: Run,
        kvplug_runner: LoopRunner,
        keyspace: Keyspace,
        allocator: FreeListAllocator,
    ) -> None:
        """Engines open a backend once and use it from a worker's own loop, or hand it to a
        SyncClient: nothing of it may stay bound to the loop that opened it."""
        limit = kvplug_runner.timeout
        objs = [make_obj(allocator, SHAPE, seed=70 + n) for n in range(4)]
        keys = keyspace.keys(4, start=70)

        async def round_trip(n: int, where: str) -> list[str]:
            await backend.put(keys[n], objs[n])
            got = await backend.get(keys[n])
            try:
                problems = [p for p in [_compare(objs[n], got, f"get {where}")] if p]
            finally:
                release_all([got])
            if await backend.contains(keys[n]) is not True:
                problems.append(f"contains {where} is not True after its put")
            # Key 0 was put on the opening loop, key n here.
            listed = await backend.batched_get([keys[0], keys[n]])
            try:
                for i, have in zip((0, n), listed, strict=False):
                    problem = _compare(objs[i], have, f"batched_get {where} of key {i}")
                    if problem:
                        problems.append(problem)
            finally:
                release_all(listed)
            return problems

        try:
            problems = run(round_trip(0, "on the loop that opened the backend"))
            where = "in another thread's asyncio.run"
            elsewhere = _on_another_loop(lambda: round_trip(1, where), where, limit)
            problems += elsewhere
            problems += run(round_trip(2, "on the opening loop again, after another loop"))
            if elsewhere:
                # Not handed to a SyncClient, which would also close it on its own loop: the
                # test's fixture closes it on the opening loop, so that nothing leaks.
                _report(problems, "a backend used from a loop other than the one that opened it")
            client = SyncClient(backend)
            try:
                where = "through a SyncClient given the opened backend"
                problems += client.run(round_trip(3, where)).result(limit)
            except concurrent.futures.TimeoutError:
                problems.append(f"a round trip {where} did not finish within {limit:.0f} s")
            except Exception as error:
                problems.append(f"a round trip {where} raised {type(error).__name__}: {error}")
            finally:
                try:
                    client.close(timeout=limit)
                except Exception as error:
                    problems.append(
                        f"close through a SyncClient given the opened backend raised "
                        f"{type(error).__name__}: {error}"
                    )
        finally:
            release_all(objs)
        _report(problems, "a backend used from a loop other than the one that opened it")

    @clause(3, 15)
    def test_many_threads_through_a_sync_client_read_back_exactly_what_they_put(
        self,
        kvplug_url: str,
        kvplug_options: dict[str, Any],
        kvplug_runner: LoopRunner,
        keyspace: Keyspace,
        allocator: FreeListAllocator,
    ) -> None:
        """The engine's path: worker threads share one SyncClient, which opens the backend on
        its own loop thread."""
        limit = kvplug_runner.timeout
        client = SyncClient(kvplug_url, allocator=allocator, **kvplug_options)
        shared_key = keyspace.key(99_999)
        shared = [make_obj(allocator, SHAPE, seed=90_000 + s) for s in range(SHARED_VALUES)]
        problems: list[str] = []

        def wait(future: concurrent.futures.Future[T], what: str) -> T:
            try:
                return future.result(limit)
            except concurrent.futures.TimeoutError:
                raise TimeoutError(f"{what} did not finish within {limit:.0f} s") from None

        def worker(thread: int) -> None:
            mine: list[tuple[CacheKey, MemoryObj]] = []
            try:
                for i in range(OPS_PER_THREAD):
                    n = thread * 1000 + i
                    key = keyspace.key(n)
                    obj = make_obj(allocator, SHAPE, seed=n)
                    mine.append((key, obj))
                    what = f"thread {thread} op {i}"
                    kind = i % 5
                    if kind == 0:
                        wait(client.put(key, obj), what)
                        got = wait(client.get(key), what)
                        problem = _compare(obj, got, f"{what}: get of key {n}")
                        release_all([got])
                        if problem:
                            problems.append(problem)
                    elif kind == 1:
                        wait(client.put(key, obj), what)
                        if wait(client.contains(key), what) is not True:
                            problems.append(f"{what}: contains of key {n} is not True after put")
                    elif kind == 2:
                        # A pair: the key of this op and the previous op's key once more.
                        pair = [mine[-2][0], key]
                        objs = [mine[-2][1], obj]
                        wait(client.batched_put(pair, objs), what)
                        count = wait(client.batched_contains(pair), what)
                        if count != 2:
                            problems.append(f"{what}: batched_contains returned {count}, not 2")
                        got_list = wait(client.batched_get(pair), what)
                        for want, got in zip(objs, got_list, strict=False):
                            problem = _compare(want, got, f"{what}: batched_get")
                            if problem:
                                problems.append(problem)
                        release_all(got_list)
                    elif kind == 3:
                        wait(client.put(key, obj), what)
                        wait(client.put(shared_key, shared[(thread + i) % SHARED_VALUES]), what)
                        got = wait(client.get(shared_key), what)
                        if got is None:
                            problems.append(f"{what}: get of the key all threads write missed")
                        elif all(difference(s, got) is not None for s in shared):
                            problems.append(
                                f"{what}: the key all threads write holds none of the written "
                                f"objects (torn?): {difference(shared[0], got)}"
                            )
                        release_all([got])
                    else:
                        # Everything this thread put so far is still there, unchanged.
                        wait(client.put(key, obj), what)
                        held = [k for k, _ in mine]
                        got_list = wait(client.batched_get(held), what)
                        for (k, want), got in zip(mine, got_list, strict=False):
                            problem = _compare(want, got, f"{what}: key {k.chunk_hash_hex} later")
                            if problem:
                                problems.append(problem)
                        release_all(got_list)
            except Exception as error:
                problems.append(f"thread {thread} raised {type(error).__name__}: {error}")
            finally:
                release_all([obj for _, obj in mine])

        try:
            with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
                for future in [pool.submit(worker, t) for t in range(THREADS)]:
                    future.result()
        finally:
            client.close()
            release_all(shared)
        _report(problems, f"{THREADS} threads x {OPS_PER_THREAD} operations through SyncClient")


__all__ = ["ConcurrencyContract"]
