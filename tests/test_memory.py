"""Unit tests of kvplug.memory: MemoryFormat, MemoryObj and FreeListAllocator."""

from __future__ import annotations

import dataclasses
import itertools
import random
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)

from kvplug.errors import ConfigError, RefCountError
from kvplug.memory import (
    DEFAULT_ALIGNMENT,
    DTYPE_CODES,
    DTYPES_BY_CODE,
    FreeListAllocator,
    MemoryFormat,
    MemoryObj,
    dtype_code,
    nbytes_of,
)
from kvplug.units import host_memory, parse_gib, parse_size

PAGE = DEFAULT_ALIGNMENT
U8 = torch.uint8
ALL_DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.uint8,
]


def pages(n: int) -> tuple[int]:
    """A uint8 shape of exactly ``n`` pages."""
    return (n * PAGE,)


def live_used(objs: list[MemoryObj]) -> int:
    return sum(o.phy_size for o in objs)


# --------------------------------------------------------------------------- MemoryFormat


def test_memory_format_codes_match_lmcache() -> None:
    assert {f.name: int(f) for f in MemoryFormat} == {
        "UNDEFINED": 0,
        "KV_2LTD": 1,
        "KV_T2D": 2,
        "KV_2TD": 3,
        "BINARY": 4,
        "BINARY_BUFFER": 5,
        "KV_MLA_FMT": 6,
    }


def test_memory_format_token_dim() -> None:
    assert MemoryFormat.KV_2LTD.token_dim == 2
    assert MemoryFormat.KV_T2D.token_dim == 0
    assert MemoryFormat.KV_2TD.token_dim == 1
    assert MemoryFormat.KV_MLA_FMT.token_dim == 2
    assert MemoryFormat.BINARY.token_dim is None
    assert MemoryFormat.BINARY_BUFFER.token_dim is None


def test_dtype_codes_round_trip_and_fp16_alias() -> None:
    for dtype, code in DTYPE_CODES.items():
        assert DTYPES_BY_CODE[code] == dtype
        assert dtype_code(dtype) == code
    assert DTYPES_BY_CODE[1] == torch.float16


def test_dtype_code_of_unsupported_dtype_is_config_error() -> None:
    with pytest.raises(ConfigError, match="complex64"):
        dtype_code(torch.complex64)


def test_nbytes_of_negative_dimension_is_config_error() -> None:
    assert nbytes_of((2, 3), torch.float32) == 24
    assert nbytes_of((0, 3), torch.float32) == 0
    with pytest.raises(ConfigError, match="negative"):
        nbytes_of((2, -1), torch.float32)


# --------------------------------------------------------------------------- allocator basics


def test_allocator_rejects_bad_configuration() -> None:
    with pytest.raises(ConfigError):
        FreeListAllocator(0)
    with pytest.raises(ConfigError):
        FreeListAllocator(-PAGE)
    with pytest.raises(ConfigError):
        FreeListAllocator(PAGE - 1)  # rounds down to zero
    with pytest.raises(ConfigError, match="power of two"):
        FreeListAllocator(1 << 20, alignment=3000)
    with pytest.raises(ConfigError, match="power of two"):
        FreeListAllocator(1 << 20, alignment=0)


def test_capacity_rounds_down_to_alignment() -> None:
    allocator = FreeListAllocator(10 * PAGE + 100)
    assert allocator.capacity == 10 * PAGE
    assert allocator.stats().capacity == 10 * PAGE
    assert allocator.free_blocks() == [(0, 10 * PAGE)]


def test_every_offset_and_data_ptr_is_4096_aligned_by_default() -> None:
    allocator = FreeListAllocator(1 << 22)
    assert allocator.alignment == 4096
    assert allocator.buffer.data_ptr() % 4096 == 0
    rng = random.Random(1)
    objs = []
    for _ in range(60):
        obj = allocator.allocate((rng.randint(0, 20000),), U8)
        assert obj is not None
        objs.append(obj)
    for obj in objs:
        assert obj.offset % 4096 == 0
        assert obj.data_ptr() % 4096 == 0 or obj.nbytes == 0
        assert obj.phy_size % 4096 == 0
        assert obj.phy_size >= max(obj.nbytes, 4096)
    for obj in objs:
        obj.release()
    assert allocator.stats().used == 0


@pytest.mark.parametrize("alignment", [64, 512, 1 << 16])
def test_custom_alignment(alignment: int) -> None:
    allocator = FreeListAllocator(64 * alignment, alignment=alignment)
    assert allocator.stats().alignment == alignment
    objs = [allocator.allocate((n,), U8) for n in (1, alignment, alignment + 1, 3 * alignment - 1)]
    assert all(o is not None for o in objs)
    for obj in objs:
        assert obj is not None
        assert obj.offset % alignment == 0
        assert obj.data_ptr() % alignment == 0
        assert obj.phy_size == max(alignment, -(-obj.nbytes // alignment) * alignment)
    assert [o.offset for o in objs if o is not None] == [
        0,
        alignment,
        2 * alignment,
        4 * alignment,
    ]


def test_zero_byte_allocation_takes_one_aligned_block() -> None:
    allocator = FreeListAllocator(4 * PAGE)
    obj = allocator.allocate((2, 0, 8), torch.float16)
    assert obj is not None
    assert obj.nbytes == 0
    assert obj.phy_size == PAGE
    assert obj.tensor.shape == (2, 0, 8)
    assert allocator.stats().used == PAGE
    obj.release()
    assert allocator.stats().used == 0


def test_first_fit_takes_the_lowest_block_that_fits() -> None:
    allocator = FreeListAllocator(16 * PAGE)
    a = allocator.allocate(pages(1), U8)
    b = allocator.allocate(pages(1), U8)
    c = allocator.allocate(pages(3), U8)
    d = allocator.allocate(pages(1), U8)
    assert a and b and c and d
    a_off, c_off = a.offset, c.offset
    a.release()
    c.release()
    # Two pages do not fit A's one-page hole; C's hole is the first that fits (not the larger tail).
    two = allocator.allocate(pages(2), U8)
    assert two is not None and two.offset == c_off
    # One page goes to A's hole, the lowest address, although C's leftover fits too.
    one = allocator.allocate(pages(1), U8)
    assert one is not None and one.offset == a_off
    one2 = allocator.allocate(pages(1), U8)
    assert one2 is not None and one2.offset == c_off + 2 * PAGE
    assert allocator.memcheck()


def test_exact_fit_leaves_no_zero_size_block() -> None:
    allocator = FreeListAllocator(8 * PAGE)
    a = allocator.allocate(pages(2), U8)
    b = allocator.allocate(pages(1), U8)
    assert a and b
    a.release()
    assert allocator.free_blocks() == [(0, 2 * PAGE), (3 * PAGE, 5 * PAGE)]
    again = allocator.allocate(pages(2), U8)
    assert again is not None and again.offset == 0
    assert allocator.free_blocks() == [(3 * PAGE, 5 * PAGE)]
    rest = allocator.allocate(pages(5), U8)
    assert rest is not None
    assert allocator.free_blocks() == []
    assert allocator.stats().free_block_count == 0
    assert allocator.stats().largest_free_block == 0
    assert allocator.memcheck()


def _five_in_a_row() -> tuple[FreeListAllocator, list[MemoryObj]]:
    allocator = FreeListAllocator(5 * PAGE)
    objs = [allocator.allocate(pages(1), U8) for _ in range(5)]
    assert all(o is not None for o in objs)
    return allocator, [o for o in objs if o is not None]


def test_free_coalesces_with_left_neighbour() -> None:
    allocator, objs = _five_in_a_row()
    objs[1].release()
    objs[2].release()
    assert allocator.free_blocks() == [(1 * PAGE, 2 * PAGE)]
    assert allocator.memcheck()


def test_free_coalesces_with_right_neighbour() -> None:
    allocator, objs = _five_in_a_row()
    objs[2].release()
    objs[1].release()
    assert allocator.free_blocks() == [(1 * PAGE, 2 * PAGE)]
    assert allocator.memcheck()


def test_free_coalesces_with_both_neighbours() -> None:
    allocator, objs = _five_in_a_row()
    objs[1].release()
    objs[3].release()
    assert allocator.free_blocks() == [(1 * PAGE, PAGE), (3 * PAGE, PAGE)]
    objs[2].release()
    assert allocator.free_blocks() == [(1 * PAGE, 3 * PAGE)]
    assert allocator.stats().free_block_count == 1
    objs[0].release()
    objs[4].release()
    assert allocator.free_blocks() == [(0, 5 * PAGE)]
    assert allocator.memcheck()


def test_free_without_neighbours_inserts_in_address_order() -> None:
    allocator, objs = _five_in_a_row()
    objs[3].release()
    objs[1].release()
    assert allocator.free_blocks() == [(1 * PAGE, PAGE), (3 * PAGE, PAGE)]
    assert allocator.memcheck()


def test_out_of_memory_returns_none_and_changes_nothing() -> None:
    allocator = FreeListAllocator(4 * PAGE)
    assert allocator.allocate(pages(5), U8) is None
    assert allocator.allocate((1 << 40,), torch.float32) is None
    a = allocator.allocate(pages(3), U8)
    assert a is not None
    before = allocator.stats()
    assert allocator.allocate(pages(2), U8) is None
    assert allocator.stats() == dataclasses.replace(before, shortages=before.shortages + 1)
    last = allocator.allocate(pages(1), U8)
    assert last is not None
    assert allocator.allocate((1,), U8) is None
    assert allocator.allocate((0,), U8) is None
    assert allocator.memcheck()


def test_fragmented_allocator_returns_none_although_total_free_suffices() -> None:
    allocator, objs = _five_in_a_row()
    objs[1].release()
    objs[3].release()
    assert allocator.stats().free == 2 * PAGE
    assert allocator.stats().largest_free_block == PAGE
    assert allocator.allocate(pages(2), U8) is None


def test_stats_track_capacity_used_largest_block_and_objects() -> None:
    allocator = FreeListAllocator(10 * PAGE)
    s = allocator.stats()
    assert (s.capacity, s.used, s.largest_free_block, s.object_count, s.free_block_count) == (
        10 * PAGE,
        0,
        10 * PAGE,
        0,
        1,
    )
    assert s.free == 10 * PAGE
    a = allocator.allocate((PAGE + 1,), U8)  # two pages
    b = allocator.allocate((10,), torch.float16)  # one page
    assert a and b
    s = allocator.stats()
    assert s.used == 3 * PAGE
    assert s.free == 7 * PAGE
    assert s.object_count == 2
    assert s.largest_free_block == 7 * PAGE
    a.release()
    s = allocator.stats()
    assert (s.used, s.object_count, s.free_block_count, s.largest_free_block) == (
        PAGE,
        1,
        2,
        7 * PAGE,
    )
    b.release()
    assert allocator.stats().used == 0
    assert allocator.stats().object_count == 0
    assert "used=0" in repr(allocator)


def test_memcheck_detects_a_corrupted_free_list() -> None:
    allocator = FreeListAllocator(8 * PAGE)
    assert allocator.memcheck()
    a = allocator.allocate(pages(1), U8)
    b = allocator.allocate(pages(1), U8)
    assert a and b
    a.release()
    assert allocator.free_blocks() == [(0, PAGE), (2 * PAGE, 6 * PAGE)]
    assert allocator.memcheck()
    allocator._used += PAGE  # bookkeeping no longer adds up
    assert not allocator.memcheck()
    allocator._used -= PAGE
    assert allocator.memcheck()
    allocator._free_starts[1] = PAGE  # same total, but two free blocks now touch
    assert not allocator.memcheck()


def test_batched_allocate_is_all_or_nothing() -> None:
    allocator = FreeListAllocator(10 * PAGE)
    blocker = allocator.allocate(pages(3), U8)
    assert blocker is not None
    before = allocator.stats()
    assert allocator.batched_allocate(pages(1), U8, 8) is None
    assert allocator.stats() == dataclasses.replace(before, shortages=1)
    assert allocator.memcheck()
    objs = allocator.batched_allocate((16, 64), torch.float32, 7, MemoryFormat.KV_2TD)
    assert objs is not None and len(objs) == 7
    assert all(o.fmt is MemoryFormat.KV_2TD and o.shape == (16, 64) for o in objs)
    assert len({o.offset for o in objs}) == 7
    assert allocator.stats().used == 10 * PAGE
    for o in objs:
        o.release()
    blocker.release()
    assert allocator.stats().used == 0
    assert allocator.batched_allocate(pages(1), U8, 0) == []


def test_buffer_written_through_objects_is_the_allocator_buffer() -> None:
    allocator = FreeListAllocator(4 * PAGE)
    obj = allocator.allocate((PAGE,), U8)
    assert obj is not None
    obj.tensor.fill_(0xAB)
    assert int(allocator.buffer[obj.offset]) == 0xAB
    assert obj.raw.data_ptr() == allocator.buffer.data_ptr() + obj.offset
    assert obj.allocator is allocator


# --------------------------------------------------------------------------- property test


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate/free/retain/pin sequences against the invariants of a free list."""

    objects = Bundle("objects")

    @initialize(alignment=st.sampled_from([64, 512, 4096]))
    def setup(self, alignment: int) -> None:
        self.alignment = alignment
        self.allocator = FreeListAllocator(48 * alignment, alignment=alignment)
        self.live: dict[int, MemoryObj] = {}
        self.patterns: dict[int, int] = {}
        self.counter = 0

    @rule(
        target=objects,
        nbytes=st.integers(min_value=0, max_value=12 * 4096),
        dtype=st.sampled_from([torch.uint8, torch.float16, torch.float32]),
    )
    def allocate(self, nbytes: int, dtype: torch.dtype) -> int:
        shape = (nbytes // dtype.itemsize,)
        obj = self.allocator.allocate(shape, dtype)
        self.counter += 1
        if obj is None:
            need = max(
                self.alignment, -(-nbytes_of(shape, dtype) // self.alignment) * self.alignment
            )
            assert self.allocator.stats().largest_free_block < need
            return -1
        pattern = self.counter % 251 + 1
        obj.raw.fill_(pattern)
        self.live[self.counter] = obj
        self.patterns[self.counter] = pattern
        return self.counter

    @rule(ident=consumes(objects))
    def free(self, ident: int) -> None:
        if ident not in self.live:  # failed allocation, or already gone through free_all
            return
        obj = self.live.pop(ident)
        del self.patterns[ident]
        obj.release()
        assert not obj.is_valid

    @rule(ident=objects)
    def retain_release_pin_unpin_keeps_object(self, ident: int) -> None:
        if ident not in self.live:
            return
        obj = self.live[ident]
        obj.retain()
        obj.pin()
        obj.release()
        obj.unpin()
        assert obj.is_valid and obj.ref_count == 1 and obj.pin_count == 0

    @rule()
    def free_all(self) -> None:
        for obj in self.live.values():
            obj.release()
        self.live.clear()
        self.patterns.clear()
        assert self.allocator.free_blocks() == [(0, self.allocator.capacity)]

    @invariant()
    def consistent(self) -> None:
        allocator = self.allocator
        assert allocator.memcheck()
        stats = allocator.stats()
        assert stats.used == sum(o.phy_size for o in self.live.values())
        assert stats.object_count == len(self.live)
        spans = sorted((o.offset, o.offset + o.phy_size) for o in self.live.values())
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert end <= start, "live objects overlap"
        free = allocator.free_blocks()
        assert all(size > 0 for _, size in free)
        for (a, sa), (b, _) in itertools.pairwise(free):
            assert a + sa < b, "free blocks adjacent or overlapping"
        for o in self.live.values():
            assert o.offset % self.alignment == 0
            for fs, fsize in free:
                assert o.offset + o.phy_size <= fs or fs + fsize <= o.offset
        for ident, obj in self.live.items():
            if obj.nbytes:
                raw = obj.raw
                assert int(raw.min()) == int(raw.max()) == self.patterns[ident]

    def teardown(self) -> None:
        if not hasattr(self, "allocator"):
            return
        for obj in self.live.values():
            obj.release()
        assert self.allocator.free_blocks() == [(0, self.allocator.capacity)]
        assert self.allocator.stats().used == 0


AllocatorMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None
)
TestAllocatorMachine = AllocatorMachine.TestCase


# --------------------------------------------------------------------------- concurrency


def test_concurrent_allocate_and_free_from_many_threads() -> None:
    allocator = FreeListAllocator(256 * PAGE)
    errors: list[BaseException] = []
    memcheck_failures: list[int] = []
    stop = threading.Event()
    start = threading.Barrier(17)

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        held: list[tuple[MemoryObj, int]] = []
        try:
            start.wait()
            for step in range(200):
                if held and (rng.random() < 0.45 or len(held) > 6):
                    obj, pattern = held.pop(rng.randrange(len(held)))
                    assert int(obj.raw.min()) == int(obj.raw.max()) == pattern
                    obj.release()
                else:
                    obj = allocator.allocate((rng.randint(1, 3 * PAGE),), U8)
                    if obj is not None:
                        pattern = (seed * 7 + step) % 255 + 1
                        obj.raw.fill_(pattern)
                        held.append((obj, pattern))
            for obj, pattern in held:
                assert int(obj.raw.min()) == int(obj.raw.max()) == pattern
                obj.release()
        except BaseException as exc:  # reported in the main thread
            errors.append(exc)

    def checker() -> None:
        start.wait()
        while not stop.is_set():
            if not allocator.memcheck():
                memcheck_failures.append(1)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    check = threading.Thread(target=checker)
    check.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    check.join()
    assert errors == []
    assert memcheck_failures == []
    assert allocator.memcheck()
    stats = allocator.stats()
    assert stats.used == 0
    assert stats.object_count == 0
    assert allocator.free_blocks() == [(0, allocator.capacity)]


def test_concurrent_retain_release_of_one_object_frees_exactly_once() -> None:
    allocator = FreeListAllocator(4 * PAGE)
    obj = allocator.allocate(pages(1), U8)
    assert obj is not None
    for _ in range(8 * 500):
        obj.retain()

    def drop() -> None:
        for _ in range(500):
            obj.release()

    threads = [threading.Thread(target=drop) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert obj.ref_count == 1 and obj.is_valid
    obj.release()
    assert allocator.stats().used == 0
    assert allocator.stats().object_count == 0


# --------------------------------------------------------------------------- MemoryObj


@pytest.fixture
def allocator() -> FreeListAllocator:
    return FreeListAllocator(64 * PAGE)


def test_release_at_zero_frees_to_allocator(allocator: FreeListAllocator) -> None:
    obj = allocator.allocate((4, 8), torch.float16)
    assert obj is not None
    assert obj.ref_count == 1 and obj.pin_count == 0 and obj.is_valid
    assert obj.retain() is obj
    assert obj.ref_count == 2
    obj.release()
    assert obj.is_valid
    assert allocator.stats().used == PAGE
    obj.release()
    assert not obj.is_valid
    assert obj.ref_count == 0
    assert allocator.stats().used == 0
    assert "freed" in repr(obj)


def test_double_release_raises_and_does_not_corrupt_stats(allocator: FreeListAllocator) -> None:
    obj = allocator.allocate((16,), U8)
    other = allocator.allocate((16,), U8)
    assert obj and other
    obj.release()
    before = allocator.stats()
    blocks = allocator.free_blocks()
    with pytest.raises(RefCountError, match="released more often"):
        obj.release()
    assert allocator.stats() == before
    assert allocator.free_blocks() == blocks
    assert allocator.memcheck()
    # the freed block is handed out once, not twice
    a = allocator.allocate((16,), U8)
    b = allocator.allocate((16,), U8)
    assert a and b and a.offset != b.offset
    for o in (a, b, other):
        o.release()
    assert allocator.stats().used == 0


def test_retain_after_free_raises(allocator: FreeListAllocator) -> None:
    obj = allocator.allocate((16,), U8)
    assert obj is not None
    obj.release()
    with pytest.raises(RefCountError):
        obj.retain()
    with pytest.raises(RefCountError):
        obj.pin()
    assert obj.ref_count == 0


def test_data_accessors_after_free_raise_ref_count_error(allocator: FreeListAllocator) -> None:
    obj = allocator.allocate((16,), torch.float32)
    assert obj is not None
    obj.release()
    with pytest.raises(RefCountError, match="already freed"):
        _ = obj.tensor
    with pytest.raises(RefCountError):
        _ = obj.raw
    with pytest.raises(RefCountError):
        obj.memoryview()
    with pytest.raises(RefCountError):
        obj.data_ptr()
    assert obj.nbytes == 64  # metadata stays readable


def test_pin_keeps_memory_alive_after_release_until_unpin(allocator: FreeListAllocator) -> None:
    obj = allocator.allocate((PAGE,), U8)
    assert obj is not None
    obj.pin()
    obj.pin()
    obj.release()
    assert obj.is_valid and obj.ref_count == 0 and obj.pin_count == 2
    assert allocator.stats().used == PAGE
    obj.tensor.fill_(3)  # still usable
    obj.unpin()
    assert obj.is_valid and allocator.stats().used == PAGE
    obj.unpin()
    assert not obj.is_valid
    assert allocator.stats().used == 0
    assert allocator.memcheck()


def test_unpin_keeps_object_while_referenced(allocator: FreeListAllocator) -> None:
    obj = allocator.allocate((16,), U8)
    assert obj is not None
    obj.pin()
    obj.unpin()
    assert obj.is_valid and allocator.stats().object_count == 1
    obj.release()
    assert allocator.stats().object_count == 0


def test_unpin_below_zero_raises(allocator: FreeListAllocator) -> None:
    obj = allocator.allocate((16,), U8)
    assert obj is not None
    with pytest.raises(RefCountError, match="unpinned more often"):
        obj.unpin()
    assert obj.is_valid and obj.pin_count == 0
    obj.release()
    with pytest.raises(RefCountError):
        obj.unpin()
    assert allocator.stats().used == 0


def test_release_of_pinned_object_below_zero_raises(allocator: FreeListAllocator) -> None:
    obj = allocator.allocate((16,), U8)
    assert obj is not None
    obj.pin()
    obj.release()
    with pytest.raises(RefCountError):
        obj.release()
    assert obj.is_valid and allocator.stats().object_count == 1
    obj.unpin()
    assert allocator.stats().object_count == 0


def test_memoryview_is_zero_copy_both_ways(allocator: FreeListAllocator) -> None:
    obj = allocator.allocate((4, 16), torch.float16)
    assert obj is not None
    view = obj.memoryview()
    assert view.nbytes == obj.nbytes == 128
    assert view.format == "B" and not view.readonly
    obj.tensor.fill_(1.0)
    assert bytes(view[:2]) == torch.tensor([1.0], dtype=torch.float16).view(U8).numpy().tobytes()
    view[:] = b"\x00" * 128
    assert float(obj.tensor.abs().sum()) == 0.0
    view[0:2] = torch.tensor([2.5], dtype=torch.float16).view(U8).numpy().tobytes()
    assert float(obj.tensor[0, 0]) == 2.5
    assert int(allocator.buffer[obj.offset + 1]) == int(obj.raw[1])


def test_from_tensor_wraps_without_copy() -> None:
    t = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    obj = MemoryObj.from_tensor(t, MemoryFormat.KV_2TD)
    assert obj.shape == (2, 3, 4)
    assert obj.dtype == torch.float32
    assert obj.fmt is MemoryFormat.KV_2TD
    assert obj.nbytes == 96
    assert obj.allocator is None
    assert obj.data_ptr() == t.data_ptr()
    obj.tensor[0, 0, 0] = 100.0
    assert float(t[0, 0, 0]) == 100.0
    obj.memoryview()[4:8] = torch.tensor([7.0]).view(U8).numpy().tobytes()
    assert float(t[0, 0, 1]) == 7.0
    obj.release()
    assert not obj.is_valid


def test_from_tensor_rejects_non_contiguous() -> None:
    t = torch.zeros(4, 4).t()
    with pytest.raises(ConfigError, match="contiguous"):
        MemoryObj.from_tensor(t)


def test_from_tensor_of_empty_tensor() -> None:
    obj = MemoryObj.from_tensor(torch.empty(0, 8, dtype=torch.bfloat16))
    assert obj.shape == (0, 8) and obj.nbytes == 0
    assert obj.tensor.shape == (0, 8) and obj.tensor.dtype == torch.bfloat16
    assert obj.memoryview().nbytes == 0


def test_constructor_rejects_mismatched_raw_buffer() -> None:
    with pytest.raises(ConfigError, match="flat uint8"):
        MemoryObj(torch.zeros(10, dtype=U8), (4,), torch.float32)
    with pytest.raises(ConfigError, match="flat uint8"):
        MemoryObj(torch.zeros(4, dtype=torch.float32), (4,), torch.float32)
    with pytest.raises(ConfigError, match="flat uint8"):
        MemoryObj(torch.zeros(2, 8, dtype=U8), (4,), torch.float32)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_dtype_views(allocator: FreeListAllocator, dtype: torch.dtype) -> None:
    shape = (2, 3, 5, 8)
    obj = allocator.allocate(shape, dtype, MemoryFormat.KV_2LTD)
    assert obj is not None
    assert obj.tensor.dtype == dtype
    assert obj.tensor.shape == shape
    assert obj.nbytes == 2 * 3 * 5 * 8 * dtype.itemsize
    assert obj.raw.numel() == obj.nbytes
    assert obj.memoryview().nbytes == obj.nbytes
    src = torch.randint(0, 256, (obj.nbytes,), dtype=U8)
    obj.raw.copy_(src)
    assert torch.equal(obj.tensor.view(U8).reshape(-1), src)
    assert obj.tensor.data_ptr() == obj.raw.data_ptr()
    obj.release()


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(0,), (2, 0, 4), (0, 0), (2, 4, 0, 8)])
def test_zero_size_shapes(allocator: FreeListAllocator, dtype: torch.dtype, shape: tuple) -> None:
    obj = allocator.allocate(shape, dtype)
    assert obj is not None
    assert obj.nbytes == 0
    assert obj.tensor.shape == shape and obj.tensor.dtype == dtype
    assert obj.memoryview().nbytes == 0
    obj.release()
    assert allocator.stats().used == 0


def test_nbytes_and_phy_size(allocator: FreeListAllocator) -> None:
    obj = allocator.allocate((2, 32, 1, 128), torch.bfloat16)
    assert obj is not None
    assert obj.nbytes == 2 * 32 * 128 * 2
    assert obj.phy_size == 4 * PAGE
    assert obj.device == torch.device("cpu")
    scalar = MemoryObj.from_tensor(torch.tensor(1.0, dtype=torch.float64))
    assert scalar.shape == () and scalar.nbytes == 8
    obj.release()


# --------------------------------------------------------------------------- units (buffer sizes)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0, 0),
        (4096, 4096),
        ("4096", 4096),
        ("512MiB", 512 << 20),
        ("5GiB", 5 << 30),
        ("5 GiB", 5 << 30),
        ("5gib", 5 << 30),
        ("1.5 GB", 1_500_000_000),
        ("1KB", 1000),
        ("1KiB", 1024),
        ("2TiB", 2 << 40),
        ("10b", 10),
        ("0.5KiB", 512),
        (" 1.25 MiB ", 1_310_720),
        (4096.0, 4096),
        (str((1 << 63) - 1), (1 << 63) - 1),
    ],
)
def test_parse_size_accepts(value: object, expected: int) -> None:
    assert parse_size(value) == expected


@pytest.mark.parametrize(
    "value",
    [
        True,
        False,
        None,
        -1,
        "-1",
        "-5GiB",
        "",
        "abc",
        "5 parsecs",
        "GiB",
        "1e3",
        [1],
        1.5,
        float("nan"),
        float("inf"),
        "5,5GiB",
        "5.GiB",
        "1.5.5GiB",
        "512,5MiB",
        "1_000",
        "1.5B",
        "0.1KiB",
        "5 GiB GiB",
        "5GiB2",
        "1kbit",
        "8EiB",
        str(1 << 63),
        "99999999TiB",
    ],
)
def test_parse_size_rejects(value: object) -> None:
    with pytest.raises(ConfigError, match="max_local_cpu_size"):
        parse_size(value, what="max_local_cpu_size")


def test_a_size_error_says_why() -> None:
    with pytest.raises(ConfigError, match=r"'5,5' is not a number \(use '\.' for a fraction"):
        parse_size("5,5GiB")
    with pytest.raises(ConfigError, match="larger than any machine can address"):
        parse_size("99999999TiB")
    with pytest.raises(ConfigError, match="not a whole number of bytes"):
        parse_size("1.5B")


def test_an_allocator_larger_than_the_address_space_names_its_setting() -> None:
    with pytest.raises(ConfigError) as error:
        FreeListAllocator(1 << 62, pin=False, sized_by="cpu:// max_size")
    message = str(error.value)
    assert message.startswith("cpu:// max_size is 4.0EiB, more host memory than this machine")
    assert "in total" in message and "available now" in message and "Lower it" in message


@pytest.mark.skipif(
    Path("/proc/sys/vm/overcommit_memory").read_text().strip() == "1",
    reason="this kernel grants any reservation (vm.overcommit_memory=1), so only the "
    "address-space limit can be tested here",
)
def test_an_allocator_larger_than_the_machine_names_its_setting_and_the_machine() -> None:
    too_much = 16 * host_memory().total
    with pytest.raises(ConfigError, match=r"KVPLUG_HOST_BUFFER_SIZE is .* in total"):
        FreeListAllocator(too_much, pin=False, sized_by="KVPLUG_HOST_BUFFER_SIZE")


@pytest.mark.parametrize(
    ("value", "expected"),
    [(5, 5 << 30), (5.0, 5 << 30), (0.5, 512 << 20), (0, 0), ("5GiB", 5 << 30), ("100MB", 10**8)],
)
def test_parse_gib_accepts(value: object, expected: int) -> None:
    assert parse_gib(value, what="max_local_cpu_size") == expected


@pytest.mark.parametrize(
    "value", [-1, -0.5, float("nan"), float("inf"), float("-inf"), True, None, "abc", "-1GiB"]
)
def test_parse_gib_rejects(value: object) -> None:
    with pytest.raises(ConfigError, match="max_local_cpu_size"):
        parse_gib(value, what="max_local_cpu_size")
