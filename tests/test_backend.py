"""The Backend and BytesBackend bases: framing, ownership, batching defaults, options."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from kvplug import (
    BackendClosed,
    BackendTimeout,
    BytesBackend,
    CacheKey,
    Capabilities,
    FreeListAllocator,
    MemoryFormat,
    NotSupported,
    UnknownOption,
)
from kvplug.backend import Buffer, BytesBackendOptions


class DictBytes(BytesBackend):
    """A byte store in a dict, with switches to make it fail."""

    capabilities = Capabilities(delete=True)

    def __init__(self, url: Any = "dict://", **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self.values: dict[str, bytes] = {}
        self.fail_puts = False

    async def get_bytes(self, key: str) -> Buffer | None:
        return self.values.get(key)

    async def put_bytes(self, key: str, parts: Sequence[Buffer]) -> None:
        if self.fail_puts:
            raise ConnectionError("store went away")
        self.values[key] = b"".join(parts)

    async def contains_bytes(self, key: str) -> bool:
        return key in self.values

    async def remove_bytes(self, key: str) -> bool:
        return self.values.pop(key, None) is not None

    async def close(self) -> None:
        self.mark_closed()


class NoDelete(DictBytes):
    capabilities = Capabilities()


def key(n: int, model: str = "m") -> CacheKey:
    return CacheKey(model, 1, 0, n)


@pytest.fixture
def allocator() -> FreeListAllocator:
    return FreeListAllocator(1 << 24)


def run(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


def filled(allocator: FreeListAllocator, shape: tuple[int, ...], dtype: torch.dtype, seed: int):
    obj = allocator.allocate(shape, dtype, MemoryFormat.KV_2LTD)
    assert obj is not None
    generator = torch.Generator().manual_seed(seed)
    obj.raw.copy_(torch.randint(0, 256, (obj.nbytes,), dtype=torch.uint8, generator=generator))
    return obj


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.uint8,
    ],
)
def test_bytes_backend_round_trip_is_bit_exact(allocator, dtype) -> None:
    backend = DictBytes(allocator=allocator)
    obj = filled(allocator, (2, 3, 17, 24), dtype, 1)

    async def main() -> None:
        await backend.put(key(1), obj)
        got = await backend.get(key(1))
        assert got is not None
        assert (got.shape, got.dtype, got.fmt) == (obj.shape, obj.dtype, obj.fmt)
        assert torch.equal(got.raw, obj.raw)
        assert got.data_ptr() != obj.data_ptr()
        got.release()

    run(main())
    obj.release()
    assert allocator.stats().used == 0


@pytest.mark.parametrize("damage", ["flip_payload", "flip_header", "truncate", "extend", "junk"])
def test_damaged_value_is_a_counted_miss_and_removed(allocator, damage) -> None:
    backend = DictBytes(allocator=allocator)
    obj = filled(allocator, (2, 2, 8, 16), torch.float16, 2)
    run(backend.put(key(1), obj))
    obj.release()
    stored = bytearray(backend.values["m@1@0@1@half"])
    if damage == "flip_payload":
        stored[-1] ^= 0x40
    elif damage == "flip_header":
        stored[20] ^= 0x01
    elif damage == "truncate":
        del stored[-5:]
    elif damage == "extend":
        stored += b"\0"
    else:
        stored = bytearray(b"not a frame at all")
    backend.values["m@1@0@1@half"] = bytes(stored)
    assert run(backend.get(key(1))) is None
    assert backend.corrupt_objects == 1
    assert "m@1@0@1@half" not in backend.values
    assert allocator.stats().used == 0


def test_put_releases_its_reference_on_failure(allocator) -> None:
    backend = DictBytes(allocator=allocator)
    backend.fail_puts = True
    obj = filled(allocator, (4, 4), torch.float32, 3)
    with pytest.raises(ConnectionError):
        run(backend.put(key(1), obj))
    assert obj.ref_count == 1
    obj.release()
    assert allocator.stats().object_count == 0


def test_batched_defaults_align_and_count_prefixes(allocator) -> None:
    backend = DictBytes(allocator=allocator)
    objs = [filled(allocator, (64,), torch.float16, n) for n in range(4)]

    async def main() -> None:
        await backend.batched_put([key(0), key(1), key(3)], [objs[0], objs[1], objs[3]])
        got = await backend.batched_get([key(3), key(2), key(0)])
        assert got[1] is None
        assert got[0] is not None and torch.equal(got[0].raw, objs[3].raw)
        assert got[2] is not None and torch.equal(got[2].raw, objs[0].raw)
        for obj in got:
            if obj is not None:
                obj.release()
        assert await backend.batched_contains([key(0), key(1), key(2), key(3)]) == 2
        assert await backend.batched_contains([key(2), key(0)]) == 0
        assert await backend.batched_contains([]) == 0

    run(main())
    for obj in objs:
        obj.release()
    assert allocator.stats().used == 0


def test_batched_get_releases_what_it_read_when_one_get_fails(allocator) -> None:
    class FailsOnSecond(DictBytes):
        async def get_bytes(self, key: str) -> Buffer | None:
            if key.endswith("@2@half"):
                raise ConnectionError("lost")
            return await super().get_bytes(key)

    backend = FailsOnSecond(allocator=allocator)
    obj = filled(allocator, (64,), torch.float16, 0)
    run(backend.batched_put([key(1), key(3)], [obj, obj]))
    obj.release()
    with pytest.raises(ConnectionError):
        run(backend.batched_get([key(1), key(2), key(3)]))
    assert allocator.stats().used == 0


def test_batched_put_rejects_mismatched_lengths(allocator) -> None:
    with pytest.raises(ValueError, match="2 keys but 1 objects"):
        run(DictBytes(allocator=allocator).batched_put([key(1), key(2)], [object()]))  # type: ignore[list-item]


def test_keys_of_other_namespaces_do_not_collide(allocator) -> None:
    backend = DictBytes(allocator=allocator)
    a = filled(allocator, (16,), torch.float32, 1)
    run(backend.put(key(1, "model-a"), a))
    assert run(backend.get(key(1, "model-b"))) is None
    assert run(backend.contains(CacheKey("model-a", 2, 1, 1))) is False
    a.release()


def test_options_merge_url_query_and_explicit_values() -> None:
    backend = DictBytes("dict://?timeout=2.5&key_prefix=a:", timeout=4)
    assert isinstance(backend.options, BytesBackendOptions)
    assert backend.options.timeout == 4.0
    assert backend.options.key_prefix == "a:"
    assert backend.key_string(key(9)) == "a:m@1@0@9@half"


def test_unknown_and_invalid_options_are_explained() -> None:
    with pytest.raises(UnknownOption, match="Did you mean 'timeout'"):
        DictBytes("dict://?timout=3")
    with pytest.raises(UnknownOption, match="timeout"):
        DictBytes("dict://?timeout=-1")
    with pytest.raises(Exception, match="unknown serde 'zstd-nope'"):
        DictBytes("dict://?serde=zstd-nope")


def test_undeclared_capabilities_raise_not_supported(allocator) -> None:
    backend = NoDelete(allocator=allocator)
    with pytest.raises(NotSupported):
        run(backend.remove(key(1)))
    with pytest.raises(NotSupported):
        run(backend.pin(key(1)))
    with pytest.raises(NotSupported):
        run(backend.unpin(key(1)))
    with pytest.raises(NotSupported):
        backend.list_keys()
    assert Capabilities(pin=True, list=True).declared() == ("pin", "list")


def test_deadline_turns_a_hang_into_backend_timeout() -> None:
    backend = DictBytes("dict://?timeout=0.05")

    async def main() -> None:
        with pytest.raises(BackendTimeout, match=r"longer than 0\.05 s"):
            await backend.with_deadline(asyncio.sleep(5), "get")

    run(main())


def test_closed_backend_refuses_operations(allocator) -> None:
    backend = DictBytes(allocator=allocator)

    async def main() -> None:
        async with backend:
            pass
        await backend.close()
        assert backend.closed
        for operation in (backend.get(key(1)), backend.contains(key(1)), backend.remove(key(1))):
            with pytest.raises(BackendClosed):
                await operation

    run(main())
