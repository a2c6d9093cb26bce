"""``mooncakestore://`` beyond the contract suite, against a real ``mooncake_master``: options
(kvplug's, Mooncake's and LMCache's names, LMCache's JSON file), a master that is down or
silent, a Mooncake client without the calls needed, the zero-copy path (nothing copied for
allocator objects), overwrites, leases, a full store, and a second process."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from mooncake_helpers import SHAPE, MiB, filled, key, mooncake_store, probe_client, release, run
from mooncake_helpers import allocator as allocator

import kvplug
from kvplug.errors import (
    BackendUnavailable,
    CapacityExceeded,
    ConfigError,
    LayoutMismatch,
    UnknownOption,
)
from kvplug.frame import payload_checksum
from kvplug.memory import FreeListAllocator, MemoryObj
from kvplug_mooncake import codes
from kvplug_mooncake.backend import MooncakeBackend
from kvplug_mooncake.overlap import checksum, sharing_the_gil
from kvplug_testing.mooncake import MooncakeMaster, MooncakeNode
from kvplug_testing.ports import free_port

LEASE = "2000"  # ms: the lease a read takes, short so that a waiting remove ends soon


@pytest.fixture(scope="module")
def store() -> Iterator[MooncakeMaster]:
    with mooncake_store("512MiB", master_args=(f"--default_kv_lease_ttl={LEASE}",)) as master:
        yield master


async def opened(url: str, allocator: FreeListAllocator, **options: Any) -> MooncakeBackend:
    backend = await kvplug.open_backend(url, allocator=allocator, **options)
    assert isinstance(backend, MooncakeBackend)
    return backend


# -- options -----------------------------------------------------------------------------------


def test_options_take_lmcache_and_mooncake_names_from_the_url_and_config() -> None:
    backend = MooncakeBackend(
        "mooncakestore://10.0.0.5:50051?device_name=mlx5_1&protocol=RDMA&global_segment_size=2GiB",
        transfer_timeout=3,
        rdma_devices="mlx5_2",  # explicit wins over the URL
        local_buffer_size="32MiB",
    )
    options = backend.options
    assert backend.master == "10.0.0.5:50051"
    assert options.device == "mlx5_2" and options.protocol == "rdma" and options.timeout == 3
    assert options.global_segment_size == 2 << 30 and options.local_buffer_size == 32 * MiB
    assert options.metadata_server == "P2PHANDSHAKE" and options.leased_remove == "force"


def test_lmcache_json_config_is_read_from_mooncake_config_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "mooncake.json"
    config.write_text(
        json.dumps(
            {
                "local_hostname": "10.0.0.9",
                "metadata_server": "http://10.0.0.5:8080/metadata",
                "master_server_address": "10.0.0.5:50051",
                "global_segment_size": 3355443200,
                "local_buffer_size": 1073741824,
                "protocol": "tcp",
                "device_name": "",
                "transfer_timeout": 1,
            }
        )
    )
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(config))
    backend = MooncakeBackend("mooncakestore://?replica_num=2")
    assert backend.master == "10.0.0.5:50051"  # from the file: the URL names no host
    options = backend.options
    assert options.local_hostname == "10.0.0.9" and options.timeout == 1
    assert options.metadata_server == "http://10.0.0.5:8080/metadata"
    assert options.replica_num == 2 and options.config_file == str(config)
    # the URL's host:port wins over the file's master, as in LMCache
    assert MooncakeBackend("mooncakestore://10.0.0.6:50052").master == "10.0.0.6:50052"


@pytest.mark.parametrize(
    ("url", "options", "error", "says"),
    [
        ("mooncakestore://h:1", {"storage_root_dir": "/ssd"}, ConfigError, "SSD offload"),
        ("mooncakestore://h:1", {"serde": "cachegen"}, UnknownOption, "no 'serde' option"),
        ("mooncakestore://h:1", {"protocol": "efa"}, UnknownOption, "protocol"),
        ("mooncakestore://h:1", {"global_segment_size": "lots"}, UnknownOption, "size"),
        ("mooncakestore://h:1", {"leased_remove": "ignore"}, UnknownOption, "leased_remove"),
        ("mooncakestore://h:1", {"shards": 2}, UnknownOption, "Valid options"),
        ("mooncakestore://", {}, ConfigError, "names no Mooncake master"),
    ],
)
def test_bad_options_are_refused_with_the_fix(
    url: str, options: dict[str, Any], error: type[Exception], says: str
) -> None:
    with pytest.raises(error, match=says):
        MooncakeBackend(url, **options)


@pytest.mark.parametrize(
    ("content", "says"), [("{not json", "not valid JSON"), ("[1, 2]", "holds a list")]
)
def test_a_bad_config_file_is_named(tmp_path: Path, content: str, says: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=says):
        MooncakeBackend("mooncakestore://h:1", config_file=str(path))
    with pytest.raises(ConfigError, match="cannot read"):
        MooncakeBackend("mooncakestore://h:1", config_file=str(tmp_path / "missing.json"))


def test_every_code_maps_to_an_error_that_names_it() -> None:
    url = "mooncakestore://h:1"
    full = codes.error_for(-200, "put", "k", url)
    assert isinstance(full, CapacityExceeded) and "-200 (NO_AVAILABLE_HANDLE)" in str(full)
    too_large = codes.error_for(-600, "put", "k", url)
    assert isinstance(too_large, CapacityExceeded) and "larger than any segment" in str(too_large)
    slow = codes.error_for(-901, "get", "k", url)
    assert isinstance(slow, kvplug.errors.BackendTimeout) and "RPC_TIMEOUT" in str(slow)
    for code in (-900, -101, -103, -800, -1, -12345):
        error = codes.error_for(code, "get", "k", url)
        assert isinstance(error, BackendUnavailable) and f"{code} (" in str(error)


@pytest.mark.parametrize("size", [0, 5, 2 * MiB, 2 * MiB + 1, 33 * MiB + 7])
def test_the_checksum_fed_in_pieces_is_the_frames_checksum(size: int) -> None:
    payload = memoryview(torch.randint(0, 256, (size,), dtype=torch.uint8).numpy()).cast("B")
    found: list[int] = []
    sharing_the_gil(lambda: found.append(checksum(payload)))  # in pieces
    assert found == [checksum(payload)] == [payload_checksum(payload)]


# -- open: the master down, silent, or the client lacking calls -------------------------------


def test_a_master_that_is_down_fails_open_at_once() -> None:
    port = free_port()  # nothing listens there
    started = time.monotonic()
    with pytest.raises(BackendUnavailable, match=f"no Mooncake master answers at 127.0.0.1:{port}"):
        run(kvplug.open_backend(f"mooncakestore://127.0.0.1:{port}?global_segment_size=0"))
    assert time.monotonic() - started < 5


def test_a_silent_master_fails_open_within_connect_timeout() -> None:
    """A port that accepts and never answers: Mooncake's setup would block 90 s."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        port = silent.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(BackendUnavailable, match=r"did not answer within 2\.0 s"):
            run(
                kvplug.open_backend(
                    f"mooncakestore://127.0.0.1:{port}?global_segment_size=0&connect_timeout=2"
                )
            )
        assert time.monotonic() - started < 10


def test_a_paused_master_fails_open_within_connect_timeout() -> None:
    with MooncakeMaster() as master:
        master.pause()
        started = time.monotonic()
        with pytest.raises(BackendUnavailable, match="paused or overloaded"):
            run(kvplug.open_backend(master.url(global_segment_size=0, connect_timeout=2)))
        assert time.monotonic() - started < 10
        master.resume()
        backend = run(kvplug.open_backend(master.url(global_segment_size=0)))
        run(backend.close())


def test_a_client_without_the_zero_copy_calls_is_refused_naming_its_version(
    store: MooncakeMaster, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mooncake.store

    real = mooncake.store.MooncakeDistributedStore
    old = type(
        "OldStore",
        (),
        {name: getattr(real, name) for name in dir(real) if name != "batch_put_from_multi_buffers"},
    )
    monkeypatch.setattr(mooncake.store, "MooncakeDistributedStore", old)
    with pytest.raises(BackendUnavailable) as refused:
        run(kvplug.open_backend(store.url(global_segment_size=0)))
    message = str(refused.value)
    assert "batch_put_from_multi_buffers" in message
    assert "mooncake-transfer-engine-non-cuda 0.3.13" in message


# -- the zero-copy path ----------------------------------------------------------------------


def test_allocator_objects_move_without_a_copy_or_a_registration_per_call(
    store: MooncakeMaster, allocator: FreeListAllocator
) -> None:
    async def scenario() -> None:
        backend = await opened(store.url(global_segment_size=0), allocator)
        objs = [filled(allocator, seed) for seed in range(4)]
        keys = [key(100 + i) for i in range(4)]
        await backend.put(keys[0], objs[0])
        await backend.batched_put(keys[1:], objs[1:])
        got = await backend.batched_get(keys)
        dests = [allocator.allocate(SHAPE, torch.float16) for _ in keys]
        assert all(d is not None for d in dests)
        hits = await backend.batched_get_into(keys, dests)  # type: ignore[arg-type]
        base = allocator.buffer.data_ptr()
        for obj, read, dest in zip(objs, got, dests, strict=True):
            assert read is not None and torch.equal(read.tensor, obj.tensor)
            # the payload was returned where it was received: in the allocator's buffer
            assert base <= read.data_ptr() < base + allocator.capacity
            assert dest is not None and torch.equal(dest.tensor, obj.tensor)
        assert hits == [True] * 4
        registrations = backend._registrations
        assert registrations is not None and registrations.temporary_registrations == 0
        assert backend.copied_overwrites == 0
        assert "allocator buffer and header slab registered" in backend.describe()["zero_copy"]
        for obj in [*objs, *got, *dests]:
            assert obj is not None
            obj.release()
        await backend.close()

    run(scenario())
    assert allocator.stats().used == 0


def test_memory_outside_the_allocator_is_registered_for_the_call_not_copied(
    store: MooncakeMaster, allocator: FreeListAllocator
) -> None:
    async def scenario() -> None:
        backend = await opened(store.url(global_segment_size=0), allocator)
        source = torch.randn(SHAPE, generator=torch.Generator().manual_seed(7)).half()
        outside = MemoryObj.from_tensor(source)  # an engine's own tensor
        await backend.put(key(200), outside)
        dest = MemoryObj.from_tensor(torch.zeros(SHAPE, dtype=torch.float16))
        assert await backend.get_into(key(200), dest)
        assert torch.equal(dest.tensor, source)
        registrations = backend._registrations
        assert registrations is not None and registrations.temporary_registrations == 2
        assert backend.copied_overwrites == 0
        await backend.close()

    run(scenario())


def test_get_into_a_buffer_of_another_rank_or_size(
    store: MooncakeMaster, allocator: FreeListAllocator
) -> None:
    """Every value's header region has one length: a flat destination of the same size is
    read like one of the stored rank; one of another size raises LayoutMismatch naming both
    layouts, and stays the caller's."""

    async def scenario() -> None:
        backend = await opened(store.url(global_segment_size=0), allocator)
        obj = filled(allocator, 11)
        await backend.put(key(300), obj)
        flat = allocator.allocate((obj.nbytes,), torch.uint8)
        short = allocator.allocate((obj.nbytes // 2,), torch.uint8)
        assert flat is not None and short is not None
        assert await backend.get_into(key(300), flat)
        assert torch.equal(flat.raw, obj.raw)
        with pytest.raises(LayoutMismatch, match="get_into's buffer is"):
            await backend.get_into(key(300), short)
        assert short.ref_count == 1
        assert await backend.get_into(key(300), obj)  # and its own rank
        for each in (obj, flat, short):
            each.release()
        await backend.close()

    run(scenario())


# -- overwrites, duplicates, leases ---------------------------------------------------------


def test_an_overwrite_replaces_the_value_with_one_copy(
    store: MooncakeMaster, allocator: FreeListAllocator
) -> None:
    async def scenario() -> None:
        backend = await opened(store.url(global_segment_size=0), allocator)
        first, second = filled(allocator, 1), filled(allocator, 2, (2, 8, 256, 64))
        await backend.put(key(400), first)
        await backend.put(key(400), second)  # Mooncake's put would keep the first
        got = await backend.get(key(400))
        assert got is not None and got.shape == second.shape
        assert torch.equal(got.tensor, second.tensor)
        assert backend.copied_overwrites == 1
        await backend.batched_put([key(401), key(401)], [first, second])  # the last one wins
        again = await backend.batched_get([key(401), key(401)])
        assert all(g is not None and torch.equal(g.tensor, second.tensor) for g in again)
        for each in (first, second, got, *again):
            assert each is not None
            each.release()
        await backend.close()

    run(scenario())
    assert allocator.stats().used == 0


@pytest.mark.parametrize("leased_remove", ["force", "wait"])
def test_a_remove_refused_by_a_lease_is_forced_or_waited_out_never_faked(
    store: MooncakeMaster, allocator: FreeListAllocator, leased_remove: str
) -> None:
    async def scenario() -> float:
        backend = await opened(
            store.url(global_segment_size=0), allocator, leased_remove=leased_remove
        )
        obj = filled(allocator, 3)
        await backend.put(key(500), obj)
        got = await backend.get(key(500))  # the read takes a lease on the key
        with probe_client(store) as raw:
            name = backend._name(key(500))
            assert raw.remove(name) == codes.OBJECT_HAS_LEASE  # the lease is there
            started = time.monotonic()
            assert await backend.remove(key(500)) is True
            took = time.monotonic() - started
            assert not await backend.contains(key(500))
            assert raw.batch_is_exist([name]) == [0]
            assert await backend.remove(key(500)) is False
        for each in (obj, got):
            assert each is not None
            each.release()
        await backend.close()
        return took

    took = run(scenario())
    if leased_remove == "force":
        assert took < 1.0
    else:
        assert took > 0.2  # it waited for the lease to end (LEASE ms after the read)


# -- a full store ----------------------------------------------------------------------------


def test_a_store_too_small_refuses_or_evicts_and_never_serves_a_wrong_value(
    allocator: FreeListAllocator,
) -> None:
    with mooncake_store("16MiB") as small:

        async def scenario() -> None:
            backend = await opened(small.url(global_segment_size=0), allocator)
            huge = allocator.allocate((24 * MiB,), torch.uint8)
            assert huge is not None
            with pytest.raises(CapacityExceeded, match=r"-(200|600) \("):
                await backend.put(key(600), huge)
            huge.release()
            objs = [filled(allocator, seed, (2, 8, 256, 128)) for seed in range(24)]  # 1 MiB
            refused = 0
            for i, obj in enumerate(objs):
                try:
                    await backend.put(key(700 + i), obj)
                except CapacityExceeded:
                    refused += 1
            found = await backend.batched_get([key(700 + i) for i in range(len(objs))])
            kept = [i for i, got in enumerate(found) if got is not None]
            assert refused or len(kept) < len(objs), "24 MiB fit in a 16 MiB store"
            for i in kept:
                got = found[i]
                assert got is not None and torch.equal(got.tensor, objs[i].tensor)
            for obj in [*objs, *(f for f in found if f is not None)]:
                obj.release()
            await backend.close()

        run(scenario())
    assert allocator.stats().used == 0


# -- another process -------------------------------------------------------------------------

WRITER = textwrap.dedent(
    """
    import asyncio, sys, time, torch, kvplug

    async def main(url, count, linger):
        backend = await kvplug.open_backend(url)
        for i in range(count):
            data = torch.randn((2, 4, 256, 64), generator=torch.Generator().manual_seed(i))
            await backend.put(kvplug.CacheKey("mooncake-writer", 1, 0, i),
                              kvplug.MemoryObj.from_tensor(data.half()))
        print("written", flush=True)
        if linger:
            sys.stdin.readline()
        await backend.close()

    asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3] == "linger"))
    """
)


def _expected(i: int) -> torch.Tensor:
    return torch.randn((2, 4, 256, 64), generator=torch.Generator().manual_seed(i)).half()


def _writer(url: str, count: int, linger: bool) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, "-c", WRITER, url, str(count), "linger" if linger else "exit"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "written"
    return process


async def _read_back(url: str, allocator: FreeListAllocator, count: int) -> list[bool | None]:
    """For each of the writer's keys: True (bit-exact), None (a miss); never a wrong value."""
    backend = await opened(url, allocator)
    found = await backend.batched_get([key(i, "mooncake-writer") for i in range(count)])
    results: list[bool | None] = []
    for i, got in enumerate(found):
        results.append(None if got is None else torch.equal(got.tensor, _expected(i)))
        if got is not None:
            got.release()
    await backend.close()
    return results


def test_what_one_process_writes_another_reads(
    store: MooncakeMaster, allocator: FreeListAllocator
) -> None:
    writer = _writer(store.url(global_segment_size=0), 6, linger=False)
    assert writer.wait(60) == 0
    assert run(_read_back(store.url(global_segment_size=0), allocator, 6)) == [True] * 6


def test_objects_in_a_writers_own_segment_go_with_it_as_misses(
    allocator: FreeListAllocator,
) -> None:
    """No node: the writer lends the only segment, so its objects live in its memory."""
    with MooncakeMaster() as master:
        writer = _writer(master.url(global_segment_size=64 * MiB), 4, linger=True)
        try:
            url = master.url(global_segment_size=0)
            assert run(_read_back(url, allocator, 4)) == [True] * 4
        finally:
            assert writer.stdin is not None
            writer.stdin.write("\n")
            writer.stdin.flush()
            assert writer.wait(60) == 0
        assert run(_read_back(url, allocator, 4)) == [None] * 4


def test_a_node_is_what_keeps_objects_after_their_writer_left(
    allocator: FreeListAllocator,
) -> None:
    with MooncakeMaster() as master, MooncakeNode(master, "64MiB"):
        writer = _writer(master.url(global_segment_size=0), 4, linger=False)
        assert writer.wait(60) == 0
        assert run(_read_back(master.url(global_segment_size=0), allocator, 4)) == [True] * 4


def test_the_sealing_wrapper_keeps_only_ciphertext_in_mooncake(
    store: MooncakeMaster, allocator: FreeListAllocator, tmp_path: Path
) -> None:
    """``aesgcm::mooncakestore://``: encryption at rest composes with Mooncake (kvplug-aesgcm's
    wrapper: Mooncake stores objects, not frames, so it takes the wrapper, not the serde)."""
    from kvplug_aesgcm.keyring import new_entry

    keys = tmp_path / "keys"
    keys.write_text(new_entry(1) + "\n")
    keys.chmod(0o600)
    url = f"aesgcm://?key_file={keys}::{store.url(global_segment_size=0)}"
    obj = filled(allocator, 3)

    async def scenario() -> None:
        backend = await kvplug.open_backend(url, allocator=allocator)
        await backend.put(key(500), obj)
        sealed = await backend.inner.get(key(500))  # type: ignore[attr-defined]
        assert sealed is not None and sealed.dtype == torch.uint8
        assert sealed.nbytes > obj.nbytes
        assert bytes(obj.memoryview()[:256]) not in bytes(sealed.memoryview())
        got = await backend.get(key(500))
        assert got is not None and torch.equal(got.tensor, obj.tensor)
        release(sealed, got)
        await backend.close()

    run(scenario())
    obj.release()
    assert allocator.stats().used == 0
