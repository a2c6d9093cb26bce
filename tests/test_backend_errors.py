"""What the Backend template does with an exception a backend's hook raises: every public
operation raises kvplug errors only, naming the operation and the backend (its secrets masked),
with the hook's own exception chained as the cause; the template's own argument and result
checks keep raising TypeError/ValueError for the caller's or the hook's mistakes."""

from __future__ import annotations

import asyncio
import errno
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any

import pytest
import torch

from kvplug import (
    BackendError,
    BackendTimeout,
    BackendUnavailable,
    BytesBackend,
    CacheKey,
    Capabilities,
    CapacityExceeded,
    KvplugError,
    MemoryObj,
)
from kvplug.backend import Backend, Buffer
from kvplug.errors import UnexpectedBackendError
from kvplug.runtime.sync import SyncClient

SECRET = "hook-s3cret-pw"
URL = f"raising://app:{SECRET}@store-1:7000"


def key(n: int) -> CacheKey:
    return CacheKey("m", 1, 0, n)


class Raising(Backend):
    """Every hook raises :attr:`error` (when set); otherwise a store that holds nothing."""

    capabilities = Capabilities(pin=True, remove=True, list_keys=True)

    def __init__(self, url: Any = URL, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self.error: BaseException | None = None
        self.on_iteration = False

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    async def _open(self) -> None:
        self._raise()

    async def _close(self) -> None:
        self._raise()

    async def _get(self, key: CacheKey) -> MemoryObj | None:
        self._raise()
        return None

    async def _put(self, key: CacheKey, obj: MemoryObj) -> None:
        self._raise()

    async def _contains(self, key: CacheKey) -> bool:
        self._raise()
        return False

    async def _remove(self, key: CacheKey) -> bool:
        self._raise()
        return False

    async def _pin(self, key: CacheKey) -> bool:
        self._raise()
        return False

    async def _unpin(self, key: CacheKey) -> bool:
        self._raise()
        return False

    def _list_keys(self) -> AsyncIterator[CacheKey]:
        if not self.on_iteration:
            self._raise()
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[CacheKey]:
        yield key(1)
        self._raise()


class RaisingBytes(BytesBackend):
    """A byte store whose byte hooks raise :attr:`error`."""

    capabilities = Capabilities(remove=True)

    def __init__(self, url: Any = URL, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self.error: BaseException = RuntimeError("unset")

    async def get_bytes(self, key: str) -> Buffer | None:
        raise self.error

    async def put_bytes(self, key: str, parts: Sequence[Buffer]) -> None:
        raise self.error

    async def contains_bytes(self, key: str) -> bool:
        raise self.error

    async def remove_bytes(self, key: str) -> bool:
        raise self.error


async def _drain(keys: AsyncIterator[CacheKey]) -> list[CacheKey]:
    return [k async for k in keys]


def _obj() -> MemoryObj:
    return MemoryObj.from_tensor(torch.ones(8))


Call = Callable[[Backend], Coroutine[Any, Any, Any]]

OPERATIONS: dict[str, Call] = {
    "open": lambda b: b.open(),
    "get": lambda b: b.get(key(1)),
    "put": lambda b: b.put(key(1), _obj()),
    "contains": lambda b: b.contains(key(1)),
    "remove": lambda b: b.remove(key(1)),
    "get_into": lambda b: b.get_into(key(1), _obj()),
    "batched_get": lambda b: b.batched_get([key(1), key(2)]),
    "batched_put": lambda b: b.batched_put([key(1), key(2)], [_obj(), _obj()]),
    "batched_contains": lambda b: b.batched_contains([key(1), key(2)]),
    "batched_get_into": lambda b: b.batched_get_into([key(1)], [_obj()]),
    "pin": lambda b: b.pin(key(1)),
    "unpin": lambda b: b.unpin(key(1)),
    "list_keys": lambda b: _drain(b.list_keys()),
    "close": lambda b: b.close(),
}

RAW = [
    AttributeError("'NoneType' object has no attribute 'writelines'"),
    KeyError("slot 7 is not cached"),
    RuntimeError(f"lost redis://app:{SECRET}@store-1:7000 mid-command"),
]


def _raised(backend: Backend, call: Call) -> BaseException:
    try:
        asyncio.run(call(backend))
    except BaseException as error:
        return error
    raise AssertionError("the operation did not raise")


@pytest.mark.parametrize("raw", RAW, ids=lambda e: type(e).__name__)
@pytest.mark.parametrize("operation", OPERATIONS)
def test_every_operation_turns_a_hooks_raw_exception_into_a_kvplug_error(
    operation: str, raw: Exception
) -> None:
    backend = Raising()
    backend.error = raw
    error = _raised(backend, OPERATIONS[operation])
    assert isinstance(error, UnexpectedBackendError) and isinstance(error, BackendError)
    assert error.__cause__ is raw
    text = str(error)
    assert text.startswith(operation), text
    assert "raising://app:***@store-1:7000" in text and SECRET not in text
    assert f"Raising raised {type(raw).__name__}: " in text
    assert "report it to the maintainers of" in text
    if operation not in ("open", "close"):
        assert backend.operation_stats()[operation].errors == 1


@pytest.mark.parametrize("raw", RAW, ids=lambda e: type(e).__name__)
def test_a_listing_that_fails_while_it_is_iterated_raises_a_kvplug_error(raw: Exception) -> None:
    backend = Raising()
    backend.error, backend.on_iteration = raw, True
    error = _raised(backend, OPERATIONS["list_keys"])
    assert isinstance(error, UnexpectedBackendError) and error.__cause__ is raw
    assert str(error).startswith("list_keys on raising://app:***@store-1:7000 failed")
    stats = backend.operation_stats()["list_keys"]
    assert (stats.calls, stats.errors) == (1, 1)


@pytest.mark.parametrize("raw", RAW, ids=lambda e: type(e).__name__)
@pytest.mark.parametrize(
    "operation", ["get", "put", "contains", "remove", "batched_get", "read_raw", "write_raw"]
)
def test_a_byte_stores_raw_exception_is_a_kvplug_error_naming_the_key(
    operation: str, raw: Exception
) -> None:
    backend = RaisingBytes()
    backend.error = raw
    calls: dict[str, Call] = {
        **OPERATIONS,
        "read_raw": lambda b: b.read_raw(key(3)),  # type: ignore[attr-defined]
        "write_raw": lambda b: b.write_raw(key(3), b"frame"),  # type: ignore[attr-defined]
    }
    error = _raised(backend, calls[operation])
    assert isinstance(error, UnexpectedBackendError) and error.__cause__ is raw
    assert str(error).startswith(f"{operation} of m@1@0@"), str(error)
    assert SECRET not in str(error)


def test_the_templates_own_checks_keep_their_errors_while_the_hooks_are_translated() -> None:
    """A caller's mistake (a wrong argument) and a hook's wrong result stay TypeError or
    ValueError, raised as they are; only what a hook raises is translated."""

    class ReturnsATensor(Raising):
        async def _get(self, key: CacheKey) -> Any:
            return torch.zeros(2)

    backend = Raising()
    backend.error = KeyError("hook")
    assert isinstance(_raised(backend, lambda b: b.get(key(1))), UnexpectedBackendError)
    mistakes: list[tuple[Call, type[Exception]]] = [
        (lambda b: b.get("m@1@0@1@half"), TypeError),  # type: ignore[arg-type]
        (lambda b: b.batched_put([key(1), key(2)], [_obj()]), ValueError),
        (lambda b: b.batched_get("not keys"), TypeError),  # type: ignore[arg-type]
    ]
    for call, kind in mistakes:
        error = _raised(backend, call)
        assert type(error) is kind and error.__cause__ is None, error
    wrong = _raised(ReturnsATensor(), lambda b: b.get(key(1)))
    assert type(wrong) is TypeError and "ReturnsATensor._get returned Tensor" in str(wrong)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"), BackendUnavailable),
        (BrokenPipeError(errno.EPIPE, "Broken pipe"), BackendUnavailable),
        (TimeoutError("read timed out"), BackendTimeout),
        (OSError(errno.EIO, "Input/output error"), BackendError),
        (PermissionError(errno.EACCES, "Permission denied"), BackendError),
    ],
    ids=lambda value: value.__name__ if isinstance(value, type) else type(value).__name__,
)
def test_os_errors_become_a_failing_or_unreachable_store(
    raw: Exception, expected: type[BackendError]
) -> None:
    """A connection error is retryable (BackendUnavailable), a timeout is BackendTimeout, any
    other OSError a failing store (BackendError, which a Store isolates as a tier failure):
    none is called unexpected."""
    for operation in ("get", "batched_put", "open"):
        backend = Raising()
        backend.error = raw
        error = _raised(backend, OPERATIONS[operation])
        assert type(error) is expected and error.__cause__ is raw, error
        assert str(error).startswith(operation) and SECRET not in str(error)


def test_kvplug_errors_and_the_processs_own_conditions_pass_as_they_are() -> None:
    """A hook's kvplug error, a MemoryError and a cancellation reach the caller unchanged,
    and an inline operation that waits on a thread without a loop is still reported as such
    by SyncClient; a RuntimeError of any other kind is translated."""
    for raw in (CapacityExceeded("full"), MemoryError(), asyncio.CancelledError()):
        backend = Raising()
        backend.error = raw
        assert _raised(backend, OPERATIONS["get"]) is raw

    class SleepsInline(Raising):
        runs_inline = True

        async def _get(self, key: CacheKey) -> MemoryObj | None:
            await asyncio.sleep(0.001)  # needs a running loop: there is none inline
            return None

    with SyncClient(SleepsInline()) as client:
        with pytest.raises(KvplugError, match=r"declares runs_inline.*Remove runs_inline"):
            client.get(key(1)).result(10)
        backend = client.backend
        assert isinstance(backend, SleepsInline)
        backend.error = RuntimeError("dictionary changed size during iteration")
        with pytest.raises(UnexpectedBackendError, match="dictionary changed size"):
            client.contains(key(1)).result(10)
        backend.error = None
