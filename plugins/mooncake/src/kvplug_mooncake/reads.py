"""How a Mooncake backend reads: ``get`` (a whole value into one allocator block, sized by the
family's hint or by the master), ``get_into`` (header region into a slot, payload into the
caller's memory) and the probe that tells a value being overwritten from an absent one."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from kvplug.errors import BackendError, CorruptObject, LayoutMismatch
from kvplug.frame import verify_payload
from kvplug.keys import CacheKey
from kvplug.memory import MemoryObj
from kvplug_mooncake import codes
from kvplug_mooncake.calls import MooncakeCalls, release_all
from kvplug_mooncake.layout import (
    HEADER_REGION,
    Damage,
    SizeHints,
    object_of_value,
    read_header_region,
)
from kvplug_mooncake.overlap import checksum, groups_of, while_being_written
from kvplug_mooncake.registration import HeaderSlot, host_like, release_slots

SIZE_MISMATCH = frozenset({codes.INVALID_PARAMS, codes.TRANSFER_FAIL})
"""What a multi-buffer read whose buffers do not add up to the stored size returns: -600 (the
value is larger) or -800 (smaller)."""


class MooncakeReads(MooncakeCalls):
    """The reads of :class:`~kvplug_mooncake.backend.MooncakeBackend`."""

    # -- get ---------------------------------------------------------------------------------

    async def _get(self, key: CacheKey) -> MemoryObj | None:
        return (await self._batched_get([key]))[0]

    async def _batched_get(self, keys: Sequence[CacheKey]) -> list[MemoryObj | None]:
        names = [self._name(key) for key in keys]
        families = {name: SizeHints.family(key) for name, key in zip(names, keys, strict=True)}
        found, damaged = await self._run(
            lambda: self._read_objects(names, families), abandoned=_release_found
        )
        try:
            await self.damaged_values.drop(damaged)
        except BaseException:
            _release_found((found, damaged))
            raise
        return found

    def _stored_sizes(self, names: Sequence[str]) -> dict[str, int]:
        """The stored size of each name that is present (one call to the master)."""
        sizes = {}
        for name, replicas in self._store.batch_get_replica_desc(list(names)).items():
            for replica in replicas:
                if replica.is_memory_replica():
                    sizes[name] = int(replica.get_memory_descriptor().buffer_descriptor.size)
                    break
            else:
                if replicas:
                    size = int(self._store.get_size(name))
                    if size > 0:
                        sizes[name] = size
        return sizes

    def _read_objects(
        self, names: list[str], families: dict[str, Hashable]
    ) -> tuple[list[MemoryObj | None], dict[str, CorruptObject]]:
        """Read each name's whole value into one allocator block and return its payload in
        place (a worker thread): into a block of its family's size (:attr:`size_hints`) at
        once, else, and for a value larger than that, at the size the master reports. A value
        being written is waited for (see :func:`~kvplug_mooncake.overlap.while_being_written`)."""
        results: dict[str, MemoryObj | None] = {}
        damage = Damage()

        def attempt(pending: list[str]) -> list[str]:
            again: list[str] = []
            guessed: list[tuple[str, MemoryObj]] = []
            unsized: list[str] = []
            for name in pending:
                size = self.size_hints.size(families[name])
                block = None if size is None else self._block(size)
                if block is None:
                    unsized.append(name)
                else:
                    guessed.append((name, block))
            unsized += self._read_whole(guessed, families, results, damage, again)
            if not unsized:
                return again
            sizes = self._stored_sizes(unsized)
            absent = [name for name in unsized if name not in sizes]
            written = self._being_written(absent) if self.options.probe else set()
            sized: list[tuple[str, MemoryObj]] = []
            for name in unsized:
                size = sizes.get(name)
                block = None if size is None else self._block(size)
                if block is not None:
                    sized.append((name, block))
                elif name in written:
                    again.append(name)
                else:
                    results[name] = None  # absent, or no room to receive it: a miss
            again += self._read_whole(sized, families, results, damage, again)  # grew since
            return again

        try:
            for name in while_being_written(attempt, list(dict.fromkeys(names))):
                results[name] = None
        except BaseException:
            for obj in results.values():
                if obj is not None:
                    obj.release()
            raise
        given: set[str] = set()
        found: list[MemoryObj | None] = []
        for name in names:
            obj = results.get(name)
            found.append(obj.retain() if obj is not None and name in given else obj)
            given.add(name)
        return found, damage.found

    def _read_whole(
        self,
        blocks: list[tuple[str, MemoryObj]],
        families: dict[str, Hashable],
        results: dict[str, MemoryObj | None],
        damage: Damage,
        again: list[str],
    ) -> list[str]:
        """Read each name's value into its block (one ``batch_get_into`` per group) and put
        the object it holds in ``results`` (None for a miss), or its name in ``again`` (being
        written, or a first failed check). Returns the names whose value is larger than its
        block. Every block is consumed."""
        registrations = self._registrations
        assert registrations is not None
        larger: list[str] = []
        failures: list[BackendError] = []
        consumed = [False] * len(blocks)

        def read(group: list[int]) -> list[int]:
            taken = [blocks[j][1] for j in group]
            with registrations.holding_objects(taken):
                read_codes: list[int] = self._store.batch_get_into(
                    [blocks[j][0] for j in group],
                    [block.data_ptr() for block in taken],
                    [block.nbytes for block in taken],
                )
            return read_codes

        def check(group: list[int], read_codes: list[int]) -> None:
            for j, code in zip(group, read_codes, strict=True):
                name, block = blocks[j]
                consumed[j] = True
                if code >= 0:  # the whole value, code bytes long
                    try:
                        results[name] = object_of_value(name, block, code, self.allocator)
                        self.size_hints.saw(families[name], code)
                    except CorruptObject as error:
                        if damage.confirmed(name, error):
                            results[name] = None
                        else:
                            again.append(name)
                    continue
                block.release()
                if code == codes.INVALID_PARAMS:
                    larger.append(name)
                elif code == codes.REPLICA_IS_NOT_READY:
                    again.append(name)
                elif code in codes.MISSES:
                    results[name] = None
                else:
                    failures.append(self._error(code, "get", name))

        try:
            self._overlapped(
                groups_of(list(range(len(blocks))), [block for _, block in blocks]),
                transfer=read,
                after=check,
            )
        finally:
            release_all([block for j, (_, block) in enumerate(blocks) if not consumed[j]])
        if failures:
            raise failures[0]
        return larger

    def _being_written(self, names: list[str]) -> set[str]:
        """Those of ``names`` (absent to the master's replica query) that :meth:`_probe` finds
        present after all: being written or overwritten."""
        return {name for name, there in zip(names, self._probe(names), strict=True) if there}

    def _probe(self, names: list[str]) -> list[bool]:
        """Whether each name has a value after all, though ``batch_is_exist`` or the replica
        query says it has not: both say so for as long as an overwrite of it runs. One
        ``batch_get_into`` of each value into a header slot: -704 (or another miss but -703)
        is absent; -703 (being written), -600 (larger than the slot) or a length, present."""
        if not names:
            return []
        slots = self._slots(len(names))
        try:
            read: list[int] = self._store.batch_get_into(
                names, [slot.ptr for slot in slots], [HEADER_REGION] * len(names)
            )
        finally:
            release_slots(slots)
        present = []
        for name, code in zip(names, read, strict=True):
            if code < 0 and code not in (codes.REPLICA_IS_NOT_READY, codes.INVALID_PARAMS):
                if code not in codes.MISSES:
                    raise self._error(code, "get", name)
                present.append(False)
            else:
                present.append(True)
        return present

    # -- get_into ----------------------------------------------------------------------------

    async def _get_into(self, key: CacheKey, dest: MemoryObj) -> bool:
        return (await self._batched_get_into([key], [dest]))[0]

    async def _batched_get_into(
        self, keys: Sequence[CacheKey], dests: Sequence[MemoryObj]
    ) -> list[bool]:
        names = [self._name(key) for key in keys]
        targets = [host_like(dest) for dest in dests]
        try:
            hits, damaged, resized = await self._run(
                lambda: self._read_into(names, targets), targets
            )
            for dest, target, hit in zip(dests, targets, hits, strict=True):
                if hit and target is not dest:
                    dest.raw.copy_(target.raw)
        finally:
            release_all(targets)
        for key, dest, hit in zip(keys, dests, hits, strict=True):
            if hit:
                self.size_hints.saw(SizeHints.family(key), HEADER_REGION + dest.nbytes)
        await self.damaged_values.drop(damaged)
        for index in resized:
            # Read whole, once, to name the stored layout (a reader with another layout).
            stored, dest = await self._get(keys[index]), dests[index]
            if stored is not None:
                stored.release()
                if stored.nbytes != dest.nbytes:  # not overwritten to the reader's size since
                    raise LayoutMismatch.between(
                        keys[index],
                        (stored.shape, stored.dtype, stored.nbytes),
                        (dest.shape, dest.dtype, dest.nbytes),
                    )
        return hits

    def _read_into(
        self, names: list[str], dests: list[MemoryObj]
    ) -> tuple[list[bool], dict[str, CorruptObject], list[int]]:
        """Scatter each value into a header slot and its destination, one
        ``batch_get_into_multi_buffers`` per group (a worker thread); a value being written is
        waited for (see :func:`~kvplug_mooncake.overlap.while_being_written`). Returns the
        hits, the names of damaged values, and the positions whose value has another size
        than its destination."""
        registrations = self._registrations
        assert registrations is not None
        hits = [False] * len(names)
        resized: list[int] = []
        damage = Damage()
        slots = self._slots(len(names))

        def attempt(pending: list[int]) -> list[int]:
            again: list[int] = []

            def read(group: list[int]) -> list[int]:
                read_codes: list[int] = self._store.batch_get_into_multi_buffers(
                    [names[i] for i in group],
                    [[slots[i].ptr, dests[i].data_ptr()] for i in group],
                    [[HEADER_REGION, dests[i].nbytes] for i in group],
                )
                return read_codes

            def check(group: list[int], read_codes: list[int]) -> None:
                for i, code in zip(group, read_codes, strict=True):
                    if code == HEADER_REGION + dests[i].nbytes:
                        try:
                            self._verify_into(names[i], slots[i], dests[i])
                            hits[i] = True
                        except CorruptObject as error:
                            if not damage.confirmed(names[i], error):
                                again.append(i)
                    elif code == codes.REPLICA_IS_NOT_READY:
                        again.append(i)
                    elif code in SIZE_MISMATCH:
                        resized.append(i)
                    elif code < 0 and code not in codes.MISSES:
                        self._check(code, "get", names[i])

            self._overlapped(groups_of(pending, dests), transfer=read, after=check)
            return again

        try:
            with registrations.holding_objects(dests):
                while_being_written(attempt, list(range(len(names))))
        finally:
            release_slots(slots)
        return hits, damage.found, resized

    def _verify_into(self, name: str, slot: HeaderSlot, dest: MemoryObj) -> None:
        """Check that ``dest`` now holds the payload the header region in ``slot`` describes;
        :class:`~kvplug.errors.CorruptObject` when it does not."""
        header = read_header_region(slot.view(), name, HEADER_REGION + dest.nbytes)
        verify_payload(header, dest.memoryview(), checksum)


def _release_found(result: tuple[Sequence[MemoryObj | None], Any]) -> None:
    for obj in result[0]:
        if obj is not None:
            obj.release()


__all__ = ["SIZE_MISMATCH", "MooncakeReads"]
