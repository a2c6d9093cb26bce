"""``blackhole://``: the store that keeps nothing.

Every ``put`` succeeds without keeping the object, every ``get`` misses, ``contains`` is False
and ``remove`` finds nothing. Put it as the only tier to measure what the engine side costs
(copy kernels, keys, framing) without any store in the way, or as a tier that must never
serve data.

Example::

    >>> import asyncio, torch, kvplug
    >>> async def main():
    ...     hole = await kvplug.open_backend("blackhole://")
    ...     key = kvplug.CacheKey("llama", 1, 0, 7)
    ...     await hole.put(key, kvplug.MemoryObj.from_tensor(torch.ones(4)))
    ...     found = await hole.get(key)
    ...     await hole.close()
    ...     return found, hole.puts
    >>> asyncio.run(main())
    (None, 1)
"""

from __future__ import annotations

import threading
from typing import Any, ClassVar

from kvplug.backend import Backend, Capabilities
from kvplug.keys import CacheKey
from kvplug.memory import Allocator, MemoryObj
from kvplug.url import BackendURL


class BlackholeBackend(Backend):
    """Accepts every put and retains nothing; every read misses.

    It declares ``remove`` because ``remove`` works: it returns False, since nothing is ever
    stored, and ``releases_on_cancel`` because it never reads or writes an object's memory.
    Counters :attr:`puts`, :attr:`bytes_put` and :attr:`gets` show what reached it.
    """

    capabilities = Capabilities(remove=True, releases_on_cancel=True)
    # The clauses the contract suite cannot run here, and why (its verdict says "waived").
    contract_waivers: ClassVar[dict[int, str]] = {
        6: "stores nothing: there are no stored bytes to damage",
        9: "stores nothing: it never fills",
        10: "in-process: there is no server to pause or stop",
    }

    def __init__(
        self, url: BackendURL | str, *, allocator: Allocator | None = None, **options: Any
    ) -> None:
        super().__init__(url, allocator=allocator, **options)
        self._counter_lock = threading.Lock()
        self.puts = 0
        self.bytes_put = 0
        self.gets = 0

    def stats(self) -> dict[str, int]:
        with self._counter_lock:
            return {"puts": self.puts, "bytes_put": self.bytes_put, "gets": self.gets}

    async def _get(self, key: CacheKey) -> MemoryObj | None:
        with self._counter_lock:
            self.gets += 1
        return None

    async def _put(self, key: CacheKey, obj: MemoryObj) -> None:
        with self._counter_lock:
            self.puts += 1
            self.bytes_put += obj.nbytes

    async def _contains(self, key: CacheKey) -> bool:
        return False

    async def _remove(self, key: CacheKey) -> bool:
        return False


__all__ = ["BlackholeBackend"]
