"""What the Mooncake test modules share: a master with a node lending memory, a plain client
of it, the wait for the store to take writes again after the master restarted, emptying it;
the allocator fixture, and the objects and keys the tests put there."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import pytest
import torch

import kvplug
from kvplug.memory import FreeListAllocator, MemoryObj
from kvplug_testing.mooncake import MooncakeMaster, MooncakeNode

T = TypeVar("T")
MiB = 1 << 20
SHAPE = (2, 4, 256, 64)  # 256 KiB of fp16


@pytest.fixture
def allocator() -> FreeListAllocator:
    """128 MiB for a test's objects. A module takes it in by name (``from mooncake_helpers
    import allocator as allocator``): in conftest.py it would replace the contract suite's
    ``allocator`` too, which checks clause 5 and holds the suite's largest objects."""
    return FreeListAllocator(128 * MiB, pin=False)


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coroutine)


def filled(allocator: FreeListAllocator, seed: int, shape: tuple[int, ...] = SHAPE) -> MemoryObj:
    """An fp16 object of ``shape`` in ``allocator``'s memory, holding values drawn from
    ``seed``."""
    obj = allocator.allocate(shape, torch.float16)
    assert obj is not None
    obj.tensor.copy_(torch.randn(shape, generator=torch.Generator().manual_seed(seed)))
    return obj


def key(n: int, model: str = "mooncake-tests") -> kvplug.CacheKey:
    return kvplug.CacheKey(model, 1, 0, n)


def release(*objs: MemoryObj | None) -> None:
    """Release each of ``objs`` that is an object (a get's None is skipped)."""
    for obj in objs:
        if obj is not None:
            obj.release()


@contextmanager
def mooncake_store(
    segment: str = "1GiB", *, http_metadata: bool = False, master_args: tuple[str, ...] = ()
) -> Iterator[MooncakeMaster]:
    """A master and one node lending ``segment`` of memory; yields the master."""
    with (
        MooncakeMaster(master_args, http_metadata=http_metadata) as master,
        MooncakeNode(master, segment),
    ):
        yield master


@contextmanager
def probe_client(master: MooncakeMaster) -> Iterator[Any]:
    """A plain Mooncake client of ``master`` that lends no memory."""
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    code = client.setup(
        {
            "local_hostname": master.host,
            "metadata_server": master.metadata_server,
            "global_segment_size": 0,
            "local_buffer_size": 1 << 20,
            "protocol": "tcp",
            "master_server_addr": master.address,
        }
    )
    assert code == 0, f"a probe client could not set up against {master.address}: {code}"
    try:
        yield client
    finally:
        client.close()


def wait_until_writable(master: MooncakeMaster, limit: float = 60.0) -> None:
    """Return once a put into the store succeeds (after a restart the node remounts its
    segment at its next ping)."""
    with probe_client(master) as client:
        deadline = time.monotonic() + limit
        while client.upsert("kvplug-probe", b"x" * 64) != 0:
            assert time.monotonic() < deadline, "the store took no write after its restart"
            time.sleep(0.2)
        client.remove("kvplug-probe", force=True)


def empty_store(master: MooncakeMaster) -> None:
    """Remove every object, leases or not: a test that filled the store leaves it full until
    the master's next eviction round, which a busy machine delays."""
    with probe_client(master) as client:
        removed = client.remove_all(force=True)
        assert removed >= 0, f"remove_all on {master.address} failed: {removed}"
