"""The lossless serdes: bit-exact for every dtype, smaller for KV, and damage is a clear
:class:`CorruptObject`, never another exception or a half-written object."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplug.errors import ConfigError, CorruptObject, UnknownOption
from kvplug.keys import CacheKey
from kvplug.memory import DTYPE_CODES, MemoryFormat, MemoryObj
from kvplug.serde import Serde, open_serde
from kvplug_serdes.lossless import ShufflingCompressor, ZstdSerde

LOSSLESS = ("zstd", "lz4")
KEY = CacheKey("llama", 1, 0, 0x2A, "bfloat16")


def kv_like(numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Values shaped like KV: normal, with a few large outliers per head."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(numel, generator=generator)
    values[::97] *= 20
    return values.to(dtype)


def any_tensor(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Arbitrary bytes viewed as ``dtype`` (NaNs, infinities and subnormals included)."""
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype)


def round_trip(serde: Serde, tensor: torch.Tensor, fmt: MemoryFormat) -> tuple[bytes, MemoryObj]:
    payload = bytes(serde.encode(MemoryObj.from_tensor(tensor, fmt), KEY))
    out = MemoryObj.from_tensor(torch.full_like(tensor.view(torch.uint8), 0x5A).view(tensor.dtype))
    serde.decode(memoryview(payload), out, KEY)
    return payload, out


@pytest.mark.parametrize("name", LOSSLESS)
@pytest.mark.parametrize("dtype", sorted(DTYPE_CODES, key=str), ids=str)
def test_round_trips_are_bit_exact_for_every_dtype(name: str, dtype: torch.dtype) -> None:
    tensor = any_tensor(3 * 257, dtype, seed=DTYPE_CODES[dtype])
    _, out = round_trip(open_serde(name), tensor, MemoryFormat.KV_2TD)
    assert torch.equal(out.raw, MemoryObj.from_tensor(tensor).raw)


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(LOSSLESS),
    dtype=st.sampled_from(sorted(DTYPE_CODES, key=str)),
    numel=st.integers(0, 5000),
    seed=st.integers(0, 2**31),
    element_bytes=st.sampled_from(["auto", 1, 2, 4, 8]),
)
def test_any_bytes_of_any_length_come_back_bit_exact(
    name: str, dtype: torch.dtype, numel: int, seed: int, element_bytes: str | int
) -> None:
    serde = open_serde(name, {"element_bytes": element_bytes})
    tensor = any_tensor(numel, dtype, seed)
    _, out = round_trip(serde, tensor, MemoryFormat.BINARY_BUFFER)
    assert torch.equal(out.raw, MemoryObj.from_tensor(tensor).raw)


@pytest.mark.parametrize(
    ("name", "dtype", "at_most"),
    [
        ("zstd", torch.bfloat16, 0.75),
        ("zstd", torch.float16, 0.9),
        ("lz4", torch.bfloat16, 0.9),
        # lz4 finds repeats, not skewed byte counts: fp16's exponent plane has few of them.
        ("lz4", torch.float16, 1.0),
    ],
)
def test_the_byte_shuffle_is_what_makes_16_bit_kv_compress(
    name: str, dtype: torch.dtype, at_most: float
) -> None:
    tensor = kv_like(1 << 16, dtype)
    shuffled, _ = round_trip(open_serde(name), tensor, MemoryFormat.KV_2TD)
    plain, _ = round_trip(open_serde(name, {"element_bytes": 1}), tensor, MemoryFormat.KV_2TD)
    raw_bytes = tensor.numel() * 2
    assert len(shuffled) <= at_most * raw_bytes + 64
    assert len(shuffled) <= len(plain) + 8  # one plane length more in the header


@pytest.mark.parametrize("name", LOSSLESS)
def test_kv_handed_over_as_raw_bytes_shuffles_with_element_bytes(name: str) -> None:
    """An engine integration that hands kvplug uint8 bytes: ``element_bytes=2`` shuffles them as
    the 16-bit KV they are, and the reader needs no option to decode."""
    as_bytes = kv_like(1 << 16, torch.bfloat16).view(torch.uint8)
    by_dtype, _ = round_trip(open_serde(name), as_bytes, MemoryFormat.BINARY_BUFFER)
    told, out = round_trip(
        open_serde(name, {"element_bytes": 2}), as_bytes, MemoryFormat.BINARY_BUFFER
    )
    assert len(told) < len(by_dtype)
    assert torch.equal(out.raw, as_bytes)
    reader = open_serde(name)
    plain = MemoryObj.from_tensor(torch.zeros_like(as_bytes))
    reader.decode(memoryview(told), plain, KEY)
    assert torch.equal(plain.raw, as_bytes)


@pytest.mark.parametrize("name", LOSSLESS)
def test_noise_is_kept_as_it_is_rather_than_inflated(name: str) -> None:
    noise = any_tensor(1 << 15, torch.float16, seed=7)
    payload, out = round_trip(open_serde(name), noise, MemoryFormat.KV_2TD)
    assert len(payload) <= noise.numel() * 2 + 64
    assert torch.equal(out.raw, noise.view(torch.uint8))


def _damaged_cases(payload: bytes) -> dict[str, bytes]:
    version = bytearray(payload)
    version[0] = 9
    width = bytearray(payload)
    width[1] = 3
    nbytes = bytearray(payload)
    nbytes[8] ^= 0x40
    flipped = bytearray(payload)
    flipped[len(payload) // 2] ^= 0xFF
    return {
        "empty": b"",
        "header only": payload[:16],
        "truncated": payload[:-1],
        "longer": payload + b"\0",
        "version": bytes(version),
        "width": bytes(width),
        "size": bytes(nbytes),
        "flipped": bytes(flipped),
    }


@pytest.mark.parametrize("name", LOSSLESS)
def test_damaged_payloads_are_corrupt_objects(name: str) -> None:
    tensor = kv_like(4096, torch.bfloat16)
    payload, _ = round_trip(open_serde(name), tensor, MemoryFormat.KV_2TD)
    for case, damaged in _damaged_cases(payload).items():
        out = MemoryObj.from_tensor(torch.zeros_like(tensor))
        if case == "flipped":
            # A flipped byte inside a compressed plane may still decompress (the frame's
            # checksum is what catches it); it must never raise anything but CorruptObject.
            with contextlib.suppress(CorruptObject):
                open_serde(name).decode(memoryview(damaged), out, KEY)
            continue
        with pytest.raises(CorruptObject, match=name):
            open_serde(name).decode(memoryview(damaged), out, KEY)


@settings(max_examples=80, deadline=None)
@given(data=st.data(), name=st.sampled_from(LOSSLESS))
def test_arbitrary_damage_raises_nothing_but_corrupt_object(name: str, data: st.DataObject) -> None:
    tensor = kv_like(2048, torch.float16, seed=data.draw(st.integers(0, 100)))
    payload = bytearray(open_serde(name).encode(MemoryObj.from_tensor(tensor), KEY))
    for _ in range(data.draw(st.integers(1, 4))):
        payload[data.draw(st.integers(0, len(payload) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(payload)))
    out = MemoryObj.from_tensor(torch.zeros_like(tensor))
    with contextlib.suppress(CorruptObject):
        open_serde(name).decode(memoryview(bytes(payload[:cut])), out, KEY)


def test_options_are_validated_with_their_prefix() -> None:
    with pytest.raises(ConfigError, match="serde_level"):
        open_serde("zstd", {"level": 99})
    with pytest.raises(UnknownOption, match="serde_acceleration"):
        open_serde("zstd", {"acceleration": 2})
    with pytest.raises(ConfigError, match="serde_element_bytes"):
        open_serde("lz4", {"element_bytes": 3})
    assert open_serde("zstd", {"level": "3"}).options.level == 3  # type: ignore[attr-defined]


@pytest.mark.parametrize(("name", "extra"), [("zstd", "zstd"), ("lz4", "lz4")])
def test_a_missing_compressor_is_one_line_naming_the_install_command(
    name: str, extra: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    module = "zstandard" if name == "zstd" else "lz4"
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda wanted, *a: None if wanted == module else real(wanted)
    )
    with pytest.raises(ConfigError) as caught:
        open_serde(name, {"element_bytes": 2})
    message = str(caught.value)
    assert "\n" not in message
    assert f"pip install 'kvplug-serdes[{extra}]'" in message and module in message


def test_each_thread_compresses_with_its_own_codec() -> None:
    from concurrent.futures import ThreadPoolExecutor

    serde = open_serde("zstd")
    assert isinstance(serde, ZstdSerde) and isinstance(serde, ShufflingCompressor)
    tensors = [kv_like(1 << 15, torch.bfloat16, seed=seed) for seed in range(8)]
    with ThreadPoolExecutor(4) as pool:
        payloads = list(pool.map(lambda t: bytes(serde.encode(MemoryObj.from_tensor(t))), tensors))
    for tensor, payload in zip(tensors, payloads, strict=True):
        out = MemoryObj.from_tensor(torch.zeros_like(tensor))
        serde.decode(memoryview(payload), out)
        assert torch.equal(out.tensor.view(torch.int16), tensor.view(torch.int16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device)")
@pytest.mark.parametrize("name", LOSSLESS)
def test_gpu_objects_shuffle_on_the_gpu_and_decode_into_gpu_memory(name: str) -> None:
    tensor = kv_like(1 << 16, torch.bfloat16)
    on_cpu = bytes(open_serde(name).encode(MemoryObj.from_tensor(tensor), KEY))
    on_gpu = bytes(open_serde(name).encode(MemoryObj.from_tensor(tensor.cuda()), KEY))
    assert on_gpu == on_cpu
    out = MemoryObj.from_tensor(torch.zeros_like(tensor).cuda())
    open_serde(name).decode(memoryview(on_gpu), out, KEY)
    assert torch.equal(out.tensor.cpu().view(torch.int16), tensor.view(torch.int16))


@pytest.mark.parametrize("name", LOSSLESS)
def test_a_large_noise_plane_is_kept_after_a_sample_and_the_rest_compressed(name: str) -> None:
    tensor = kv_like(1 << 21, torch.bfloat16)  # planes of 2 MiB: sampled first
    payload, out = round_trip(open_serde(name), tensor, MemoryFormat.KV_2LTD)
    assert torch.equal(out.raw, tensor.view(torch.uint8))
    stored = payload[2]
    assert stored == 0b01  # the low bytes (mantissa noise) kept, the high bytes compressed
    assert len(payload) < 0.9 * tensor.numel() * 2
