"""infinistore:// without a server: options, error mapping, unreachable servers (with
InfiniStore's real client), and what the backend asks of the client (through the recording
stand-in of ``infinistore_standin``)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from infinistore_standin import RecordingConnection, StandInServer, check_signatures
from infinistore_standin import _bind as bind_to_real_client

import kvplug
from kvplug import CacheKey, FreeListAllocator, LayoutMismatch, MemoryObj
from kvplug.errors import (
    BackendError,
    BackendTimeout,
    BackendUnavailable,
    CapacityExceeded,
    InvalidBackendURL,
    UnknownOption,
)
from kvplug_infinistore.backend import (
    END_MARKER,
    InfiniStoreBackend,
    InfiniStoreOptions,
    client_config,
    error_code,
)

BOUND = 10.0
"""Seconds within which an unreachable server must be reported: a bound, not a benchmark."""
SMALL = {"max_value_size": "1MiB", "staging_size": "8MiB"}


@pytest.fixture
def server() -> Iterator[StandInServer]:
    standin = StandInServer()
    yield standin
    standin.close()


@pytest.fixture
def allocator() -> FreeListAllocator:
    return FreeListAllocator(64 << 20, pin=False)


def run(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


def key(n: int) -> CacheKey:
    return CacheKey("llama", 1, 0, n)


def obj(allocator: FreeListAllocator, seed: int, tokens: int = 16) -> MemoryObj:
    made = allocator.allocate((2, 2, tokens, 64), torch.float16)
    assert made is not None
    made.tensor.copy_(torch.arange(made.tensor.numel()).reshape(made.shape) % 251 + seed)
    return made


async def opened(server: StandInServer, allocator: FreeListAllocator, **options: Any) -> Any:
    return await kvplug.open_backend(
        server.url,
        allocator=allocator,
        connection_factory=server.connection_factory(),
        **{**SMALL, **options},
    )


# -- options ------------------------------------------------------------------------------------


def test_defaults_follow_lmcache_rdma_mlx5_0_ethernet() -> None:
    backend = InfiniStoreBackend("infinistore://cache:12345")
    options = backend.options
    assert (options.connection_type, options.device, options.ib_port) == ("rdma", "mlx5_0", 1)
    assert options.effective_link_type == "Ethernet"
    assert (backend.host, backend.port, backend.rdma) == ("cache", 12345, True)
    assert backend.capabilities.native_batching and backend.capabilities.remove
    assert backend.capabilities.shared_across_processes
    assert not backend.capabilities.persistent


def test_url_query_sets_every_option() -> None:
    backend = InfiniStoreBackend(
        "infinistore://h:1?connection_type=TCP&device=mlx5_3&ib_port=2&link_type=ib"
        "&max_value_size=64MiB&staging_size=256MiB&connect_timeout=1.5&workers=2"
        "&exact_contains=false&log_level=INFO&timeout=3"
    )
    options = backend.options
    assert options.connection_type == "tcp" and not backend.rdma
    assert (options.device, options.ib_port, options.effective_link_type) == ("mlx5_3", 2, "IB")
    assert (options.max_value_size, options.staging_size) == (64 << 20, 256 << 20)
    assert (options.connect_timeout, options.workers, options.timeout) == (1.5, 2, 3.0)
    assert options.exact_contains is False and options.log_level == "info"
    assert not backend.capabilities.native_batching  # no batched TCP calls in InfiniStore


def test_explicit_options_win_over_the_url() -> None:
    backend = InfiniStoreBackend("infinistore://h:1?device=mlx5_1", device="mlx5_2")
    assert backend.options.device == "mlx5_2"


@pytest.mark.parametrize(
    ("given", "expected"),
    [("LINK_ETHERNET", "Ethernet"), ("LINK_IB", "IB"), ("ETHERNET", "Ethernet"), ("Ib", "IB")],
)
def test_lmcache_link_type_name_and_values_are_accepted(given: str, expected: str) -> None:
    backend = InfiniStoreBackend(f"infinistore://h:1?infinistore_link_type={given}")
    assert backend.options.effective_link_type == expected


def test_lmcache_url_with_device_opens_unchanged() -> None:
    backend = InfiniStoreBackend("infinistore://10.0.0.2:12345?device=mlx5_1")
    assert backend.options.device == "mlx5_1" and backend.rdma


@pytest.mark.parametrize(
    ("query", "named"),
    [
        ("connection_type=udp", "connection_type"),
        ("ib_port=0", "ib_port"),
        ("link_type=token-ring", "link_type"),
        ("max_value_size=1KiB", "max_value_size"),
        ("max_value_size=3GiB", "max_value_size"),
        ("max_value_size=64MiB&staging_size=32MiB", "staging_size"),
        ("staging_size=lots", "staging_size"),
        ("link_type=IB&infinistore_link_type=LINK_ETHERNET", "disagree"),
        ("log_level=loud", "log_level"),
        ("workers=0", "workers"),
        ("connect_timeout=0", "connect_timeout"),
    ],
)
def test_bad_values_are_refused_naming_the_option(query: str, named: str) -> None:
    with pytest.raises(UnknownOption, match=named):
        InfiniStoreBackend(f"infinistore://h:1?{query}")


def test_an_unknown_option_gets_a_did_you_mean() -> None:
    with pytest.raises(UnknownOption, match="Did you mean 'device'"):
        InfiniStoreBackend("infinistore://h:1?devise=mlx5_0")


@pytest.mark.parametrize("url", ["infinistore://h", "infinistore://", "infinistore://a:1,b:2"])
def test_a_url_needs_exactly_one_host_and_port(url: str) -> None:
    with pytest.raises(InvalidBackendURL, match="HOST:PORT"):
        InfiniStoreBackend(url)


def test_client_config_is_one_the_real_client_accepts() -> None:
    import infinistore  # type: ignore[import-untyped]

    options = InfiniStoreOptions.model_validate({"link_type": "IB", "device": "mlx5_4"})
    config = client_config(options, "10.1.1.1", 4242)
    config.verify()
    assert (config.host_addr, config.service_port) == ("10.1.1.1", 4242)
    assert config.connection_type == infinistore.TYPE_RDMA
    assert (config.dev_name, config.ib_port, config.link_type) == ("mlx5_4", 1, "IB")
    tcp = client_config(InfiniStoreOptions.model_validate({"connection_type": "tcp"}), "h", 1)
    assert tcp.connection_type == infinistore.TYPE_TCP


def test_the_entry_point_serves_the_scheme() -> None:
    assert "infinistore" in kvplug.available_schemes()


# -- error mapping ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("message", "code"),
    [
        ("Failed to write to infinistore, ret = 507", 507),
        ("Failed to read to infinistore, ret = 400", 400),
        ("Failed to write to infinistore, ret = -1", -1),
        ("can't find a match", None),
        ("ret = ", None),
    ],
)
def test_error_code_reads_the_return_code_in_a_client_message(
    message: str, code: int | None
) -> None:
    assert error_code(Exception(message)) == code


@pytest.mark.parametrize("connection_type", ["rdma", "tcp"])
def test_out_of_memory_507_is_capacity_exceeded_with_the_code_and_a_fix(
    server: StandInServer, allocator: FreeListAllocator, connection_type: str
) -> None:
    server.capacity = 1024

    async def go() -> None:
        backend = await opened(server, allocator, connection_type=connection_type)
        big = obj(allocator, 1)
        try:
            with pytest.raises(CapacityExceeded, match=r"507.*--prealloc-size"):
                await backend.put(key(1), big)
            assert await backend.get(key(1)) is None  # reads keep working, same connection
        finally:
            big.release()
            await backend.close()

    run(go())


def test_a_value_larger_than_max_value_size_is_refused_before_sending(
    server: StandInServer, allocator: FreeListAllocator
) -> None:
    async def go() -> None:
        backend = await opened(server, allocator, max_value_size="64KiB", staging_size="1MiB")
        big = obj(allocator, 1, tokens=512)  # 256 KiB
        try:
            with pytest.raises(CapacityExceeded, match="max_value_size"):
                await backend.put(key(1), big)
        finally:
            big.release()
            await backend.close()
        assert not [c for c in server.calls if c[0] == "rdma_write_cache_async"]

    run(go())


def test_an_invalid_request_400_is_a_backend_error_naming_the_code(
    server: StandInServer, allocator: FreeListAllocator
) -> None:
    """A value written by another client, larger than this one's max_value_size: InfiniStore
    answers 400 to the read."""

    async def go() -> None:
        backend = await opened(server, allocator)
        try:
            name = backend.key_string(key(7))
            server.values[name] = b"x" * (2 << 20)
            with pytest.raises(BackendError, match=r"code 400.*max_value_size"):
                await backend.get(key(7))
        finally:
            await backend.close()

    run(go())


def test_a_lost_connection_is_backend_unavailable_and_the_next_call_reconnects(
    server: StandInServer, allocator: FreeListAllocator
) -> None:
    async def go() -> None:
        backend = await opened(server, allocator, reconnect_delay=0.01)
        try:
            server.epoch += 1  # the server restarted: the old connection is dead
            with pytest.raises(BackendUnavailable, match="connects again"):
                await backend.contains(key(1))
            assert await backend.contains(key(1)) is False  # a new connection
        finally:
            await backend.close()
        assert [c[0] for c in server.calls].count("connect") == 2

    run(go())


def test_no_rdma_device_fails_fast_with_a_fix(allocator: FreeListAllocator) -> None:
    """InfiniStore's real client on this machine (no RDMA device), against a port that
    accepts: its RDMA set-up fails, and the error says what to check."""
    with _MuteListener() as port:

        async def go() -> None:
            with pytest.raises(BackendUnavailable, match=r"ibv_devinfo.*connection_type=tcp"):
                await kvplug.open_backend(
                    f"infinistore://127.0.0.1:{port}", allocator=allocator, **SMALL
                )

        started = time.monotonic()
        run(go())
        assert time.monotonic() - started < BOUND


# -- unreachable servers (InfiniStore's real client) -------------------------------------------


def _closed_port() -> int:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = int(probe.getsockname()[1])
    probe.close()
    return port


class _MuteListener:
    """A loopback port that accepts connections (the kernel does) and never answers."""

    def __enter__(self) -> int:
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.socket.listen(16)
        return int(self.socket.getsockname()[1])

    def __exit__(self, *exc: object) -> None:
        self.socket.close()


@pytest.mark.parametrize("connection_type", ["rdma", "tcp"])
def test_a_closed_port_fails_fast_with_backend_unavailable(
    allocator: FreeListAllocator, connection_type: str
) -> None:
    port = _closed_port()

    async def go() -> None:
        with pytest.raises(BackendUnavailable, match=f"127.0.0.1:{port}.*Start the server"):
            await kvplug.open_backend(
                f"infinistore://127.0.0.1:{port}",
                allocator=allocator,
                connection_type=connection_type,
                **SMALL,
            )

    started = time.monotonic()
    run(go())
    assert time.monotonic() - started < BOUND


def test_a_server_that_never_answers_times_out_and_does_not_hang(
    allocator: FreeListAllocator,
) -> None:
    """InfiniStore's TCP connect succeeds against any listening port, and its first request
    then waits forever: the deadline turns that into BackendTimeout."""
    with _MuteListener() as port:

        async def go() -> None:
            try:
                backend = await kvplug.open_backend(
                    f"infinistore://127.0.0.1:{port}",
                    allocator=allocator,
                    connection_type="tcp",
                    timeout=1,
                    connect_timeout=1,
                )
            except (BackendTimeout, BackendUnavailable):
                return
            try:
                with pytest.raises(BackendTimeout, match="took longer than 1"):
                    await backend.contains(key(1))
            finally:
                await backend.close()

        started = time.monotonic()
        run(go())
        assert time.monotonic() - started < BOUND


def test_back_off_fails_fast_while_the_server_stays_away(allocator: FreeListAllocator) -> None:
    server = StandInServer()
    backend = InfiniStoreBackend(
        server.url,
        allocator=allocator,
        connection_factory=server.connection_factory(),
        reconnect_delay=30,
        **SMALL,
    )
    server.stop()

    async def go() -> None:
        with pytest.raises(BackendUnavailable, match="Start the server"):
            await backend.contains(key(1))
        started = time.monotonic()
        with pytest.raises(BackendUnavailable, match="next attempt is in"):
            await backend.contains(key(1))
        assert time.monotonic() - started < 1
        await backend.close()

    run(go())


# -- what the backend asks of the client (recording stand-in) ----------------------------------


def test_the_stand_in_has_every_method_of_the_real_client() -> None:
    assert check_signatures() == []


def test_rdma_registers_staging_once_and_batches_same_sized_objects(
    server: StandInServer, allocator: FreeListAllocator
) -> None:
    async def go() -> None:
        backend = await opened(server, allocator)
        objs = [obj(allocator, seed) for seed in range(4)]
        keys = [key(n) for n in range(4)]
        try:
            await backend.batched_put(keys, objs)
            got = await backend.batched_get(keys)
            for original, copy in zip(objs, got, strict=True):
                assert copy is not None and torch.equal(copy.tensor, original.tensor)
                copy.release()
            assert await backend.batched_contains(keys) == 4
        finally:
            for made in objs:
                made.release()
            await backend.close()

    run(go())
    names = [name for name, _ in server.calls]
    assert names.count("register_mr") == 1
    writes = [args for name, args in server.calls if name == "rdma_write_cache_async"]
    reads = [args for name, args in server.calls if name == "rdma_read_cache_async"]
    assert len(writes) == 1 and len(writes[0][0]) == 4  # one request, four blocks
    assert len(reads) == 1 and len(reads[0][0]) == 4
    frame_len = writes[0][1]
    stored = next(iter(server.values.values()))
    assert len(stored) == frame_len  # InfiniStore keeps block_size bytes: exactly the value
    magic, length = END_MARKER.unpack_from(stored, len(stored) - END_MARKER.size)
    assert (magic, length) == (b"KVPFEND1", len(stored) - END_MARKER.size)


def test_a_batched_read_with_an_absent_key_reads_the_rest_one_by_one(
    server: StandInServer, allocator: FreeListAllocator
) -> None:
    async def go() -> list[bool]:
        backend = await opened(server, allocator)
        made = obj(allocator, 3)
        try:
            await backend.put(key(1), made)
            got = await backend.batched_get([key(1), key(2)])
            found = [item is not None for item in got]
            for item in got:
                if item is not None:
                    item.release()
            return found
        finally:
            made.release()
            await backend.close()

    assert run(go()) == [True, False]


def test_tcp_uses_tcp_calls_only(server: StandInServer, allocator: FreeListAllocator) -> None:
    async def go() -> None:
        backend = await opened(server, allocator, connection_type="tcp")
        made = obj(allocator, 5)
        try:
            await backend.put(key(1), made)
            got = await backend.get(key(1))
            assert got is not None and torch.equal(got.tensor, made.tensor)
            got.release()
            assert await backend.get(key(2)) is None
            assert await backend.remove(key(1)) is True
            assert await backend.remove(key(1)) is False
        finally:
            made.release()
            await backend.close()

    run(go())
    names = {name for name, _ in server.calls}
    assert {"tcp_write_cache", "tcp_read_cache", "delete_keys"} <= names
    assert not names & {"register_mr", "rdma_write_cache_async", "rdma_read_cache_async"}


def test_a_tcp_and_an_rdma_client_read_each_others_values(
    server: StandInServer, allocator: FreeListAllocator
) -> None:
    async def go() -> None:
        rdma = await opened(server, allocator)
        tcp = await opened(server, allocator, connection_type="tcp")
        made = obj(allocator, 9)
        try:
            await rdma.put(key(1), made)
            await tcp.put(key(2), made)
            for reader, n in ((tcp, 1), (rdma, 2)):
                got = await reader.get(key(n))
                assert got is not None and torch.equal(got.tensor, made.tensor)
                got.release()
        finally:
            made.release()
            await rdma.close()
            await tcp.close()

    run(go())


@pytest.mark.parametrize("exact", [True, False])
def test_batched_contains_counts_the_prefix_even_where_the_binary_search_does_not(
    server: StandInServer, allocator: FreeListAllocator, exact: bool
) -> None:
    """Present, absent, present, present: InfiniStore's binary search reports 4; the exact
    mode checks and counts 1, the trusting mode keeps the server's answer."""

    async def go() -> int:
        backend = await opened(server, allocator, exact_contains=exact)
        made = obj(allocator, 2)
        try:
            for n in (0, 2, 3):
                await backend.put(key(n), made)
            return int(await backend.batched_contains([key(n) for n in range(4)]))
        finally:
            made.release()
            await backend.close()

    assert run(go()) == (1 if exact else 4)


def test_get_into_reserves_only_the_callers_size(
    server: StandInServer, allocator: FreeListAllocator
) -> None:
    async def go() -> list[bool]:
        backend = await opened(server, allocator)
        made, small = obj(allocator, 4), obj(allocator, 0, tokens=8)
        dest = obj(allocator, 0)
        try:
            await backend.put(key(1), made)
            hits = [
                await backend.get_into(key(1), dest),
                bool(torch.equal(dest.tensor, made.tensor)),
            ]
            with pytest.raises(LayoutMismatch, match="get_into's buffer is"):
                await backend.get_into(key(1), small)  # the stored value is larger
            return hits
        finally:
            for item in (made, small, dest):
                item.release()
            await backend.close()

    assert run(go()) == [True, True]
    rooms = [args[1] for name, args in server.calls if name == "rdma_read_cache_async"]
    # Only the caller's size for a read into the caller's memory; a larger stored value is read
    # once more, with room for any value, to name its layout.
    assert max(rooms[:-1]) < (1 << 20) <= rooms[-1]


def test_a_value_cut_short_is_a_counted_deleted_miss_even_with_stale_staging(
    server: StandInServer, allocator: FreeListAllocator
) -> None:
    """An RDMA read writes only the stored bytes; the rest of the staging block still holds
    the last value read there. The end marker (wiped after every read) tells them apart."""

    async def go() -> None:
        backend = await opened(server, allocator)
        made = obj(allocator, 6)
        try:
            await backend.put(key(1), made)
            first = await backend.get(key(1))
            assert first is not None
            first.release()
            name = backend.key_string(key(1))
            server.values[name] = server.values[name][: len(server.values[name]) // 2]
            assert await backend.get(key(1)) is None
            assert backend.corrupt_objects == 1
            assert name not in server.values  # deleted
        finally:
            made.release()
            await backend.close()

    run(go())


def test_a_connection_with_wrong_arguments_is_caught_by_the_stand_in() -> None:
    """The stand-in binds every call against the real client's signature and verifies the
    config as the real client does."""
    import infinistore

    standin = StandInServer()
    try:
        config = infinistore.ClientConfig(
            host_addr="127.0.0.1", service_port=standin.port, connection_type="TCP"
        )
        conn = RecordingConnection(config, standin)
        conn.connect()
        with pytest.raises(TypeError):
            bind_to_real_client("tcp_write_cache", "k", 1)  # size missing
        with pytest.raises(TypeError):
            bind_to_real_client("rdma_read_cache_async", [("k", 0)], 4096, ptr=1, extra=2)
        with pytest.raises(Exception, match="Invalid connection type"):
            RecordingConnection(
                infinistore.ClientConfig(host_addr="h", service_port=1, connection_type="UDP"),
                standin,
            )
    finally:
        standin.close()
