"""The lm:// client (kvplug_lm.backend) against real servers on 127.0.0.1: ``kvplug
lm-server`` (a subprocess, or in-process with ``run_in_thread`` where a test needs options
such as a secret) and LMCache 0.5.6's ``lmcache_server`` (skipped when its venv is absent)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
import torch
from lm_client_helpers import SHAPES, key, opened, random_obj, run, same

from kvplug.errors import (
    BackendTimeout,
    BackendUnavailable,
    CapacityExceeded,
    ConfigError,
    LayoutMismatch,
    NotSupported,
    UnknownOption,
)
from kvplug.memory import KV_DTYPES, FreeListAllocator, MemoryObj
from kvplug_contracts.faultproxy import FaultProxy
from kvplug_lm import wire
from kvplug_lm.backend import (
    DEFAULT_PORT,
    ESCAPED_KEY_MARK,
    LMBackend,
    LMOptions,
    decode_key,
    encode_key,
)
from kvplug_lm.server import ServerOptions, run_in_thread
from kvplug_testing.lm import LMCACHE_ABSENT, LMServerProcess, lmcache_python

T = TypeVar("T")

LMCACHE_PYTHON = lmcache_python()
needs_lmcache = pytest.mark.skipif(
    LMCACHE_PYTHON is None,
    reason=LMCACHE_ABSENT,
)

RECOVERY_LIMIT = 30.0


async def eventually(operation: Callable[[], Awaitable[T]]) -> T:
    """``operation``'s result once it stops raising BackendUnavailable (a reconnect)."""
    started = time.monotonic()
    while True:
        try:
            return await operation()
        except BackendUnavailable:
            if time.monotonic() - started > RECOVERY_LIMIT:
                raise
        await asyncio.sleep(0.1)


@pytest.fixture(scope="module")
def lm_server() -> Iterator[LMServerProcess]:
    with LMServerProcess(["--max-memory", "256MiB"]) as server:
        yield server


@pytest.fixture
def restartable_server() -> Iterator[LMServerProcess]:
    with LMServerProcess(["--max-memory", "64MiB"]) as server:
        yield server


# -- options and URLs ---------------------------------------------------------------------


def test_options_come_from_the_url_query_as_strings() -> None:
    backend = LMBackend(
        "lm://127.0.0.1:7000?connections=3&connect_timeout=1.5&mode=plain&checksums=false"
        "&reconnect_delay=0.2&reconnect_max_delay=4&key_prefix=team-a/&timeout=3"
    )
    options = backend.options
    assert isinstance(options, LMOptions)
    assert (options.connections, options.connect_timeout, options.mode) == (3, 1.5, "plain")
    assert (options.checksums, options.reconnect_delay, options.reconnect_max_delay) == (
        False,
        0.2,
        4.0,
    )
    assert (options.key_prefix, options.timeout) == ("team-a/", 3.0)
    assert backend.address == "127.0.0.1:7000"


def test_a_url_without_port_uses_lmcaches_default_port() -> None:
    assert LMBackend("lm://cache.internal").address == f"cache.internal:{DEFAULT_PORT}"


def test_unknown_and_invalid_options_are_rejected_with_the_valid_names() -> None:
    with pytest.raises(UnknownOption, match="connections"):
        LMBackend("lm://127.0.0.1:7000?conections=2")
    with pytest.raises(UnknownOption, match="mode"):
        LMBackend("lm://127.0.0.1:7000?mode=fast")


def test_an_lmcache_config_with_remote_url_lm_opens_with_its_serde_and_an_unknown_one_fails(
    tmp_path: Path,
) -> None:
    from kvplug.runtime.config import load_config

    config = tmp_path / "lmcache.yaml"
    for serde in ("naive", "zstd"):
        config.write_text(
            f"chunk_size: 256\nremote_url: lm://127.0.0.1:7000\nremote_serde: {serde}\n"
        )
        tier = load_config(config, env={}).tiers[-1]
        assert LMBackend(tier.url, **tier.options).serde.name == serde
    config.write_text("chunk_size: 256\nremote_url: lm://127.0.0.1:7000\nremote_serde: cachegen\n")
    tier = load_config(config, env={}).tiers[-1]
    with pytest.raises(ConfigError, match=r"unknown serde 'cachegen'.*use 'naive'"):
        LMBackend(tier.url, **tier.options)


def test_the_secret_is_masked_in_reprs_and_errors() -> None:
    backend = LMBackend("lm://127.0.0.1:7000?secret=hunter2-lm")
    assert backend.options.secret == "hunter2-lm"
    assert "hunter2-lm" not in repr(backend.options)
    assert "hunter2-lm" not in repr(backend)
    with pytest.raises(UnknownOption) as error:
        LMBackend("lm://127.0.0.1:7000?secret=hunter2-lm&connections=0")
    assert "hunter2-lm" not in str(error.value)


def test_an_unreachable_server_is_unavailable_naming_host_and_port() -> None:
    from kvplug_testing.ports import free_port

    port = free_port()
    with pytest.raises(BackendUnavailable, match=rf"127\.0\.0\.1:{port}.*refused"):
        run(opened(f"lm://127.0.0.1:{port}"))


# -- detecting the server -------------------------------------------------------------------


def test_hello_finds_kvplugs_server_and_the_extended_mode(lm_server: LMServerProcess) -> None:
    async def check() -> None:
        backend = await opened(lm_server.url)
        try:
            assert backend.mode == "extended"
            assert backend.describe()["mode"] == "extended"
            assert "kvplug lm-server" in backend.describe()["server"]
            assert backend.capabilities.remove and backend.capabilities.list_keys
            assert backend.capabilities.native_batching
        finally:
            await backend.close()

    run(check())


def test_mode_plain_speaks_lmcaches_protocol_to_kvplugs_server(
    lm_server: LMServerProcess,
) -> None:
    async def check() -> None:
        backend = await opened(lm_server.url, mode="plain")
        obj = random_obj((2, 2, 8, 16), seed=1)
        try:
            assert backend.mode == "plain" and not backend.capabilities.remove
            await backend.put(key(1, "plainmode"), obj)
            assert same(obj, await backend.get(key(1, "plainmode")))
            with pytest.raises(NotSupported):
                await backend.remove(key(1, "plainmode"))
        finally:
            await backend.close()

    run(check())


@needs_lmcache
def test_hello_finds_lmcaches_server_and_the_plain_mode(lmcache_server: LMServerProcess) -> None:
    async def check() -> None:
        backend = await opened(lmcache_server.url)
        try:
            assert backend.mode == "plain"
            assert backend.describe() == {
                "mode": "plain",
                "server": "LMCache lmcache_server (plain protocol)",
            }
            assert not backend.capabilities.remove and not backend.capabilities.list_keys
            with pytest.raises(NotSupported):
                await backend.remove(key(1))
            with pytest.raises(NotSupported):
                backend.list_keys()
        finally:
            await backend.close()

    run(check())


@needs_lmcache
def test_mode_extended_fails_clearly_against_lmcaches_server(
    lmcache_server: LMServerProcess,
) -> None:
    with pytest.raises(ConfigError, match="not a kvplug lm-server"):
        run(opened(lmcache_server.url, mode="extended"))


# -- the plain mode through lmcache_server --------------------------------------------------


@needs_lmcache
@pytest.mark.parametrize("dtype_name", sorted(KV_DTYPES))
def test_plain_round_trips_through_lmcache_server_are_bit_exact(
    lmcache_server: LMServerProcess, dtype_name: str
) -> None:
    dtype = KV_DTYPES[dtype_name]

    async def check() -> None:
        backend = await opened(lmcache_server.url)
        try:
            for n, (fmt, shape) in enumerate(SHAPES.items()):
                obj = random_obj(shape, dtype, fmt, seed=n)
                name = key(n, f"bits-{dtype_name}")
                await backend.put(name, obj)
                got = await backend.get(name)
                assert same(obj, got), (fmt, shape, got)
                assert got is not None
                got.release()
                dest = MemoryObj(torch.zeros(obj.nbytes, dtype=torch.uint8), shape, dtype, fmt)
                assert await backend.get_into(name, dest)
                assert torch.equal(dest.raw, obj.raw)
        finally:
            await backend.close()

    run(check())


@needs_lmcache
def test_what_the_plain_protocol_cannot_carry_is_not_supported(
    lmcache_server: LMServerProcess,
) -> None:
    async def check() -> None:
        backend = await opened(lmcache_server.url)
        try:
            with pytest.raises(NotSupported, match="150"):
                await backend.put(key(1, "m" * 200), random_obj((4,)))
            with pytest.raises(NotSupported, match="5 dims"):
                await backend.put(key(2), random_obj((2, 2, 2, 2, 2)))
            with pytest.raises(NotSupported, match="int32"):
                await backend.put(key(3), random_obj((4,), torch.int32))
            with pytest.raises(NotSupported, match="whitespace"):
                await backend.put(key(5, "name with spaces"), random_obj((4,)))
            # The refusals left the connection in step.
            obj = random_obj((2, 8), seed=3)
            await backend.put(key(4, "after-refusals"), obj)
            assert same(obj, await backend.get(key(4, "after-refusals")))
        finally:
            await backend.close()

    run(check())


@needs_lmcache
def test_plain_puts_are_read_by_gets_on_other_connections(lmcache_server: LMServerProcess) -> None:
    async def check() -> None:
        backend = await opened(lmcache_server.url, connections=8)
        try:
            for version in range(3):
                objs = [random_obj((64, 64), seed=100 * version + n) for n in range(16)]
                keys = [key(n, "ryw") for n in range(16)]
                await asyncio.gather(*(backend.put(k, o) for k, o in zip(keys, objs, strict=True)))
                got = await asyncio.gather(*(backend.get(k) for k in keys))
                assert all(same(o, g) for o, g in zip(objs, got, strict=True)), version
        finally:
            await backend.close()

    run(check())


@needs_lmcache
def test_a_plain_get_the_allocator_cannot_hold_is_a_miss_and_keeps_the_stream(
    lmcache_server: LMServerProcess,
) -> None:
    async def check() -> None:
        small = FreeListAllocator(1 << 20, pin=False)
        backend = await opened(lmcache_server.url, allocator=small, connections=1)
        big, little = random_obj((2 << 20,), torch.uint8, seed=5), random_obj((64,), seed=6)
        try:
            await backend.put(key(1, "alloc"), big)
            await backend.put(key(2, "alloc"), little)
            assert await backend.get(key(1, "alloc")) is None
            got = await backend.get(key(2, "alloc"))
            assert same(little, got)
            assert got is not None
            got.release()
        finally:
            await backend.close()

    run(check())


# -- the extended mode ------------------------------------------------------------------------


def test_extended_mode_carries_what_plain_cannot(lm_server: LMServerProcess) -> None:
    async def check() -> None:
        backend = await opened(lm_server.url)
        objs = {
            key(1, "m" * 300): random_obj((8,), seed=1),
            key(2, "wide"): random_obj((2, 2, 2, 2, 2, 3), seed=2),
            key(3, "ints"): random_obj((4, 4), torch.int32, seed=3),
        }
        try:
            for name, obj in objs.items():
                await backend.put(name, obj)
                assert same(obj, await backend.get(name)), name
        finally:
            await backend.close()

    run(check())


def test_keys_the_server_refuses_travel_escaped_and_others_unchanged() -> None:
    plain = "llama@1@0@1f@half"
    assert encode_key(plain) == plain.encode()
    for text in ("name with spaces@1@0@1f@half", "\u202eevil@1@0@1f@half", ESCAPED_KEY_MARK + "x"):
        encoded = encode_key(text)
        assert encoded.startswith(ESCAPED_KEY_MARK.encode())
        wire.check_key(encoded, 1024)
        assert decode_key(encoded) == text
    assert decode_key(b"\xff\xfe") is None


def test_what_cannot_travel_fails_alone_and_the_batch_does_not_hang(
    lm_server: LMServerProcess,
) -> None:
    async def check() -> None:
        backend = await opened(lm_server.url, connections=1)
        good = random_obj((16,), seed=7)
        bad = MemoryObj.from_tensor(torch.zeros(4, dtype=torch.complex64))
        try:
            with pytest.raises(NotSupported, match="complex64"):
                await backend.put(key(1, "untravelled"), bad)
            with pytest.raises(NotSupported, match="complex64"):
                await backend.batched_put(
                    [key(2, "untravelled"), key(3, "untravelled")], [good, bad]
                )
            await backend.put(key(4, "untravelled"), good)
            assert same(good, await backend.get(key(4, "untravelled")))
        finally:
            await backend.close()

    run(check())


def test_an_object_over_the_servers_limit_raises_capacity_exceeded() -> None:
    async def check() -> None:
        with run_in_thread(ServerOptions(port=0, max_memory=4 << 20)) as server:
            backend = await opened(f"lm://127.0.0.1:{server.port}", connections=1)
            small, huge = random_obj((1024,), seed=61), random_obj((8 << 20,), torch.uint8)
            try:
                with pytest.raises(CapacityExceeded, match="exceeds the largest"):
                    await backend.put(key(1, "huge"), huge)
                with pytest.raises(CapacityExceeded):
                    await backend.batched_put([key(2, "huge"), key(3, "huge")], [small, huge])
                await backend.put(key(4, "huge"), small)
                assert same(small, await backend.get(key(4, "huge")))
            finally:
                await backend.close()

    run(check())


def test_pipelined_batches_are_aligned_and_bit_exact(lm_server: LMServerProcess) -> None:
    async def check() -> None:
        backend = await opened(lm_server.url, connections=4)
        keys = [key(n, "batch") for n in range(40)]
        objs = [random_obj((32, 33), seed=n) for n in range(40)]
        try:
            await backend.batched_put(keys, objs)
            got = await backend.batched_get([*keys[:20], key(99, "batch"), *keys[20:]])
            assert got[20] is None
            found = got[:20] + got[21:]
            assert all(same(o, g) for o, g in zip(objs, found, strict=True))
            for obj in found:
                assert obj is not None
                obj.release()
            dests = [
                MemoryObj(torch.zeros(o.nbytes, dtype=torch.uint8), o.shape, o.dtype) for o in objs
            ]
            short = MemoryObj(torch.zeros(8, dtype=torch.uint8), (8,), torch.uint8)
            with pytest.raises(LayoutMismatch, match=r"stored as \[32, 33\] torch.float16"):
                await backend.batched_get_into(keys, [*dests[:5], short, *dests[6:]])
            absent = key(97, "batch")
            hits = await backend.batched_get_into([*keys, absent], [*dests, short])
            assert hits == [True] * 40 + [False]
            assert all(torch.equal(d.raw, o.raw) for d, o in zip(dests, objs, strict=True))
            assert await backend.batched_contains([*keys[:7], key(98, "batch"), *keys[7:]]) == 7
            assert await backend.batched_contains(keys) == 40
            assert await backend.remove(keys[0]) and not await backend.remove(keys[0])
            listed = {k async for k in backend.list_keys()}
            assert set(keys[1:]) <= listed and keys[0] not in listed
            assert backend.operation_stats()["batched_get"].hits == 40
        finally:
            await backend.close()

    run(check())


def test_key_prefixes_keep_users_apart(lm_server: LMServerProcess) -> None:
    async def check() -> None:
        first = await opened(lm_server.url, key_prefix="team-a/")
        second = await opened(lm_server.url, key_prefix="team-b/")
        obj = random_obj((16,), seed=9)
        try:
            await first.put(key(1, "prefixed"), obj)
            assert await second.get(key(1, "prefixed")) is None
            assert key(1, "prefixed") not in {k async for k in second.list_keys()}
            assert key(1, "prefixed") in {k async for k in first.list_keys()}
        finally:
            await first.close()
            await second.close()

    run(check())


def test_a_damaged_reply_is_a_counted_miss_and_the_key_is_deleted(
    lm_server: LMServerProcess,
) -> None:
    async def check() -> None:
        with FaultProxy(("127.0.0.1", lm_server.port)) as proxy:
            backend = await opened(proxy.url_for(lm_server.url), connections=1)
            direct = await opened(lm_server.url)
            obj = random_obj((64, 64), seed=11)
            name = key(1, "damaged")
            meta = wire.pack_meta(wire.Meta(int(obj.fmt), 2, obj.shape))
            try:
                await backend.put(name, obj)
                damaged = proxy.damage_reply(wire.EXT_REPLY.size + len(meta) + obj.nbytes // 2)
                assert await backend.get(name) is None
                assert damaged.is_set()
                assert backend.corrupt_objects == 1
                assert not await direct.contains(name)
                # The connection stayed in step: the next put and get work on it.
                await backend.put(name, obj)
                assert same(obj, await backend.get(name))
            finally:
                await backend.close()
                await direct.close()

    run(check())


# -- outages ----------------------------------------------------------------------------------


def test_a_paused_server_gives_a_timeout_and_no_late_reply_is_misread(
    restartable_server: LMServerProcess,
) -> None:
    async def check() -> None:
        backend = await opened(restartable_server.url, timeout=1, connections=1)
        first, second = random_obj((1024,), seed=21), random_obj((1024,), seed=22)
        try:
            await backend.put(key(1, "paused"), first)
            await backend.put(key(2, "paused"), second)
            restartable_server.pause()
            try:
                with pytest.raises(BackendTimeout):
                    await backend.get(key(1, "paused"))
            finally:
                restartable_server.resume()
            # The timed-out request's connection was closed: its late reply reaches nobody.
            assert same(second, await eventually(lambda: backend.get(key(2, "paused"))))
        finally:
            await backend.close()

    run(check())


def test_the_next_operation_reconnects_after_a_restart(
    restartable_server: LMServerProcess,
) -> None:
    async def check() -> None:
        backend = await opened(restartable_server.url, timeout=2, connections=2)
        obj = random_obj((256,), seed=31)
        try:
            await backend.put(key(1, "restart"), obj)
            restartable_server.stop()
            with pytest.raises(BackendUnavailable, match=str(restartable_server.port)):
                await backend.get(key(1, "restart"))
            restartable_server.start()
            await eventually(lambda: backend.put(key(2, "restart"), obj))
            assert same(obj, await backend.get(key(2, "restart")))
            assert backend.mode == "extended"
        finally:
            await backend.close()

    run(check())


def test_after_a_refused_connect_operations_fail_at_once_until_the_back_off_ends(
    restartable_server: LMServerProcess,
) -> None:
    async def check() -> None:
        backend = await opened(
            restartable_server.url, reconnect_delay=60, reconnect_max_delay=60, connections=1
        )
        try:
            await backend.put(key(1, "backoff"), random_obj((64,), seed=51))
            restartable_server.stop()
            with pytest.raises(BackendUnavailable, match="connection refused"):
                await backend.contains(key(1, "backoff"))
            with pytest.raises(BackendUnavailable, match="next connect is tried in"):
                await backend.contains(key(1, "backoff"))
        finally:
            await backend.close()

    run(check())


# -- authentication -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def secret_server() -> Iterator[str]:
    with run_in_thread(
        ServerOptions(port=0, max_memory=64 << 20, secret=b"lm-shared-secret")
    ) as server:
        yield f"lm://127.0.0.1:{server.port}"


def test_the_right_secret_opens_an_authenticated_connection(secret_server: str) -> None:
    async def check() -> None:
        backend = await opened(secret_server, secret="lm-shared-secret")
        obj = random_obj((32,), seed=41)
        try:
            assert "authenticated" in backend.describe()["server"]
            await backend.put(key(1, "auth"), obj)
            assert same(obj, await backend.get(key(1, "auth")))
        finally:
            await backend.close()

    run(check())


def test_a_wrong_secret_is_refused_without_showing_it(secret_server: str) -> None:
    with pytest.raises(ConfigError, match="refused the secret") as error:
        run(opened(secret_server, secret="not-the-secret"))
    assert "not-the-secret" not in str(error.value)


def test_no_secret_for_a_server_that_requires_one_says_which_option(secret_server: str) -> None:
    with pytest.raises(ConfigError, match="'secret' option"):
        run(opened(secret_server))
