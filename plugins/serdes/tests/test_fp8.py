"""The lossy serdes: within the documented error bound for every KV dtype, keys kept exactly by
k16v8, what cannot be quantized stored bit-exact, and damage a clear CorruptObject."""

from __future__ import annotations

import contextlib
import logging
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplug.errors import CorruptObject, NotSupported
from kvplug.keys import CacheKey
from kvplug.memory import MemoryFormat, MemoryObj
from kvplug.serde import Serde, open_serde

KEY = CacheKey("llama", 1, 0, 0x2A, "bfloat16")
FLOATS = (torch.float16, torch.bfloat16, torch.float32)
HALF_SUBNORMAL_STEP = {
    torch.float16: 2.0**-25,
    torch.bfloat16: 2.0**-134,
    torch.float32: 2.0**-150,
}


def error_bound(original: torch.Tensor, block: int) -> torch.Tensor:
    """The documented bound, |x| / 14 + A * 2**-18 + half the dtype's subnormal step, with A the
    largest magnitude of x's block (blocks of the flattened values)."""
    flat = original.reshape(-1).double()
    blocks = math.ceil(flat.numel() / block)
    padded = torch.nn.functional.pad(flat.abs(), (0, blocks * block - flat.numel()))
    amax = padded.view(blocks, block).amax(dim=1).repeat_interleave(block)[: flat.numel()]
    return flat.abs() / 14 + amax * 2.0**-18 + HALF_SUBNORMAL_STEP[original.dtype]


def decoded(serde: Serde, tensor: torch.Tensor, fmt: MemoryFormat) -> tuple[bytes, torch.Tensor]:
    payload = bytes(serde.encode(MemoryObj.from_tensor(tensor, fmt), KEY))
    out = MemoryObj.from_tensor(torch.full_like(tensor, 7), fmt)
    serde.decode(memoryview(payload), out, KEY)
    return payload, out.tensor


def magnitudes(shape: tuple[int, ...], dtype: torch.dtype, seed: int, scale: float) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=generator) * scale
    values.view(-1)[:: max(1, values.numel() // 7)] *= 50
    values.view(-1)[1::13] = 0
    finite = torch.finfo(dtype).max
    return values.clamp(-finite, finite).to(dtype)


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(FLOATS),
    tokens=st.integers(1, 40),
    hidden=st.sampled_from([8, 64, 96, 128, 200]),
    block=st.sampled_from([16, 64, 128, 1000]),
    seed=st.integers(0, 2**31),
    scale=st.sampled_from([1e-6, 1e-3, 1.0, 30.0, 2000.0]),
)
def test_fp8_stays_within_the_documented_bound(
    dtype: torch.dtype, tokens: int, hidden: int, block: int, seed: int, scale: float
) -> None:
    tensor = magnitudes((2, 2, tokens, hidden), dtype, seed, scale)
    _, out = decoded(open_serde("fp8", {"block": block}), tensor, MemoryFormat.KV_2LTD)
    error = (out.double() - tensor.double()).abs().reshape(-1)
    assert bool((error <= error_bound(tensor, block)).all())
    assert bool((out[tensor == 0] == 0).all())


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_subnormals_and_extremes_stay_within_the_bound(dtype: torch.dtype) -> None:
    info = torch.finfo(dtype)
    values = torch.tensor(
        [info.tiny, info.tiny / 4, -info.tiny, info.max, -info.max, info.eps, 0.0, 1.0] * 20,
        dtype=dtype,
    )
    for block in (16, 128):
        _, out = decoded(open_serde("fp8", {"block": block}), values, MemoryFormat.KV_2TD)
        error = (out.double() - values.double()).abs()
        assert bool(torch.isfinite(out).all())
        assert bool((error <= error_bound(values, block)).all())


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize(
    ("fmt", "shape"),
    [
        (MemoryFormat.KV_2LTD, (2, 3, 16, 64)),
        (MemoryFormat.KV_2TD, (2, 16, 64)),
        (MemoryFormat.KV_T2D, (16, 2, 64)),
    ],
    ids=["KV_2LTD", "KV_2TD", "KV_T2D"],
)
def test_k16v8_keeps_keys_exactly_and_values_within_the_bound(
    dtype: torch.dtype, fmt: MemoryFormat, shape: tuple[int, ...]
) -> None:
    tensor = magnitudes(shape, dtype, seed=3, scale=1.0)
    payload, out = decoded(open_serde("k16v8"), tensor, fmt)
    if fmt == MemoryFormat.KV_T2D:
        keys, values, got_keys, got_values = tensor[:, 0], tensor[:, 1], out[:, 0], out[:, 1]
    else:
        keys, values, got_keys, got_values = tensor[0], tensor[1], out[0], out[1]
    assert torch.equal(got_keys.contiguous().view(torch.uint8), keys.contiguous().view(torch.uint8))
    error = (got_values.double() - values.double()).abs().reshape(-1)
    assert bool((error <= error_bound(values.contiguous(), 128)).all())
    assert not torch.equal(got_values, values)  # it did quantize
    nbytes = tensor.numel() * tensor.element_size()
    expected = nbytes / 2 + tensor.numel() / 2 + 4 * math.ceil(tensor.numel() / 2 / 128) + 32
    assert len(payload) == expected


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_fp8_halves_16_bit_kv(dtype: torch.dtype) -> None:
    tensor = magnitudes((2, 4, 256, 128), dtype, seed=1, scale=1.0)
    payload, _ = decoded(open_serde("fp8"), tensor, MemoryFormat.KV_2LTD)
    assert len(payload) == 32 + tensor.numel() + 4 * tensor.numel() // 128
    assert len(payload) / (tensor.numel() * 2) < 0.52


@pytest.mark.parametrize("name", ["fp8", "k16v8"])
def test_k16v8_refuses_objects_that_do_not_say_where_k_is(name: str) -> None:
    for fmt, tensor in (
        (MemoryFormat.BINARY_BUFFER, torch.ones(64, dtype=torch.bfloat16)),
        (MemoryFormat.KV_MLA_FMT, torch.ones(1, 2, 8, 64, dtype=torch.bfloat16)),
        (MemoryFormat.KV_2LTD, torch.ones(3, 2, 8, 64, dtype=torch.bfloat16)),
    ):
        obj = MemoryObj.from_tensor(tensor, fmt)
        if name == "fp8":
            _, out = decoded(open_serde(name), tensor, fmt)
            assert torch.equal(out, tensor)  # ones quantize exactly
            continue
        with pytest.raises(NotSupported, match=r"serde=fp8.*KV_2LTD, KV_2TD or KV_T2D"):
            open_serde(name).encode(obj, KEY)


@pytest.mark.parametrize("name", ["fp8", "k16v8"])
def test_what_cannot_be_quantized_is_stored_bit_exact(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    serde = open_serde(name, {"block": 32})  # a fresh instance: it warns once
    raw = torch.arange(256, dtype=torch.uint8).repeat(4)
    with caplog.at_level(logging.WARNING, logger="kvplug_serdes.fp8"):
        for _ in range(2):
            _, out = decoded(serde, raw, MemoryFormat.BINARY_BUFFER)
            assert torch.equal(out, raw)
    assert [r.getMessage() for r in caplog.records].count(caplog.records[0].getMessage()) == 1
    assert "lossless serde" in caplog.records[0].getMessage()
    with_nan = magnitudes((2, 8, 64), torch.bfloat16, seed=2, scale=1.0)
    with_nan[1, 3, 5] = float("nan")
    with_nan[0, 0, 0] = float("inf")
    _, out = decoded(serde, with_nan, MemoryFormat.KV_2TD)
    assert torch.equal(out.view(torch.int16), with_nan.view(torch.int16))


def test_a_reader_with_another_block_size_decodes_with_the_writers() -> None:
    tensor = magnitudes((2, 16, 64), torch.bfloat16, seed=5, scale=1.0)
    payload = bytes(open_serde("fp8", {"block": 16}).encode(MemoryObj.from_tensor(tensor)))
    out = MemoryObj.from_tensor(torch.zeros_like(tensor))
    open_serde("fp8", {"block": 512}).decode(memoryview(payload), out)
    error = (out.tensor.double() - tensor.double()).abs().reshape(-1)
    assert bool((error <= error_bound(tensor, 16)).all())


@pytest.mark.parametrize("name", ["fp8", "k16v8"])
def test_damaged_payloads_are_corrupt_objects(name: str) -> None:
    tensor = magnitudes((2, 8, 64), torch.float16, seed=4, scale=1.0)
    payload = bytes(open_serde(name).encode(MemoryObj.from_tensor(tensor, MemoryFormat.KV_2TD)))
    mode = bytearray(payload)
    mode[1] = 5
    block = bytearray(payload)
    block[4:8] = b"\0\0\0\0"
    count = bytearray(payload)
    count[24] ^= 1
    for damaged in (b"", payload[:31], payload[:-1], payload + b"\0", mode, block, count):
        out = MemoryObj.from_tensor(torch.zeros_like(tensor), MemoryFormat.KV_2TD)
        with pytest.raises(CorruptObject, match=name):
            open_serde(name).decode(memoryview(bytes(damaged)), out, KEY)
    other_dtype = MemoryObj.from_tensor(torch.zeros(2, 8, 32, dtype=torch.float32))
    with pytest.raises(CorruptObject):
        open_serde(name).decode(memoryview(payload), other_dtype, KEY)


@settings(max_examples=80, deadline=None)
@given(data=st.data(), name=st.sampled_from(["fp8", "k16v8"]))
def test_arbitrary_damage_raises_nothing_but_corrupt_object(name: str, data: st.DataObject) -> None:
    tensor = magnitudes((2, 4, 64), torch.bfloat16, seed=data.draw(st.integers(0, 50)), scale=1.0)
    payload = bytearray(open_serde(name).encode(MemoryObj.from_tensor(tensor, MemoryFormat.KV_2TD)))
    for _ in range(data.draw(st.integers(1, 3))):
        payload[data.draw(st.integers(0, len(payload) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(payload)))
    out = MemoryObj.from_tensor(torch.zeros_like(tensor), MemoryFormat.KV_2TD)
    with contextlib.suppress(CorruptObject):
        open_serde(name).decode(memoryview(bytes(payload[:cut])), out, KEY)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device)")
@pytest.mark.parametrize("name", ["fp8", "k16v8"])
def test_gpu_objects_quantize_on_the_gpu_within_the_bound(name: str) -> None:
    """The GPU's arithmetic may round a code differently from the CPU's (about 0.5% of the
    bytes on an H200): the promise is the bound, and that a payload decodes alike wherever it
    is decoded."""
    tensor = magnitudes((2, 4, 64, 128), torch.bfloat16, seed=9, scale=1.0)
    cpu_payload = bytes(
        open_serde(name).encode(MemoryObj.from_tensor(tensor, MemoryFormat.KV_2LTD))
    )
    gpu = MemoryObj.from_tensor(tensor.cuda(), MemoryFormat.KV_2LTD)
    gpu_payload = bytes(open_serde(name).encode(gpu))
    assert len(gpu_payload) == len(cpu_payload)
    out = MemoryObj.from_tensor(torch.zeros_like(tensor).cuda(), MemoryFormat.KV_2LTD)
    open_serde(name).decode(memoryview(gpu_payload), out)
    on_cpu = MemoryObj.from_tensor(torch.zeros_like(tensor), MemoryFormat.KV_2LTD)
    open_serde(name).decode(memoryview(gpu_payload), on_cpu)
    assert torch.equal(out.tensor.cpu(), on_cpu.tensor)
    quantized = tensor if name == "fp8" else tensor[1]
    got = on_cpu.tensor if name == "fp8" else on_cpu.tensor[1]
    error = (got.double() - quantized.double()).abs().reshape(-1)
    assert bool((error <= error_bound(quantized.contiguous(), 128)).all())
