"""How a Mooncake backend writes: new keys zero-copy from a header slot and the object's own
memory, existing keys upserted from one copy of header and payload side by side (Mooncake's put
keeps an existing key's old value)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvplug.keys import CacheKey
from kvplug.memory import MemoryObj
from kvplug_mooncake import codes
from kvplug_mooncake.calls import MooncakeCalls, release_all
from kvplug_mooncake.layout import HEADER_REGION, SizeHints, write_header_region
from kvplug_mooncake.overlap import groups_of
from kvplug_mooncake.registration import HeaderSlot, host_copy, release_slots


class MooncakeWrites(MooncakeCalls):
    """The writes of :class:`~kvplug_mooncake.backend.MooncakeBackend`."""

    # -- put ---------------------------------------------------------------------------------

    async def _put(self, key: CacheKey, obj: MemoryObj) -> None:
        await self._batched_put([key], [obj])

    async def _batched_put(self, keys: Sequence[CacheKey], objs: Sequence[MemoryObj]) -> None:
        last = {self._name(key): (key, obj) for key, obj in zip(keys, objs, strict=True)}
        names = list(last)
        hosts = [host_copy(obj) for _, obj in last.values()]
        try:
            await self._run(lambda: self._store_objects(names, hosts), hosts)
        finally:
            release_all(hosts)
        for key, obj in last.values():
            self.size_hints.saw(SizeHints.family(key), HEADER_REGION + obj.nbytes)

    def _store_objects(self, names: list[str], objs: list[MemoryObj]) -> None:
        """Put each object under its name (a worker thread): new keys zero-copy, existing ones
        overwritten with one copy (Mooncake's put would keep their old value)."""
        store, registrations = self._store, self._registrations
        assert registrations is not None
        found = store.batch_is_exist(names)
        for name, code in zip(names, found, strict=True):
            if code < 0:
                raise self._error(code, "put (exists check)", name)
        slots = self._slots(len(names))
        framed = [False] * len(names)

        def frame_headers(group: list[int]) -> None:
            for i in group:
                write_header_region(slots[i].view(), objs[i])
                framed[i] = True

        new = [i for i, code in enumerate(found) if code == 0]
        existing = [i for i, code in enumerate(found) if code == 1]

        def put(group: list[int]) -> None:
            with registrations.holding_objects([objs[i] for i in group]):
                results = store.batch_put_from_multi_buffers(
                    [names[i] for i in group],
                    [[slots[i].ptr, objs[i].data_ptr()] for i in group],
                    [[HEADER_REGION, objs[i].nbytes] for i in group],
                    self._config,
                )
            for i, code in zip(group, results, strict=True):
                if code == codes.OBJECT_ALREADY_EXISTS:
                    existing.append(i)  # another writer got there first: overwrite
                else:
                    self._check(code, "put", names[i])

        try:
            self._overlapped(groups_of(new, objs), before=frame_headers, transfer=put)
            if existing:
                frame_headers([i for i in existing if not framed[i]])
                self._overwrite(
                    [names[i] for i in existing],
                    [slots[i] for i in existing],
                    [objs[i] for i in existing],
                )
        finally:
            release_slots(slots)

    def _overwrite(
        self, names: list[str], headers: list[HeaderSlot], objs: list[MemoryObj]
    ) -> None:
        """Upsert each value from one contiguous copy of header region and payload."""
        registrations = self._registrations
        assert registrations is not None
        frames = []
        try:
            for header, obj in zip(headers, objs, strict=True):
                frame = self._block(HEADER_REGION + obj.nbytes)
                if frame is None:
                    frame = MemoryObj.from_tensor(
                        torch.empty(HEADER_REGION + obj.nbytes, dtype=torch.uint8)
                    )
                view = frame.memoryview()
                view[:HEADER_REGION] = header.view()
                view[HEADER_REGION:] = obj.memoryview()
                frames.append(frame)
            self.copied_overwrites += len(frames)
            with registrations.holding_objects(frames):
                results = self._store.batch_upsert_from(
                    names, [f.data_ptr() for f in frames], [f.nbytes for f in frames], self._config
                )
            for name, code in zip(names, results, strict=True):
                self._check(code, "put", name)
        finally:
            release_all(frames)


__all__ = ["MooncakeWrites"]
