"""The audit wrapper (plugins/audit), composed as ``audit::<url>`` through kvplug.open_backend."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import pytest
import torch

import kvplug
from kvplug import (
    BackendClosed,
    BackendSpec,
    BackendUnavailable,
    CacheKey,
    Capabilities,
    CapacityExceeded,
    FreeListAllocator,
    MemoryObj,
    NotSupported,
    UnknownOption,
    UnknownScheme,
)
from kvplug_audit.backend import FAULT_OPS, LOGGER_NAME, AuditBackend
from kvplug_blackhole.backend import BlackholeBackend
from kvplug_cpu.backend import CpuBackend

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def key(i: int) -> CacheKey:
    return CacheKey("llama", 1, 0, i)


def filled(value: int, nbytes: int = 4096) -> MemoryObj:
    return MemoryObj.from_tensor(torch.full((nbytes,), value, dtype=torch.uint8))


async def open_audit(url: str = "audit::cpu://?max_size=1MiB", **options: Any) -> AuditBackend:
    backend = await kvplug.open_backend(url, **options)
    assert isinstance(backend, AuditBackend)
    return backend


async def value_of(backend: AuditBackend, i: int) -> int | None:
    obj = await backend.get(key(i))
    if obj is None:
        return None
    try:
        return int(obj.raw[0])
    finally:
        obj.release()


# -- composition ----------------------------------------------------------------------------------


def test_audit_wraps_the_backend_after_the_double_colon() -> None:
    async def main() -> None:
        backend = await open_audit("audit://?seed=3::cpu://?max_size=1MiB&eviction=fifo")
        assert isinstance(backend.inner, CpuBackend)
        assert backend.inner.options.eviction == "fifo"
        assert backend.options.seed == 3
        assert backend.allocator is backend.inner.allocator
        assert "audit" in kvplug.available_schemes()
        await backend.close()

    run(main())


@pytest.mark.parametrize(
    ("inner_url", "expected"),
    [
        (
            "cpu://?max_size=1MiB",
            Capabilities(
                pin=True, zero_copy=True, remove=True, list_keys=True, releases_on_cancel=True
            ),
        ),
        ("blackhole://", Capabilities(remove=True, releases_on_cancel=True)),
    ],
)
def test_capabilities_are_exactly_the_inner_backends(
    inner_url: str, expected: Capabilities
) -> None:
    async def main() -> None:
        backend = await open_audit(f"audit::{inner_url}")
        assert backend.capabilities == backend.inner.capabilities == expected
        assert AuditBackend.capabilities == Capabilities()  # per instance, not per class
        await backend.close()

    run(main())


def test_audit_alone_is_not_a_backend() -> None:
    with pytest.raises(UnknownScheme, match=r"audit::cpu://"):
        run(open_audit("audit://"))


def test_a_wrapper_option_typo_is_caught() -> None:
    with pytest.raises(UnknownOption, match="Did you mean 'fail_rate'"):
        run(open_audit("audit://?fail_rat=0.1::cpu://"))


@pytest.mark.parametrize(
    ("query", "match"),
    [
        ("fail_rate=1.5", "fail_rate"),
        ("fail_ops=get,gett", "Did you mean 'get'"),
        ("delay_ops=batched_putt", "delay_ops names 'batched_putt'.*Did you mean 'batched_put'"),
        ("delay=-1", "delay"),
        ("log_level=LOUD", "log_level"),
        ("verify=maybe", "verify"),
    ],
)
def test_bad_wrapper_options_are_rejected(query: str, match: str) -> None:
    with pytest.raises(UnknownOption, match=match):
        run(open_audit(f"audit://?{query}::cpu://"))


# -- pass-through ---------------------------------------------------------------------------------


def test_operations_pass_through_and_are_counted() -> None:
    async def main() -> None:
        backend = await open_audit()
        obj = filled(5)
        await backend.put(key(1), obj)
        assert obj.ref_count == 1  # put never takes the caller's reference
        assert await value_of(backend, 1) == 5
        assert await value_of(backend, 2) is None
        assert await backend.contains(key(1)) and not await backend.contains(key(2))
        assert await backend.pin(key(1)) and await backend.unpin(key(1))
        assert [k async for k in backend.list_keys()] == [key(1)]
        assert await backend.remove(key(1)) and not await backend.remove(key(1))
        assert backend.stats() == {
            "put": {"ok": 1},
            "get": {"hit": 1, "miss": 1},
            "contains": {"hit": 1, "miss": 1},
            "pin": {"ok": 1},
            "unpin": {"ok": 1},
            "remove": {"ok": 1, "miss": 1},
        }
        await backend.close()

    run(main())


def test_pin_on_an_inner_backend_without_it_raises_not_supported_before_reaching_it() -> None:
    async def main() -> None:
        backend = await open_audit("audit::blackhole://")
        with pytest.raises(NotSupported, match="does not declare the 'pin' capability"):
            await backend.pin(key(1))
        assert "pin" not in backend.stats()
        await backend.close()

    run(main())


def test_inner_errors_are_logged_counted_and_raised() -> None:
    async def main() -> None:
        backend = await open_audit("audit::cpu://?max_size=8KiB")
        with pytest.raises(CapacityExceeded):
            await backend.put(key(1), filled(1, 64 * 1024))
        assert backend.stats()["put"] == {"error:CapacityExceeded": 1}
        await backend.put(key(1), filled(1))  # a failed put leaves no false expectation
        assert await value_of(backend, 1) == 1
        await backend.close()

    run(main())


class _Spy:
    """Records the inner methods the wrapper calls (not the inner backend's calls to itself)."""

    def __init__(self, inner: kvplug.Backend, names: Sequence[str]) -> None:
        self.calls: list[tuple[str, int]] = []
        self.depth = 0
        for name in names:
            original = getattr(inner, name)

            async def forward(*args: Any, _name: str = name, _original: Any = original) -> Any:
                if self.depth == 0:
                    self.calls.append((_name, len(args[0]) if _name.startswith("batched") else 1))
                self.depth += 1
                try:
                    return await _original(*args)
                finally:
                    self.depth -= 1

            setattr(inner, name, forward)


def test_batched_operations_are_forwarded_as_batches() -> None:
    async def main() -> None:
        backend = await open_audit()
        spy = _Spy(
            backend.inner,
            ["get", "put", "contains", "batched_get", "batched_put", "batched_contains"],
        )
        keys = [key(i) for i in range(4)]
        await backend.batched_put(keys[:3], [filled(i) for i in range(3)])
        assert await backend.batched_contains(keys) == 3
        got = await backend.batched_get([keys[2], keys[3], keys[0]])
        assert [None if g is None else int(g.raw[0]) for g in got] == [2, None, 0]
        for g in got:
            if g is not None:
                g.release()
        assert spy.calls == [("batched_put", 3), ("batched_contains", 4), ("batched_get", 3)]
        assert backend.stats() == {
            "batched_put": {"ok": 1},
            "batched_contains": {"ok": 1},
            "batched_get": {"ok": 1},
        }
        await backend.close()

    run(main())


def test_close_is_idempotent_closes_the_inner_backend_and_later_calls_raise() -> None:
    async def main() -> None:
        backend = await open_audit()
        await backend.put(key(1), filled(1))
        allocator = backend.inner.allocator
        await backend.close()
        await backend.close()
        assert backend.closed and backend.inner.closed
        assert allocator.stats().used == 0 and allocator.stats().object_count == 0
        for call in (
            backend.get(key(1)),
            backend.put(key(1), filled(1)),
            backend.contains(key(1)),
            backend.remove(key(1)),
            backend.batched_get([key(1)]),
            backend.batched_contains([key(1)]),
            backend.pin(key(1)),
        ):
            with pytest.raises(BackendClosed):
                await call
        with pytest.raises(BackendClosed):
            backend.list_keys()

    run(main())


# -- verification ---------------------------------------------------------------------------------


def test_corrupted_stored_bytes_read_as_a_counted_miss_and_are_removed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        caller = FreeListAllocator(1 << 20)
        backend = await open_audit(allocator=caller)
        obj = caller.allocate((2, 4, 16, 8), torch.bfloat16)
        assert obj is not None
        obj.tensor.normal_()
        await backend.put(key(1), obj)
        obj.release()
        stored = await backend.inner.get(key(1))
        assert stored is not None
        stored.tensor[0, 0, 0, 0] += 1  # flip bits in the cached copy itself
        stored.release()
        with caplog.at_level(logging.ERROR, logger=LOGGER_NAME):
            assert await backend.get(key(1)) is None
        assert backend.corrupt_objects == 1
        assert backend.stats()["get"] == {"corrupt": 1}
        assert not await backend.inner.contains(key(1))
        assert not await backend.contains(key(1))  # contains agrees with get
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and "checksum mismatch" in errors[0].getMessage()
        assert str(key(1)) in errors[0].getMessage()
        await backend.close()
        assert caller.stats().used == 0 and caller.stats().object_count == 0

    run(main())


def test_corruption_in_a_batch_becomes_a_miss_in_its_slot() -> None:
    async def main() -> None:
        backend = await open_audit()
        await backend.batched_put([key(0), key(1)], [filled(0), filled(1)])
        stored = await backend.inner.get(key(1))
        assert stored is not None
        stored.raw[100] = 99
        stored.release()
        got = await backend.batched_get([key(0), key(1)])
        assert got[1] is None and got[0] is not None and int(got[0].raw[0]) == 0
        got[0].release()
        assert backend.corrupt_objects == 1
        assert not await backend.contains(key(1))
        await backend.close()
        assert backend.inner.allocator.stats().used == 0

    run(main())


def test_without_verify_corruption_is_passed_through() -> None:
    async def main() -> None:
        backend = await open_audit("audit://?verify=false::cpu://?max_size=1MiB")
        await backend.put(key(1), filled(1))
        stored = await backend.inner.get(key(1))
        assert stored is not None
        stored.raw[0] = 42
        stored.release()
        assert await value_of(backend, 1) == 42
        assert backend.corrupt_objects == 0
        await backend.close()

    run(main())


def test_keys_stored_before_the_wrapper_read_as_unverified_hits() -> None:
    async def main() -> None:
        backend = await open_audit()
        await backend.inner.put(key(1), filled(1))
        assert await value_of(backend, 1) == 1
        assert backend.corrupt_objects == 0
        await backend.close()

    run(main())


def test_a_miss_forgets_the_key_so_its_checksum_does_not_outlive_it() -> None:
    async def main() -> None:
        backend = await open_audit()
        await backend.put(key(1), filled(1))
        await backend.inner.remove(key(1))  # as if evicted by the inner tier
        assert await backend.get(key(1)) is None
        await backend.inner.put(key(1), filled(2))  # written later by another path
        assert await value_of(backend, 1) == 2
        assert backend.corrupt_objects == 0
        await backend.close()

    run(main())


def test_concurrent_writers_and_readers_of_one_key_raise_no_false_alarm() -> None:
    async def main() -> None:
        backend = await open_audit()

        async def writer(i: int) -> None:
            await backend.put(key(i % 3), filled(i % 256))

        async def reader(i: int) -> None:
            await value_of(backend, i % 3)

        await asyncio.gather(*(writer(i) if i % 2 else reader(i) for i in range(400)))
        await backend.batched_put([key(0)] * 4, [filled(i) for i in range(4)])
        got = await backend.batched_get([key(0), key(1), key(2)])
        assert all(g is not None for g in got)
        for g in got:
            assert g is not None
            g.release()
        assert backend.corrupt_objects == 0
        await backend.close()

    run(main())


# -- fault injection ------------------------------------------------------------------------------


def test_fail_rate_one_always_injects_before_the_inner_backend() -> None:
    async def main() -> None:
        backend = await open_audit("audit://?fail_rate=1::cpu://?max_size=1MiB")
        calls = [
            backend.get(key(1)),
            backend.put(key(1), filled(1)),
            backend.contains(key(1)),
            backend.remove(key(1)),
            backend.batched_get([key(1)]),
            backend.batched_put([key(1)], [filled(1)]),
            backend.batched_contains([key(1)]),
        ]
        for call in calls:
            with pytest.raises(BackendUnavailable, match="injected fault"):
                await call
        assert not await backend.inner.contains(key(1))  # no put reached the store
        assert backend.stats() == {op: {"injected": 1} for op in FAULT_OPS}
        assert await backend.pin(key(1)) is False  # pin, unpin are never injected
        await backend.close()

    run(main())


def test_fail_rate_zero_never_injects() -> None:
    async def main() -> None:
        backend = await open_audit("audit://?fail_rate=0&seed=1::cpu://?max_size=1MiB")
        for i in range(200):
            await backend.put(key(i % 10), filled(i % 256))
            await backend.get(key(i % 10))
        assert "injected" not in str(backend.stats())
        await backend.close()

    run(main())


async def _failure_pattern(url: str, count: int) -> list[bool]:
    backend = await open_audit(url)
    pattern = []
    for i in range(count):
        try:
            await backend.contains(key(i))
            pattern.append(False)
        except BackendUnavailable:
            pattern.append(True)
    await backend.close()
    return pattern


def test_seeded_injection_is_reproducible_and_about_the_rate() -> None:
    url = "audit://?fail_rate=0.25&seed=7::cpu://?max_size=1MiB"
    first = run(_failure_pattern(url, 2000))
    second = run(_failure_pattern(url, 2000))
    assert first == second
    assert 0.21 < sum(first) / len(first) < 0.29
    other = run(_failure_pattern(url.replace("seed=7", "seed=8"), 2000))
    assert other != first


def test_fail_ops_restricts_injection() -> None:
    async def main() -> None:
        backend = await open_audit("audit://?fail_rate=1&fail_ops=put,batched_put::cpu://")
        with pytest.raises(BackendUnavailable):
            await backend.put(key(1), filled(1))
        with pytest.raises(BackendUnavailable):
            await backend.batched_put([key(1)], [filled(1)])
        assert await backend.get(key(1)) is None
        assert not await backend.contains(key(1))
        assert await backend.batched_get([key(1)]) == [None]
        await backend.close()

    run(main())


# -- logging --------------------------------------------------------------------------------------


def test_every_operation_logs_one_line_with_op_key_size_latency_and_outcome(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        backend = await open_audit()
        await backend.put(key(1), filled(1, 8192))
        await value_of(backend, 1)
        await value_of(backend, 2)
        await backend.contains(key(2))
        await backend.close()

    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        run(main())
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER_NAME]
    assert len(lines) == 4
    put, hit, miss, contains = lines
    for line in lines:
        assert "latency_ms=" in line and "backend=cpu://?max_size=1MiB" in line
    assert f"op=put key={key(1)} size=8192 " in put and "outcome=ok" in put
    assert f"op=get key={key(1)} size=8192 " in hit and "outcome=hit" in hit
    assert f"op=get key={key(2)} size=0 " in miss and "outcome=miss" in miss
    assert "op=contains" in contains and "outcome=miss" in contains


def test_log_level_option_sets_the_level_of_operation_lines(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        backend = await open_audit("audit://?log_level=debug::cpu://")
        await backend.contains(key(1))
        await backend.close()

    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        run(main())
    assert not caplog.records
    with caplog.at_level(logging.DEBUG, logger=LOGGER_NAME):
        run(main())
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]


def test_injected_faults_are_logged_as_injected(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        backend = await open_audit("audit://?fail_rate=1::cpu://")
        with pytest.raises(BackendUnavailable):
            await backend.put(key(1), filled(1, 100))
        await backend.close()

    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        run(main())
    (line,) = [r.getMessage() for r in caplog.records]
    assert "op=put" in line and "size=100" in line and "outcome=injected" in line


def test_passwords_of_the_inner_url_never_reach_the_log(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kvplug.registry, "_registry", kvplug.registry.Registry())
    kvplug.register_backend(
        BackendSpec(
            name="secret-test",
            schemes=("kvtest-secret",),
            factory="kvplug_blackhole.backend:BlackholeBackend",
        ),
        replace=True,
    )

    async def main() -> AuditBackend:
        backend = await open_audit(
            "audit://?fail_rate=1&fail_ops=remove::kvtest-secret://admin:hunter2@db.example:7000"
        )
        assert isinstance(backend.inner, BlackholeBackend)
        await backend.put(key(1), filled(1))
        await backend.get(key(1))
        with pytest.raises(BackendUnavailable) as error:
            await backend.remove(key(1))
        assert "hunter2" not in str(error.value)
        await backend.close()
        return backend

    with caplog.at_level(logging.DEBUG, logger=LOGGER_NAME):
        backend = run(main())
    assert "hunter2" not in caplog.text and "hunter2" not in repr(backend)
    assert "kvtest-secret://admin:***@db.example:7000" in caplog.text


def test_remembered_checksums_stay_within_max_tracked_keys() -> None:
    async def main() -> None:
        backend = await open_audit("audit://?max_tracked_keys=50::cpu://?max_size=4MiB")
        for i in range(400):
            await backend.put(key(i), filled(i % 256, 256))
        assert backend.tracked_keys == 50
        assert backend.untracked_keys == 350
        # The most recent keys are still verified: tampering with one is caught...
        stored = await backend.inner.get(key(399))
        assert stored is not None
        stored.raw[0] = 7
        stored.release()
        assert await backend.get(key(399)) is None and backend.corrupt_objects == 1
        # ...and a forgotten one reads as an unverified hit, like keys put before the wrapper.
        assert await value_of(backend, 0) == 0
        await backend.close()

    run(main())


def test_a_delay_slows_the_listed_operations_before_they_reach_the_inner_backend() -> None:
    async def main() -> None:
        backend = await open_audit("audit://?delay=0.3&delay_ops=get,put::cpu://?max_size=1MiB")
        loop = asyncio.get_running_loop()
        started = loop.time()
        await backend.put(key(1), filled(1))
        assert await value_of(backend, 1) == 1
        assert loop.time() - started >= 0.6  # the put and the get, 0.3 s each
        started = loop.time()
        assert await backend.contains(key(1))
        await backend.batched_put([key(2)], [filled(2)])  # not listed: not delayed
        assert loop.time() - started < 0.25
        await backend.close()

    run(main())


def test_an_operation_cancelled_during_its_delay_never_reaches_the_inner_backend() -> None:
    async def main() -> None:
        backend = await open_audit("audit://?delay=5::cpu://?max_size=1MiB")
        source = filled(7)
        putting = asyncio.ensure_future(backend.put(key(1), source))
        await asyncio.sleep(0.05)
        putting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await putting
        assert source.ref_count == 1
        assert not await backend.inner.contains(key(1))
        assert backend.stats() == {}
        await backend.close()

    run(main())
