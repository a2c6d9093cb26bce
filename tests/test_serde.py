"""Unit tests of kvplug.serde: the naive serde and the serde registry."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

import kvplug.serde as serde_module
from kvplug.errors import ConfigError, CorruptObject
from kvplug.memory import DTYPE_CODES, FreeListAllocator, MemoryFormat, MemoryObj
from kvplug.serde import NaiveSerde, Serde, available_serdes, get_serde, register_serde


@pytest.fixture
def clean_registry() -> Iterator[None]:
    """Undo any serde registered by a test."""
    serdes = dict(serde_module._serdes)
    instances = dict(serde_module._instances)
    yield
    serde_module._serdes.clear()
    serde_module._serdes.update(serdes)
    serde_module._instances.clear()
    serde_module._instances.update(instances)


def random_obj(shape: tuple[int, ...], dtype: torch.dtype) -> MemoryObj:
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    tensor = raw.view(dtype).reshape(shape) if nbytes else torch.empty(shape, dtype=dtype)
    return MemoryObj.from_tensor(tensor, MemoryFormat.KV_2LTD)


# --------------------------------------------------------------------------- naive


def test_naive_is_always_available() -> None:
    naive = get_serde("naive")
    assert isinstance(naive, NaiveSerde)
    assert naive.name == "naive"
    assert "naive" in available_serdes()
    assert get_serde("naive") is naive


@pytest.mark.parametrize("dtype", list(DTYPE_CODES), ids=str)
@pytest.mark.parametrize("shape", [(2, 3, 1, 8), (2, 3, 17, 8), (2, 3, 0, 8)])
def test_naive_round_trip_is_bit_exact(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    naive = get_serde("naive")
    src = random_obj(shape, dtype)
    allocator = FreeListAllocator(1 << 20)
    dst = allocator.allocate(shape, dtype)
    assert dst is not None
    payload = naive.encode(src)
    assert memoryview(payload).nbytes == src.nbytes
    naive.decode(memoryview(payload), dst)
    assert bytes(dst.memoryview()) == bytes(src.memoryview())
    dst.release()
    assert allocator.stats().used == 0


def test_naive_encode_is_zero_copy() -> None:
    tensor = torch.zeros(16, dtype=torch.float32)
    payload = memoryview(get_serde("naive").encode(MemoryObj.from_tensor(tensor)))
    tensor[1] = 2.0
    assert np.frombuffer(payload, dtype=np.float32)[1] == 2.0


def test_naive_decode_accepts_read_only_payload() -> None:
    src = random_obj((4, 8), torch.bfloat16)
    dst = MemoryObj.from_tensor(torch.empty(4, 8, dtype=torch.bfloat16))
    get_serde("naive").decode(memoryview(bytes(src.memoryview())), dst)
    assert torch.equal(dst.raw, src.raw)


@pytest.mark.parametrize("delta", [-1, 1, -64])
def test_naive_decode_size_mismatch_raises_corrupt_object(delta: int) -> None:
    dst = MemoryObj.from_tensor(torch.full((64,), 7, dtype=torch.uint8))
    with pytest.raises(CorruptObject, match=f"naive payload has {64 + delta} bytes"):
        get_serde("naive").decode(memoryview(bytes(64 + delta)), dst)
    assert int(dst.raw.min()) == 7  # untouched


# --------------------------------------------------------------------------- registry


def test_unknown_serde_is_config_error_with_did_you_mean() -> None:
    with pytest.raises(ConfigError) as info:
        get_serde("naiv")
    message = str(info.value)
    assert "unknown serde 'naiv'" in message
    assert "Did you mean 'naive'?" in message
    assert "Available:" in message and "naive" in message


def test_unknown_serde_far_from_any_name_has_no_suggestion() -> None:
    with pytest.raises(ConfigError) as info:
        get_serde("zzzzzzzzzz")
    assert "Did you mean" not in str(info.value)
    assert "Available: " in str(info.value)


class _Reverse(Serde):
    name = "test-reverse"

    def encode(self, obj: MemoryObj) -> bytes:
        return bytes(obj.memoryview())[::-1]

    def decode(self, payload: memoryview, out: MemoryObj) -> None:
        if payload.nbytes != out.nbytes:
            raise CorruptObject("size")
        out.memoryview()[:] = bytes(payload)[::-1]


class _OtherReverse(_Reverse):
    pass


@pytest.mark.usefixtures("clean_registry")
def test_register_serde_makes_it_available() -> None:
    register_serde(_Reverse)
    assert "test-reverse" in available_serdes()
    serde = get_serde("test-reverse")
    assert isinstance(serde, _Reverse)
    src = MemoryObj.from_tensor(torch.arange(8, dtype=torch.uint8))
    dst = MemoryObj.from_tensor(torch.zeros(8, dtype=torch.uint8))
    payload = serde.encode(src)
    assert payload == bytes(range(7, -1, -1))
    serde.decode(memoryview(payload), dst)
    assert torch.equal(dst.raw, src.raw)


@pytest.mark.usefixtures("clean_registry")
def test_register_same_class_twice_is_fine() -> None:
    register_serde(_Reverse)
    register_serde(_Reverse)
    assert isinstance(get_serde("test-reverse"), _Reverse)


@pytest.mark.usefixtures("clean_registry")
def test_register_serde_conflict_raises_unless_replace() -> None:
    register_serde(_Reverse)
    first = get_serde("test-reverse")
    with pytest.raises(ConfigError, match="already registered") as info:
        register_serde(_OtherReverse)
    assert "replace=True" in str(info.value)
    assert __name__.rsplit(".", 1)[-1] in str(info.value)
    assert get_serde("test-reverse") is first
    register_serde(_OtherReverse, replace=True)
    replaced = get_serde("test-reverse")
    assert type(replaced) is _OtherReverse
    assert replaced is not first


@pytest.mark.usefixtures("clean_registry")
def test_naive_cannot_be_silently_replaced() -> None:
    class Impostor(NaiveSerde):
        pass

    with pytest.raises(ConfigError, match="'naive' is already registered"):
        register_serde(Impostor)
    assert type(get_serde("naive")) is NaiveSerde
