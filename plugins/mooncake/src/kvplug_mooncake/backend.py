"""``mooncakestore://master-host:port``: objects in a Mooncake Store, moved zero-copy.

Mooncake Store keeps objects in memory that its clients lend (segments) and finds them
through a master (``mooncake_master``). This backend is one such client
(``mooncake.store.MooncakeDistributedStore``), on the store's zero-copy calls:

* At open it registers the memory objects live in with Mooncake once: the buffer of the
  backend's allocator (a :class:`~kvplug.memory.FreeListAllocator`) and a slab of header
  slots (:mod:`kvplug_mooncake.registration`). Memory outside them (an object wrapped around
  an engine's tensor) is registered for the one call that moves it, and never copied.
* Each object is one Mooncake object: a header region of fixed length (the kvplug frame
  header: shape, dtype, checksums) followed by the payload (:mod:`kvplug_mooncake.layout`).

What each operation costs in Mooncake calls (a batch makes one call per group of 4 MiB or
more of objects, so that the checksum of one group overlaps the transfer of the next; the
counts below are for a batch of one group):

* ``contains`` / ``batched_exists``: one ``batch_is_exist``. With ``probe=true``, the keys it
  calls absent are read once more into a header slot (:meth:`MooncakeBackend._probe`): a key
  another client is overwriting at that moment is absent to ``batch_is_exist`` until the
  overwrite ends, and the probe reads it as present.
* ``get_into``: one ``batch_get_into_multi_buffers``, scattering the header region into a slot
  and the payload into the caller's memory; both lengths are known beforehand.
* ``get``: one ``batch_get_into`` into an allocator block of the size values of the key's
  family were seen with (:class:`~kvplug_mooncake.layout.SizeHints`), and the payload returned
  in place (:meth:`~kvplug.memory.MemoryObj.reinterpret`). Mooncake has no call that both
  sizes and reads a value into memory of the caller's: a key of a family not seen yet costs
  one more call first (``batch_get_replica_desc``), and a value larger than its family's two
  more (the read Mooncake refuses, then the size).
* ``put``: ``batch_is_exist``, then ``batch_put_from_multi_buffers`` (header slot and the
  object's own memory, no copy) for the new keys. Mooncake's put of an existing key keeps the
  old value and returns 0, and its upserts take one contiguous buffer per key, so existing
  keys are upserted (``batch_upsert_from``) from one copy of header and payload side by side.
* A value being written is hidden by Mooncake (-703): a read waits for it
  (:func:`~kvplug_mooncake.overlap.while_being_written`). A ``remove`` refused by a reader's
  lease (-706) is forced or waited out (``leased_remove``); every other code maps to a kvplug
  error that names it (:mod:`kvplug_mooncake.codes`).
* Mooncake's calls block, so they run on worker threads; each holds a reference to the
  objects whose memory it moves until it returns, also when a deadline stopped the wait.
  ``open`` checks the master and the wheel first (:mod:`kvplug_mooncake.client`).

Its modules, one job each: this one (the backend: what it declares, contains, remove, raw
values), :mod:`kvplug_mooncake.calls` (the client held, and how its calls run),
:mod:`kvplug_mooncake.reads`, :mod:`kvplug_mooncake.writes`, and those named above.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvplug.backend import Capabilities
from kvplug.keys import CacheKey
from kvplug_mooncake import codes
from kvplug_mooncake.client import installed_version, load_store_class
from kvplug_mooncake.reads import MooncakeReads
from kvplug_mooncake.writes import MooncakeWrites


class MooncakeBackend(MooncakeReads, MooncakeWrites):
    """``mooncakestore://master-host:port?...``: a Mooncake Store client on its zero-copy
    calls (see the module and :class:`~kvplug_mooncake.options.MooncakeOptions`).

    Example, against a running ``mooncake_master`` (this process lends 1 GiB)::

        backend = await kvplug.open_backend(
            "mooncakestore://10.0.0.5:50051?global_segment_size=1GiB"
        )
        obj = backend.allocator.allocate((2, 32, 256, 1024), torch.float16)  # registered
        ...  # fill obj
        await backend.put(key, obj)                     # zero-copy from obj's memory
        await backend.get_into(key, obj)                # zero-copy into obj's memory
    """

    capabilities = Capabilities(remove=True, native_batching=True, shared_across_processes=True)

    def describe(self) -> dict[str, str]:
        zero_copy = (
            "allocator buffer and header slab registered"
            if self._zero_copy_allocator
            else "header slab registered; objects registered per call (allocator has no buffer)"
        )
        return {
            "master": self.master,
            "metadata": self.options.metadata_server,
            "protocol": self.options.protocol
            + (f" ({self.options.device})" if self.options.device else ""),
            "lends": f"{self.options.global_segment_size} bytes",
            "zero_copy": zero_copy,
            "probe": "on: absent answers read once more" if self.options.probe else "off",
            "client": installed_version(),
        }

    # -- contains, remove, damage ------------------------------------------------------------

    async def _contains(self, key: CacheKey) -> bool:
        return (await self._present([self._name(key)]))[0]

    async def _batched_exists(self, keys: Sequence[CacheKey]) -> list[bool]:
        return await self._present([self._name(key) for key in keys])

    async def _present(self, names: list[str]) -> list[bool]:
        return await self._run(lambda: self._present_now(names))

    def _present_now(self, names: list[str]) -> list[bool]:
        """``batch_is_exist``; with ``probe``, each no checked by :meth:`_probe` (it says no
        while a value is overwritten), a value being written counting as present, as ``get``
        waits for it."""
        found: list[int] = self._store.batch_is_exist(names)
        for name, code in zip(names, found, strict=True):
            if code < 0:
                raise self._error(code, "contains", name)
        present = [code == 1 for code in found]
        if self.options.probe:
            doubtful = [i for i, there in enumerate(present) if not there]
            for i, there in zip(doubtful, self._probe([names[i] for i in doubtful]), strict=True):
                present[i] = there
        return present

    async def _remove(self, key: CacheKey) -> bool:
        return await self._remove_name(self._name(key), force=self.options.leased_remove == "force")

    @property
    def corrupt_objects(self) -> int:
        """:class:`~kvplug.backend.CountsCorruptObjects`: damaged values read as misses."""
        return self.damaged_values.count

    # -- the suite's look at stored bytes (clause 6) -----------------------------------------

    async def read_raw(self, key: CacheKey) -> bytes | None:
        """:class:`~kvplug.backend.RawValues`: the stored value of ``key`` as it is."""
        self.ensure_open()
        name = self._name(key)

        def read() -> bytes | None:
            size = self._stored_sizes([name]).get(name)
            if size is None:
                return None
            buffer = torch.empty(size, dtype=torch.uint8)
            assert self._registrations is not None
            with self._registrations.holding([(buffer.data_ptr(), size)]):
                code = self._store.batch_get_into([name], [buffer.data_ptr()], [size])[0]
            if code in codes.MISSES:
                return None
            self._check(code, "get", name)
            return bytes(buffer[:code].numpy().tobytes())

        return await self._run(read)

    async def write_raw(self, key: CacheKey, data: bytes) -> None:
        """:class:`~kvplug.backend.RawValues`: replace the stored value of ``key`` with
        ``data`` as it is."""
        self.ensure_open()
        name = self._name(key)
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8)

        def write() -> None:
            assert self._registrations is not None
            with self._registrations.holding([(buffer.data_ptr(), len(data))]):
                code = self._store.batch_upsert_from(
                    [name], [buffer.data_ptr()], [len(data)], self._config
                )[0]
            self._check(code, "put", name)

        await self._run(write)


__all__ = ["MooncakeBackend", "installed_version", "load_store_class"]
