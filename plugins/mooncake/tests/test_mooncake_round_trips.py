"""What each ``mooncakestore://`` operation costs in Mooncake calls, against a real
``mooncake_master``: the client is wrapped in a proxy that counts the calls made through it
(the behaviour is Mooncake's own). Also the value layout (a header region of fixed length),
the ``probe`` option, and what ``contains`` and ``get`` answer while another client
overwrites the key."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
import torch
from mooncake_helpers import SHAPE, filled, key, mooncake_store, release, run
from mooncake_helpers import allocator as allocator

import kvplug
from kvplug.errors import CorruptObject
from kvplug.frame import decode_header, encode_header, header_len
from kvplug.memory import FreeListAllocator, MemoryFormat, MemoryObj
from kvplug_mooncake.backend import MooncakeBackend
from kvplug_mooncake.layout import (
    HEADER_REGION,
    SizeHints,
    read_header_region,
    write_header_region,
)
from kvplug_testing.mooncake import CountingStore, MooncakeMaster


@pytest.fixture(scope="module")
def store() -> Iterator[MooncakeMaster]:
    with mooncake_store("512MiB") as master:
        yield master


async def counted(
    master: MooncakeMaster, allocator: FreeListAllocator, **options: Any
) -> tuple[MooncakeBackend, CountingStore]:
    backend = await kvplug.open_backend(
        master.url(global_segment_size=0, **options), allocator=allocator
    )
    assert isinstance(backend, MooncakeBackend)
    counter = CountingStore(backend._store)
    backend._store = counter
    return backend, counter


# -- the layout: a header region of fixed length ----------------------------------------------


@pytest.mark.parametrize("shape", [(4096,), (8, 512), (2, 4, 16, 32), (1, 1, 1, 1, 1, 2, 2, 1024)])
def test_every_value_has_a_header_region_of_one_length_before_its_payload(
    store: MooncakeMaster, allocator: FreeListAllocator, shape: tuple[int, ...]
) -> None:
    async def scenario() -> None:
        backend, _ = await counted(store, allocator)
        obj = filled(allocator, 1, shape)
        await backend.put(key(len(shape)), obj)
        stored = await backend.read_raw(key(len(shape)))
        assert stored is not None and len(stored) == HEADER_REGION + obj.nbytes
        header = decode_header(stored[:HEADER_REGION])
        assert header.header_len == header_len(len(shape)) <= HEADER_REGION
        assert stored[header.header_len : HEADER_REGION] == bytes(HEADER_REGION - header.header_len)
        assert stored[HEADER_REGION:] == bytes(obj.memoryview())
        release(obj)
        await backend.close()

    run(scenario())


def test_the_header_region_is_checked_against_the_stored_length_and_its_padding() -> None:
    obj = MemoryObj.from_tensor(torch.arange(64, dtype=torch.float32))
    region = memoryview(bytearray(HEADER_REGION))
    write_header_region(region, obj)
    stored_len = HEADER_REGION + obj.nbytes
    assert read_header_region(region, "k", stored_len).shape == (64,)
    with pytest.raises(CorruptObject, match="header took 64 bytes"):
        read_header_region(region, "k", stored_len - 64)  # the layout before the fixed region
    region[HEADER_REGION - 1] = 1
    with pytest.raises(CorruptObject, match="padding"):
        read_header_region(region, "k", stored_len)


def test_a_value_in_the_earlier_layout_reads_as_damage_never_as_a_wrong_object(
    store: MooncakeMaster, allocator: FreeListAllocator
) -> None:
    """Before the header region had one length, an object of 1 to 3 dimensions was stored
    behind a 64-byte header."""

    async def scenario() -> None:
        backend, _ = await counted(store, allocator)
        obj = filled(allocator, 2, (8, 512))
        payload = bytes(obj.memoryview())
        earlier = encode_header(obj.shape, obj.dtype, MemoryFormat.KV_2LTD, "naive", payload)
        assert len(earlier) == 64
        for n, read in enumerate(("get", "get_into")):
            await backend.write_raw(key(20 + n), earlier + payload)
            if read == "get":
                assert await backend.get(key(20 + n)) is None
            else:
                assert await backend.get_into(key(20 + n), obj) is False
            assert backend.corrupt_objects == n + 1
            assert await backend.read_raw(key(20 + n)) is None  # removed
        release(obj)
        await backend.close()

    run(scenario())


# -- store calls per operation ----------------------------------------------------------------


def test_batched_exists_and_contains_are_one_call_without_the_probe(
    store: MooncakeMaster, allocator: FreeListAllocator
) -> None:
    async def scenario() -> None:
        backend, calls = await counted(store, allocator)
        obj = filled(allocator, 3)
        await backend.batched_put([key(100), key(101)], [obj, obj])
        calls.taken()
        found = await backend.batched_exists([key(100), key(199), key(101), key(198)])
        assert found == [True, False, True, False]
        assert calls.taken() == {"batch_is_exist": 1}
        assert await backend.contains(key(199)) is False
        assert calls.taken() == {"batch_is_exist": 1}
        assert await backend.batched_contains([key(100), key(101), key(199)]) == 2
        assert calls.taken() == {"batch_is_exist": 1}
        release(obj)
        await backend.close()

    run(scenario())


def test_the_probe_reads_each_absent_answer_once_more(
    store: MooncakeMaster, allocator: FreeListAllocator
) -> None:
    async def scenario() -> None:
        backend, calls = await counted(store, allocator, probe="true")
        assert backend.describe()["probe"].startswith("on")
        obj = filled(allocator, 4)
        await backend.batched_put([key(110), key(111)], [obj, obj])
        calls.taken()
        assert await backend.batched_exists([key(110), key(111)]) == [True, True]
        assert calls.taken() == {"batch_is_exist": 1}  # no absent answer, nothing to probe
        assert await backend.batched_exists([key(110), key(119), key(118)]) == [True, False, False]
        assert calls.taken() == {"batch_is_exist": 1, "batch_get_into": 1}
        release(obj)
        await backend.close()

    run(scenario())


def test_get_into_is_one_call_whatever_the_destinations_rank(
    store: MooncakeMaster, allocator: FreeListAllocator
) -> None:
    async def scenario() -> None:
        backend, calls = await counted(store, allocator)
        objs = [filled(allocator, 5 + n) for n in range(4)]
        keys = [key(120 + n) for n in range(4)]
        await backend.batched_put(keys, objs)
        nbytes = objs[0].nbytes
        layouts = [
            (SHAPE, torch.float16),
            ((nbytes,), torch.uint8),
            ((nbytes // 2, 2), torch.uint8),
            ((1, 1, 1, 1, 1, 1, 2, nbytes // 4), torch.float16),
        ]
        dests = [allocator.allocate(shape, dtype) for shape, dtype in layouts]
        assert all(dest is not None for dest in dests)
        targets = [dest for dest in dests if dest is not None]
        calls.taken()
        for dest in targets:
            assert await backend.get_into(keys[0], dest)
            assert torch.equal(dest.raw, objs[0].raw)
            assert calls.taken() == {"batch_get_into_multi_buffers": 1}
        # a batch of 1 MiB: one group, one call
        assert await backend.batched_get_into(keys, targets) == [True] * 4
        assert calls.taken() == {"batch_get_into_multi_buffers": 1}
        for obj, dest in zip(objs, targets, strict=True):
            assert torch.equal(dest.raw, obj.raw)
        assert await backend.get_into(key(129), targets[0]) is False  # a miss: one call too
        assert calls.taken() == {"batch_get_into_multi_buffers": 1}
        release(*objs, *dests)
        await backend.close()

    run(scenario())
    assert allocator.stats().used == 0


def test_get_is_one_call_once_the_keys_family_is_known(
    store: MooncakeMaster, allocator: FreeListAllocator
) -> None:
    async def scenario() -> None:
        writer, writes = await counted(store, allocator)
        reader, reads = await counted(store, allocator)  # another client: knows no family
        objs = [filled(allocator, 10 + n) for n in range(3)]
        keys = [key(130 + n) for n in range(3)]
        await writer.batched_put(keys, objs)
        got = await reader.get(keys[0])  # first of its family: ask the size, then read
        assert got is not None and torch.equal(got.tensor, objs[0].tensor)
        assert reads.taken() == {"batch_get_replica_desc": 1, "batch_get_into": 1}
        again = await reader.batched_get([*keys[1:], key(139)])
        assert reads.taken() == {"batch_get_into": 1}
        assert again[2] is None
        for obj, read in zip(objs[1:], again, strict=False):
            assert read is not None and torch.equal(read.tensor, obj.tensor)
        writes.taken()
        mine = await writer.get(keys[2])  # the writer knows the family from its put
        assert writes.taken() == {"batch_get_into": 1}
        assert mine is not None and torch.equal(mine.tensor, objs[2].tensor)
        release(*objs, got, *again, mine)
        await writer.close()
        await reader.close()

    run(scenario())
    assert allocator.stats().used == 0


def test_get_of_a_value_smaller_or_larger_than_its_familys(
    store: MooncakeMaster, allocator: FreeListAllocator
) -> None:
    """A short last chunk is read in the block sized for the family, and copied out of it
    when it would waste more than half; a value larger than the family's is refused by
    Mooncake, its size asked, and read again."""

    async def scenario() -> None:
        backend, calls = await counted(store, allocator)
        full, short = filled(allocator, 20), filled(allocator, 21, (2, 4, 16, 64))
        await backend.batched_put([key(140), key(141)], [full, short])
        calls.taken()
        got_short = await backend.get(key(141))
        assert calls.taken() == {"batch_get_into": 1}
        assert got_short is not None and torch.equal(got_short.tensor, short.tensor)
        assert got_short.phy_size < full.nbytes  # not left in the family-sized block
        larger = filled(allocator, 22, (2, 8, 256, 64))
        await backend.put(key(142), larger)
        other, other_calls = await counted(store, allocator)
        release(await other.get(key(140)))  # learns the family's size from a full chunk
        other_calls.taken()
        got_larger = await other.get(key(142))
        assert other_calls.taken() == {"batch_get_into": 2, "batch_get_replica_desc": 1}
        assert got_larger is not None and torch.equal(got_larger.tensor, larger.tensor)
        assert other.size_hints.size(SizeHints.family(key(142))) == HEADER_REGION + larger.nbytes
        release(full, short, larger, got_short, got_larger)
        await backend.close()
        await other.close()

    run(scenario())
    assert allocator.stats().used == 0


def test_put_of_new_keys_is_two_calls_and_an_overwrite_copies_once(
    store: MooncakeMaster, allocator: FreeListAllocator
) -> None:
    """Mooncake's put of an existing key keeps the old value and returns 0, so a put asks
    first; an existing key is upserted from one copy of header and payload."""

    async def scenario() -> None:
        backend, calls = await counted(store, allocator)
        objs = [filled(allocator, 30 + n) for n in range(4)]
        keys = [key(150 + n) for n in range(4)]
        await backend.put(keys[0], objs[0])
        assert calls.taken() == {"batch_is_exist": 1, "batch_put_from_multi_buffers": 1}
        await backend.batched_put(keys[1:], objs[1:])
        assert calls.taken() == {"batch_is_exist": 1, "batch_put_from_multi_buffers": 1}
        await backend.put(keys[0], objs[3])
        assert calls.taken() == {"batch_is_exist": 1, "batch_upsert_from": 1}
        assert backend.copied_overwrites == 1
        got = await backend.get(keys[0])
        assert got is not None and torch.equal(got.tensor, objs[3].tensor)
        release(*objs, got)
        await backend.close()

    run(scenario())
    assert allocator.stats().used == 0


# -- an overwrite by another client, racing contains and get ---------------------------------

RACE_SHAPE = (2, 16, 256, 256)  # 8 MiB: an overwrite takes milliseconds
RACE_ROUNDS = 300


async def _race(
    master: MooncakeMaster,
    allocator: FreeListAllocator,
    ask: Callable[[MooncakeBackend], Awaitable[Any]],
    *,
    probe: bool = False,
    until: Callable[[Any], bool] = lambda answer: False,
) -> tuple[list[Any], MooncakeBackend, list[MemoryObj]]:
    """Another client overwrites one key with two values in turn while ``ask`` runs against
    a reader that has read the key once (it knows its family), :data:`RACE_ROUNDS` times or
    until an answer satisfies ``until``; returns the answers, the reader and the values."""
    writer = await kvplug.open_backend(master.url(global_segment_size=0), allocator=allocator)
    reader = await kvplug.open_backend(
        master.url(global_segment_size=0, probe=probe), allocator=allocator
    )
    assert isinstance(reader, MooncakeBackend)
    values = [filled(allocator, 40 + n, RACE_SHAPE) for n in range(2)]
    await writer.put(key(160), values[0])
    release(await reader.get(key(160)))
    done = asyncio.Event()
    answers: list[Any] = []

    async def overwrite() -> None:
        turn = 1
        while not done.is_set():
            await writer.put(key(160), values[turn % 2])
            turn += 1
            await asyncio.sleep(0.01)

    async def asking() -> None:
        try:
            for _ in range(RACE_ROUNDS):
                answers.append(await ask(reader))
                if until(answers[-1]):
                    break
        finally:
            done.set()

    await asyncio.gather(overwrite(), asking())
    await writer.close()
    return answers, reader, values


async def _contains(reader: MooncakeBackend) -> bool:
    return await reader.contains(key(160))


def test_without_the_probe_a_key_being_overwritten_can_read_absent_but_never_after(
    store: MooncakeMaster, allocator: FreeListAllocator
) -> None:
    """The guarantee without the probe: ``contains`` of a key that another client is
    overwriting at that moment may answer False (Mooncake's ``batch_is_exist`` says no while
    the overwrite runs), never raises, and answers True once the overwrite is done."""

    async def scenario() -> None:
        answers, reader, values = await _race(
            store, allocator, _contains, until=lambda present: present is False
        )
        assert False in answers, f"contains never answered False in {RACE_ROUNDS} overwrites"
        assert await reader.contains(key(160)) is True
        release(*values)
        await reader.close()

    run(scenario())


def test_with_the_probe_a_key_being_overwritten_reads_present(
    store: MooncakeMaster, allocator: FreeListAllocator
) -> None:
    async def scenario() -> None:
        answers, reader, values = await _race(store, allocator, _contains, probe=True)
        assert answers == [True] * RACE_ROUNDS
        release(*values)
        await reader.close()

    run(scenario())


def test_get_of_a_known_family_waits_for_an_overwrite_and_never_sees_a_mix(
    store: MooncakeMaster, allocator: FreeListAllocator
) -> None:
    """Without the probe too: the read itself tells a value being written (-703) from an
    absent one, and waits for it."""

    async def get(reader: MooncakeBackend) -> torch.Tensor | None:
        got = await reader.get(key(160))
        if got is None:
            return None
        try:
            return got.tensor.clone()
        finally:
            got.release()

    async def scenario() -> None:
        answers, reader, values = await _race(store, allocator, get)
        assert all(answer is not None for answer in answers), "a get missed during an overwrite"
        for answer in answers:
            assert any(torch.equal(answer, value.tensor) for value in values)
        release(*values)
        await reader.close()

    run(scenario())
    assert allocator.stats().used == 0


# -- size hints ------------------------------------------------------------------------------


def test_size_hints_keep_the_largest_value_of_each_family_and_forget_the_oldest() -> None:
    hints = SizeHints()
    family = SizeHints.family(key(1))
    assert family == SizeHints.family(key(2)) != SizeHints.family(key(1, "another-model"))
    hints.saw(family, 1000)
    hints.saw(family, 200)
    assert hints.size(family) == 1000
    for n in range(SizeHints.LIMIT):
        hints.saw(("other", n), n)
    assert hints.size(family) is None and hints.size(("other", 0)) == 0
