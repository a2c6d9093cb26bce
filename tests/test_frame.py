"""Unit tests of kvplug.frame: bit-exact round trips and detection of every kind of damage."""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pytest
import torch

from kvplug.errors import ConfigError, CorruptObject, KvplugError, UnreadableObject
from kvplug.frame import (
    HASH_STEP,
    MAGIC,
    MIN_HEADER_LEN,
    VERSION,
    Buffer,
    FrameReceiver,
    decode_frame,
    decode_header,
    encode_frame,
    encode_header,
    payload_checksum,
    reading_serde,
    verify_payload,
)
from kvplug.keys import CacheKey
from kvplug.memory import DTYPE_CODES, FreeListAllocator, MemoryFormat, MemoryObj
from kvplug.serde import NaiveSerde, get_serde

DTYPES = list(DTYPE_CODES)  # every dtype kvplug can store: fp16, bf16, fp32, fp64, fp8 x2, ints
SHAPES: dict[MemoryFormat, list[tuple[int, ...]]] = {
    MemoryFormat.UNDEFINED: [(3, 5), (0,)],
    MemoryFormat.KV_2LTD: [(2, 4, 1, 16), (2, 3, 17, 8), (2, 2, 0, 8)],
    MemoryFormat.KV_T2D: [(1, 2, 16), (33, 2, 8), (0, 2, 8)],
    MemoryFormat.KV_2TD: [(2, 1, 16), (2, 9, 24), (2, 0, 24)],
    MemoryFormat.BINARY: [(1,), (1000,), (0,)],
    MemoryFormat.BINARY_BUFFER: [(1,), (4097,), (0,)],
    MemoryFormat.KV_MLA_FMT: [(1, 3, 1, 64), (1, 2, 5, 576), (1, 2, 0, 576)],
}
CASES = [(fmt, shape) for fmt, shapes in SHAPES.items() for shape in shapes]


def random_obj(shape: tuple[int, ...], dtype: torch.dtype, fmt: MemoryFormat, seed: int = 0):
    """A host object filled with random bytes (every bit pattern, NaNs included)."""
    rng = np.random.default_rng(seed)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = torch.from_numpy(rng.integers(0, 256, size=nbytes, dtype=np.uint8))
    tensor = raw.view(dtype).reshape(shape) if nbytes else torch.empty(shape, dtype=dtype)
    return MemoryObj.from_tensor(tensor, fmt)


def frame_bytes(obj: MemoryObj, serde: str = "naive") -> bytes:
    header, payload = encode_frame(obj, get_serde(serde))
    return bytes(header) + bytes(payload)


@pytest.fixture
def allocator() -> FreeListAllocator:
    return FreeListAllocator(4 << 20)


@pytest.fixture
def sample() -> tuple[MemoryObj, bytes]:
    obj = random_obj((2, 3, 7, 16), torch.bfloat16, MemoryFormat.KV_2LTD, seed=7)
    return obj, frame_bytes(obj)


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("fmt", "shape"), CASES, ids=[f"{f.name}-{s}" for f, s in CASES])
def test_round_trip_is_bit_exact(
    allocator: FreeListAllocator, dtype: torch.dtype, fmt: MemoryFormat, shape: tuple[int, ...]
) -> None:
    obj = random_obj(shape, dtype, fmt, seed=len(shape) + dtype.itemsize)
    data = frame_bytes(obj)
    out = decode_frame(data, allocator)
    assert out is not None
    try:
        assert out.shape == shape
        assert out.dtype == dtype
        assert out.fmt is fmt
        assert out.nbytes == obj.nbytes
        assert bytes(out.memoryview()) == bytes(obj.memoryview())
        assert out.tensor.shape == shape
        header = decode_header(data)
        assert header.shape == shape and header.dtype == dtype and header.fmt is fmt
        assert header.serde == "naive"
        assert header.payload_len == obj.nbytes
        assert header.frame_len == len(data)
        assert header.nbytes == obj.nbytes
    finally:
        out.release()
    assert allocator.stats().used == 0


def test_round_trip_accepts_bytearray_and_memoryview(
    allocator: FreeListAllocator, sample: tuple[MemoryObj, bytes]
) -> None:
    obj, data = sample
    for buffer in (bytearray(data), memoryview(data), memoryview(bytearray(data))):
        out = decode_frame(buffer, allocator)
        assert out is not None
        assert torch.equal(out.raw, obj.raw)
        out.release()


def test_round_trip_of_decoded_object_re_encodes_identically(
    allocator: FreeListAllocator, sample: tuple[MemoryObj, bytes]
) -> None:
    _, data = sample
    out = decode_frame(data, allocator)
    assert out is not None
    assert frame_bytes(out) == data
    out.release()


def test_header_layout_fields(sample: tuple[MemoryObj, bytes]) -> None:
    obj, data = sample
    magic, version, fmt, code, ndim, serde_len = struct.unpack_from("<4sBBBBB", data)
    assert magic == MAGIC == b"KVPF"
    assert version == VERSION == 1
    assert fmt == int(MemoryFormat.KV_2LTD)
    assert code == DTYPE_CODES[torch.bfloat16]
    assert ndim == 4 and serde_len == len("naive")
    (header_len,) = struct.unpack_from("<I", data, 12)
    payload_len, checksum = struct.unpack_from("<QQ", data, 16)
    assert payload_len == obj.nbytes
    assert checksum == payload_checksum(obj.memoryview())
    assert struct.unpack_from("<4Q", data, 32) == obj.shape
    assert data[64 : 64 + 5] == b"naive"
    assert len(data) == header_len + payload_len


@pytest.mark.parametrize("ndim", range(9))
@pytest.mark.parametrize("serde", ["n", "naive", "x" * 30, "y" * 100, "z" * 255])
def test_header_length_is_a_multiple_of_64(ndim: int, serde: str) -> None:
    shape = (1,) * ndim
    header = encode_header(shape, torch.float16, MemoryFormat.KV_2LTD, serde, b"\x00\x00")
    assert len(header) % 64 == 0
    assert len(header) >= MIN_HEADER_LEN
    parsed = decode_header(header + b"\x00\x00")
    assert parsed.header_len == len(header)
    assert parsed.shape == shape and parsed.serde == serde


def test_too_many_dimensions_cannot_be_encoded() -> None:
    with pytest.raises(CorruptObject, match="at most 8"):
        encode_header((1,) * 9, torch.float16, MemoryFormat.KV_2LTD, "naive", b"\x00\x00")


def test_payload_encode_is_zero_copy() -> None:
    tensor = torch.arange(64, dtype=torch.float32)
    obj = MemoryObj.from_tensor(tensor)
    _, payload = encode_frame(obj)
    view = memoryview(payload)
    assert np.shares_memory(np.frombuffer(view, dtype=np.uint8), tensor.numpy())
    tensor[0] = 123.0
    assert bytes(view[:4]) == struct.pack("<f", 123.0)


def test_payload_encode_is_zero_copy_for_allocator_memory(allocator: FreeListAllocator) -> None:
    obj = allocator.allocate((4, 64), torch.float16)
    assert obj is not None
    obj.tensor.fill_(0)
    _, payload = encode_frame(obj)
    buffer = np.frombuffer(memoryview(payload), dtype=np.uint8)
    assert buffer.ctypes.data == obj.data_ptr()
    obj.tensor[0, 0] = 1.0
    assert bytes(memoryview(payload)[:2]) == struct.pack("<e", 1.0)
    obj.release()


# --------------------------------------------------------------------------- damage


def _header_len(data: bytes) -> int:
    return int(struct.unpack_from("<I", data, 12)[0])


@pytest.mark.parametrize("mask", [0xFF, 0x01, 0x80])
def test_every_header_byte_flip_is_corrupt_object(
    allocator: FreeListAllocator, sample: tuple[MemoryObj, bytes], mask: int
) -> None:
    _, data = sample
    header_len = _header_len(data)
    assert header_len == 128  # ndim 4 and "naive" need a second 64-byte line
    for position in range(header_len):
        damaged = bytearray(data)
        damaged[position] ^= mask
        with pytest.raises(CorruptObject):
            decode_frame(damaged, allocator)
        with pytest.raises(CorruptObject):
            decode_header(damaged)
    assert allocator.stats().used == 0
    assert allocator.memcheck()


def test_every_payload_byte_flip_is_corrupt_object(allocator: FreeListAllocator) -> None:
    obj = random_obj((2, 2, 3, 8), torch.float16, MemoryFormat.KV_2LTD, seed=3)
    data = frame_bytes(obj)
    header_len = _header_len(data)
    for position in range(header_len, len(data)):
        for mask in (0x01, 0xFF):
            damaged = bytearray(data)
            damaged[position] ^= mask
            with pytest.raises(CorruptObject, match="payload checksum"):
                decode_frame(damaged, allocator)
    assert allocator.stats().used == 0


def test_large_payload_byte_flips_are_corrupt_object(allocator: FreeListAllocator) -> None:
    obj = random_obj((2, 4, 64, 256), torch.float16, MemoryFormat.KV_2LTD, seed=5)
    data = frame_bytes(obj)
    header_len = _header_len(data)
    rng = np.random.default_rng(0)
    positions = [header_len, len(data) - 1, *rng.integers(header_len, len(data), 50).tolist()]
    for position in positions:
        damaged = bytearray(data)
        damaged[position] ^= 0x10
        with pytest.raises(CorruptObject):
            decode_frame(damaged, allocator)
    assert allocator.stats().used == 0


def test_truncation_at_every_length_is_corrupt_object(allocator: FreeListAllocator) -> None:
    obj = random_obj((2, 2, 5, 8), torch.float32, MemoryFormat.KV_2LTD, seed=11)
    data = frame_bytes(obj)
    for length in range(len(data)):
        with pytest.raises(CorruptObject):
            decode_frame(data[:length], allocator)
    assert allocator.stats().used == 0


def test_truncation_of_a_large_frame_is_corrupt_object(allocator: FreeListAllocator) -> None:
    obj = random_obj((2, 4, 64, 256), torch.float16, MemoryFormat.KV_2LTD, seed=13)
    data = frame_bytes(obj)
    lengths = {*range(0, 300), *range(len(data) - 300, len(data)), *range(0, len(data), 997)}
    for length in sorted(lengths):
        with pytest.raises(CorruptObject):
            decode_frame(memoryview(data)[:length], allocator)
    assert allocator.stats().used == 0


@pytest.mark.parametrize("extra", [b"\x00", b"KVPF", bytes(64), bytes(4096)])
def test_trailing_bytes_are_corrupt_object(
    allocator: FreeListAllocator, sample: tuple[MemoryObj, bytes], extra: bytes
) -> None:
    _, data = sample
    with pytest.raises(CorruptObject, match="its header says"):
        decode_frame(data + extra, allocator)
    assert allocator.stats().used == 0


def test_two_frames_back_to_back_are_corrupt_object(
    allocator: FreeListAllocator, sample: tuple[MemoryObj, bytes]
) -> None:
    _, data = sample
    with pytest.raises(CorruptObject):
        decode_frame(data + data, allocator)


def test_empty_and_garbage_input_is_corrupt_object(allocator: FreeListAllocator) -> None:
    for data in (b"", b"KVPF", bytes(64), bytes(1024), b"\xff" * 200, b"KVPF" + bytes(124)):
        with pytest.raises(CorruptObject):
            decode_frame(data, allocator)


def _frame_with_header_fields(obj: MemoryObj, **fields: int) -> bytes:
    """A frame whose header fields are replaced and whose header checksum is recomputed, so
    that only the semantic checks can reject it."""
    import xxhash

    header, payload = encode_frame(obj)
    body = bytearray(header[:-4])
    offsets = {"version": 4, "fmt": 5, "dtype": 6, "ndim": 7}
    for name, value in fields.items():
        body[offsets[name]] = value
    header = bytes(body) + struct.pack("<I", xxhash.xxh32_intdigest(bytes(body)))
    return header + bytes(payload)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"version": 2}, "version 2"),
        ({"version": 0}, "version 0"),
        ({"dtype": 0}, "unknown dtype code 0"),
        ({"dtype": 200}, "unknown dtype code 200"),
        ({"fmt": 7}, "unknown memory format 7"),
        ({"fmt": 255}, "unknown memory format 255"),
    ],
)
def test_checksummed_but_unknown_header_values_are_corrupt_object(
    allocator: FreeListAllocator, fields: dict[str, int], message: str
) -> None:
    obj = random_obj((4, 8), torch.float16, MemoryFormat.KV_2TD)
    with pytest.raises(CorruptObject, match=message):
        decode_frame(_frame_with_header_fields(obj, **fields), allocator)
    assert allocator.stats().used == 0


def test_dtype_code_1_decodes_as_float16(allocator: FreeListAllocator) -> None:
    obj = random_obj((4, 8), torch.float16, MemoryFormat.KV_2TD)
    out = decode_frame(_frame_with_header_fields(obj, dtype=1), allocator)
    assert out is not None
    assert out.dtype == torch.float16
    assert torch.equal(out.raw, obj.raw)
    out.release()


def test_payload_length_not_matching_shape_is_corrupt_object_and_leaks_nothing(
    allocator: FreeListAllocator,
) -> None:
    payload = bytes(range(100))
    header = encode_header((4, 8), torch.float16, MemoryFormat.KV_2TD, "naive", payload)
    with pytest.raises(CorruptObject, match="naive payload has 100 bytes"):
        decode_frame(header + payload, allocator)
    assert allocator.stats().used == 0
    assert allocator.stats().object_count == 0


def test_unknown_serde_in_valid_header_is_a_clean_error(allocator: FreeListAllocator) -> None:
    payload = bytes(64)
    header = encode_header((4, 8), torch.float16, MemoryFormat.KV_2TD, "nope", payload)
    assert decode_header(header + payload).serde == "nope"
    with pytest.raises((ConfigError, CorruptObject)) as info:
        decode_frame(header + payload, allocator)
    assert isinstance(info.value, KvplugError)
    assert not isinstance(info.value, KeyError)
    assert "'nope'" in str(info.value)
    assert allocator.stats().used == 0


def test_verify_payload_checks_length_and_checksum(sample: tuple[MemoryObj, bytes]) -> None:
    _, data = sample
    header = decode_header(data)
    payload = data[header.header_len :]
    verify_payload(header, payload)
    with pytest.raises(CorruptObject, match="truncated"):
        verify_payload(header, payload[:-1])
    with pytest.raises(CorruptObject, match="checksum"):
        verify_payload(header, bytes([payload[0] ^ 1]) + payload[1:])


def test_decode_header_ignores_the_payload(sample: tuple[MemoryObj, bytes]) -> None:
    obj, data = sample
    header_len = _header_len(data)
    header = decode_header(data[:header_len])
    assert header.shape == obj.shape
    assert header.payload_len == obj.nbytes


# --------------------------------------------------------------------------- allocation


def test_decode_into_full_allocator_returns_none_and_leaks_nothing(
    sample: tuple[MemoryObj, bytes],
) -> None:
    _, data = sample
    allocator = FreeListAllocator(4 * 4096)
    blocker = allocator.allocate((4 * 4096,), torch.uint8)
    assert blocker is not None
    before = allocator.stats()
    assert decode_frame(data, allocator) is None
    assert allocator.stats() == dataclasses.replace(before, shortages=before.shortages + 1)
    blocker.release()
    assert allocator.stats().used == 0
    out = decode_frame(data, allocator)
    assert out is not None
    out.release()
    assert allocator.stats().used == 0
    assert allocator.memcheck()


def test_corrupt_frame_into_full_allocator_still_raises(sample: tuple[MemoryObj, bytes]) -> None:
    _, data = sample
    allocator = FreeListAllocator(4096)
    blocker = allocator.allocate((4096,), torch.uint8)
    assert blocker is not None
    damaged = bytearray(data)
    damaged[-1] ^= 1
    with pytest.raises(CorruptObject):
        decode_frame(damaged, allocator)
    blocker.release()


# -- FrameReceiver: a frame received in pieces straight into its final memory ------------------


def _received(
    value: bytes, receiver: FrameReceiver, piece: int, report_until: int = 0
) -> MemoryObj | None:
    """Feed ``value`` to ``receiver`` as a transport would, ``piece`` bytes at a time, telling
    it of every piece that ends at or before ``report_until`` bytes of the payload."""
    receiver.start(len(value))
    size = receiver.header_len(value[:MIN_HEADER_LEN])
    sink = receiver.take_header(value[:size])
    rest = value[size:]
    assert len(rest) == receiver.remaining
    if sink is not None:
        for start in range(0, len(rest), piece):
            sink[start : start + piece] = rest[start : start + piece]
            end = min(start + piece, len(rest))
            if end <= report_until:
                receiver.received(end)
    return receiver.finish()


@pytest.mark.parametrize("piece", [1, 13, 1 << 20])
def test_receiver_puts_the_payload_in_the_callers_memory_without_a_copy(piece: int) -> None:
    obj = random_obj((2, 3, 17, 8), torch.bfloat16, MemoryFormat.KV_2LTD, seed=3)
    value = b"".join(encode_frame(obj))
    allocator = FreeListAllocator(1 << 20)
    dest = allocator.allocate(obj.shape, obj.dtype, obj.fmt)
    receiver = FrameReceiver(allocator, into=dest)
    got = _received(value, receiver, piece)
    assert got is dest and torch.equal(dest.raw, obj.raw)
    assert allocator.stats().object_count == 1  # only dest: nothing allocated for the read
    got.release()
    dest.release()


def test_receiver_allocates_from_the_header_when_there_is_no_destination() -> None:
    obj = random_obj((33, 2, 8), torch.float8_e4m3fn, MemoryFormat.KV_T2D, seed=4)
    allocator = FreeListAllocator(1 << 20)
    got = _received(b"".join(encode_frame(obj)), FrameReceiver(allocator), 100)
    assert got is not None
    assert (got.shape, got.dtype, got.fmt) == (obj.shape, obj.dtype, obj.fmt)
    assert torch.equal(got.raw, obj.raw)
    got.release()


def test_receiver_reads_a_value_of_another_size_than_the_callers_as_a_miss() -> None:
    obj = random_obj((4, 8), torch.float16, MemoryFormat.KV_2LTD)
    allocator = FreeListAllocator(1 << 20)
    dest = allocator.allocate((4, 4), torch.float16, MemoryFormat.KV_2LTD)
    assert _received(b"".join(encode_frame(obj)), FrameReceiver(allocator, into=dest), 5) is None
    assert dest.ref_count == 1
    dest.release()


def test_receiver_reads_as_a_miss_when_the_allocator_is_full() -> None:
    obj = random_obj((64, 64), torch.float32, MemoryFormat.KV_2LTD)
    allocator = FreeListAllocator(4096)
    assert _received(b"".join(encode_frame(obj)), FrameReceiver(allocator), 4096) is None
    assert allocator.stats().used == 0


@pytest.mark.parametrize("damage", ["payload-bit", "header-bit", "truncated", "extended"])
def test_receiver_reports_damage_after_draining_the_value(damage: str) -> None:
    obj = random_obj((2, 4, 1, 16), torch.float16, MemoryFormat.KV_2LTD)
    value = bytearray(b"".join(encode_frame(obj)))
    if damage == "payload-bit":
        value[-1] ^= 1
    elif damage == "header-bit":
        value[20] ^= 1
    elif damage == "truncated":
        del value[-10:]
    else:
        value += b"\0" * 64
    allocator = FreeListAllocator(1 << 20)
    receiver = FrameReceiver(allocator)
    with pytest.raises(CorruptObject):
        _received(bytes(value), receiver, 7)
    assert allocator.stats().used == 0


def test_receiver_decodes_other_serdes_from_a_scratch_buffer() -> None:
    class Xor(NaiveSerde):
        name = "test-xor"

        def encode(self, obj: MemoryObj, key: CacheKey | None = None) -> bytes:
            return bytes(b ^ 0x5A for b in obj.memoryview())

        def decode(self, payload: Buffer, obj: MemoryObj, key: CacheKey | None = None) -> None:
            obj.memoryview()[:] = bytes(b ^ 0x5A for b in memoryview(payload))

    obj = random_obj((4, 8), torch.float16, MemoryFormat.KV_2LTD, seed=9)
    value = b"".join(encode_frame(obj, Xor()))
    allocator = FreeListAllocator(1 << 20)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("kvplug.frame.get_serde", lambda name: Xor())
        dest = allocator.allocate(obj.shape, obj.dtype, obj.fmt)
        got = _received(value, FrameReceiver(allocator, into=dest), 3)
    assert got is not None and got is not dest and torch.equal(got.raw, obj.raw)
    got.release()
    dest.release()


def test_an_abandoned_receiver_releases_what_it_received_into() -> None:
    obj = random_obj((4, 8), torch.float16, MemoryFormat.KV_2LTD)
    value = b"".join(encode_frame(obj))
    allocator = FreeListAllocator(1 << 20)
    receiver = FrameReceiver(allocator)
    receiver.start(len(value))
    assert receiver.take_header(value[: receiver.header_len(value)]) is not None
    assert allocator.stats().object_count == 1
    receiver.abandon()
    assert allocator.stats().used == 0


def _hashed_whole(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Sizes of the payloads that :func:`payload_checksum` hashed whole, from now on."""
    sizes: list[int] = []

    def counting(payload: Buffer) -> int:
        sizes.append(memoryview(payload).nbytes)
        return payload_checksum(payload)

    monkeypatch.setattr("kvplug.frame.payload_checksum", counting)
    return sizes


@pytest.mark.parametrize("piece", [4096, 65536, HASH_STEP + 1])
def test_a_receiver_told_of_every_piece_hashes_as_they_arrive_and_finish_only_compares(
    piece: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    obj = random_obj((3, 1 << 20), torch.uint8, MemoryFormat.KV_2LTD, seed=11)
    value = b"".join(encode_frame(obj))
    allocator = FreeListAllocator(8 << 20)
    whole = _hashed_whole(monkeypatch)
    got = _received(value, FrameReceiver(allocator), piece, report_until=len(value))
    assert got is not None and torch.equal(got.raw, obj.raw)
    assert whole == []  # the checksum was streamed, not computed again at the end
    got.release()
    damaged = bytearray(value)
    damaged[len(value) // 2] ^= 1  # a byte in a piece hashed long before the end
    with pytest.raises(CorruptObject, match="checksum mismatch"):
        _received(bytes(damaged), FrameReceiver(allocator), piece, report_until=len(value))
    assert allocator.stats().used == 0


def test_a_receiver_told_of_only_some_pieces_hashes_the_whole_payload_at_the_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    obj = random_obj((3, 1 << 20), torch.uint8, MemoryFormat.KV_2LTD, seed=12)
    value = b"".join(encode_frame(obj))
    allocator = FreeListAllocator(8 << 20)
    whole = _hashed_whole(monkeypatch)
    got = _received(value, FrameReceiver(allocator), 65536, report_until=len(value) // 2)
    assert got is not None and torch.equal(got.raw, obj.raw)
    assert whole == [obj.nbytes]
    got.release()
    damaged = bytearray(value)
    damaged[-1] ^= 1  # in the part it was never told of
    with pytest.raises(CorruptObject, match="checksum mismatch"):
        _received(bytes(damaged), FrameReceiver(allocator), 65536, report_until=len(value) // 2)
    assert allocator.stats().used == 0


def test_received_refuses_an_end_that_goes_back_or_past_the_payload() -> None:
    obj = random_obj((2, HASH_STEP), torch.uint8, MemoryFormat.KV_2LTD)
    value = b"".join(encode_frame(obj))
    receiver = FrameReceiver(FreeListAllocator(4 << 20))
    receiver.start(len(value))
    assert receiver.take_header(value[: receiver.header_len(value)]) is not None
    receiver.received(HASH_STEP + 5)
    with pytest.raises(ValueError, match="must grow and stay within the payload"):
        receiver.received(HASH_STEP)
    with pytest.raises(ValueError, match="must grow and stay within the payload"):
        receiver.received(receiver.remaining + 1)
    receiver.abandon()


def test_an_abandoned_receiver_hashes_afresh_when_received_again() -> None:
    obj = random_obj((3, HASH_STEP), torch.uint8, MemoryFormat.KV_2LTD, seed=13)
    value = b"".join(encode_frame(obj))
    allocator = FreeListAllocator(8 << 20)
    receiver = FrameReceiver(allocator)
    receiver.start(len(value))
    size = receiver.header_len(value)
    sink = receiver.take_header(value[:size])
    assert sink is not None
    sink[:HASH_STEP] = b"\xff" * HASH_STEP  # other bytes, hashed, then the read is sent again
    receiver.received(HASH_STEP)
    receiver.abandon()
    got = _received(value, receiver, 4096, report_until=len(value))
    assert got is not None and torch.equal(got.raw, obj.raw)
    got.release()
    assert allocator.stats().used == 0


class _Sealed(NaiveSerde):
    """A stand-in for an authenticated serde: it takes an option, binds the key, and reads only
    its own frames (the real one, aesgcm, is tested in plugins/aesgcm)."""

    name = "test-sealed"
    authenticated = True

    def __init__(self, secret: int = 0x33) -> None:
        self.secret = secret

    def encode(self, obj: MemoryObj, key: CacheKey | None = None) -> bytes:
        assert key is not None
        return bytes([self.secret, key.chunk_hash & 0xFF]) + bytes(obj.memoryview())

    def decode(self, payload: Buffer, obj: MemoryObj, key: CacheKey | None = None) -> None:
        view = memoryview(payload)
        if key is None or bytes(view[:2]) != bytes([self.secret, key.chunk_hash & 0xFF]):
            raise CorruptObject("sealed for another key")
        obj.memoryview()[:] = view[2:]


def test_the_key_reaches_the_serde_on_both_sides_through_the_receiver() -> None:
    obj = random_obj((4, 8), torch.float16, MemoryFormat.KV_2LTD, seed=10)
    key, other = CacheKey("m", 1, 0, 7), CacheKey("m", 1, 0, 8)
    sealed = _Sealed()
    value = b"".join(encode_frame(obj, sealed, key))
    allocator = FreeListAllocator(1 << 20)
    got = _received(value, FrameReceiver(allocator, serde=sealed, key=key), 3)
    assert got is not None and torch.equal(got.raw, obj.raw)
    got.release()
    with pytest.raises(CorruptObject, match="another key"):
        _received(value, FrameReceiver(allocator, serde=sealed, key=other), 3)
    assert allocator.stats().object_count == 0


def test_an_authenticated_serde_reads_no_frame_of_another_serde() -> None:
    obj = random_obj((4, 8), torch.float16, MemoryFormat.KV_2LTD, seed=11)
    plain = b"".join(encode_frame(obj))
    allocator = FreeListAllocator(1 << 20)
    with pytest.raises(CorruptObject, match="only frames it wrote"):
        _received(plain, FrameReceiver(allocator, serde=_Sealed()), 3)
    with pytest.raises(CorruptObject, match="only frames it wrote"):
        decode_frame(plain, allocator, serde=_Sealed())
    assert reading_serde("naive", None).name == "naive"


def test_a_frame_of_a_serde_not_here_is_unreadable_not_damage() -> None:
    obj = random_obj((4, 8), torch.float16, MemoryFormat.KV_2LTD, seed=12)
    value = b"".join(encode_frame(obj, _Sealed(), CacheKey("m", 1, 0, 7)))
    with pytest.raises(UnreadableObject, match=r"test-sealed.*cannot decode"):
        decode_frame(value, FreeListAllocator(1 << 20))
