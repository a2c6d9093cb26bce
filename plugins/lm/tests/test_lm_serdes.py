"""Serdes on ``lm://`` (``?serde=zstd``): what a client configured with a serde other than
``naive`` stores (a kvplug frame, as LMCache's opaque bytes), that every reader decodes it
whatever its own serde, and that a frame damaged, torn or of a serde not installed here is a
counted miss. Against ``kvplug lm-server`` (a subprocess) in both modes, and LMCache 0.5.6's
own ``lmcache_server`` (skipped where its venv is absent)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from pathlib import Path

import pytest
import torch
from lm_client_helpers import SHAPES, key, opened, random_obj, run, same
from lm_server_helpers import PlainClient

from kvplug import hookimpl
from kvplug.errors import ConfigError, CorruptObject, LayoutMismatch, NotSupported
from kvplug.frame import MAGIC, decode_header, encode_frame
from kvplug.keys import CacheKey
from kvplug.memory import DTYPE_CODES, MemoryFormat, MemoryObj
from kvplug.registry import register_plugin, reset_registry
from kvplug.serde import Serde, open_serde
from kvplug_lm import wire
from kvplug_lm.backend import LMBackend
from kvplug_testing.lm import LMCACHE_ABSENT, LMServerProcess, lmcache_python
from kvplug_testing.ports import free_port

MODES = ("extended", "plain")
KV_SHAPE = (2, 2, 16, 128)
"""``KV_2LTD``: K and V of two layers, 16 tokens, one head of 128 (fp8's block)."""
FP8_BLOCK = 128


@pytest.fixture(scope="module")
def lm_server() -> Iterator[LMServerProcess]:
    with LMServerProcess(["--max-memory", "256MiB"]) as server:
        yield server


@contextlib.asynccontextmanager
async def clients(
    url: str, *serdes: str | Mapping[str, object], mode: str = "auto"
) -> AsyncIterator[list[LMBackend]]:
    """One open client of ``url`` per serde (a name, or the serde's options), closed after."""
    backends: list[LMBackend] = []
    try:
        for serde in serdes:
            options = {"serde": serde} if isinstance(serde, str) else dict(serde)
            backends.append(await opened(url, mode=mode, **options))
        yield backends
    finally:
        for backend in backends:
            await backend.close()


def compressible(shape: tuple[int, ...] = KV_SHAPE, seed: int = 0) -> MemoryObj:
    """bfloat16 KV of few distinct values: a lossless serde has much to save."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randint(-8, 8, shape, generator=generator).to(torch.bfloat16) / 4
    return MemoryObj.from_tensor(values, MemoryFormat.KV_2LTD)


def kv_values(seed: int = 0) -> MemoryObj:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(KV_SHAPE, generator=generator).to(torch.bfloat16)
    return MemoryObj.from_tensor(values, MemoryFormat.KV_2LTD)


def stored(server: LMServerProcess, name: CacheKey) -> tuple[wire.PlainReply, bytes]:
    """The metadata and bytes the server holds for ``name``, read with LMCache's protocol."""
    client = PlainClient(server.port)
    try:
        reply, payload = client.get(name.to_string())
    finally:
        client.close()
    assert reply.code == wire.Code.SUCCESS and payload is not None, reply
    return reply, payload


def assert_a_frame_of(reply: wire.PlainReply, value: bytes, serde: str) -> None:
    """``value`` is a frame of ``serde``, described as LMCache's opaque bytes."""
    assert (reply.fmt, reply.dtype) == (int(MemoryFormat.BINARY), DTYPE_CODES[torch.uint8])
    assert tuple(reply.shape) == (len(value), 0, 0, 0) and reply.length == len(value)
    assert value.startswith(MAGIC)
    assert decode_header(value).serde == serde


def opaque(value: bytes) -> MemoryObj:
    """An object of format BINARY holding ``value``: a naive client stores it as it is."""
    return MemoryObj.from_tensor(
        torch.frombuffer(bytearray(value), dtype=torch.uint8), MemoryFormat.BINARY
    )


def zeros_like(obj: MemoryObj) -> MemoryObj:
    return MemoryObj.from_tensor(torch.zeros(obj.shape, dtype=obj.dtype), obj.fmt)


# -- what is stored ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_a_serde_stores_a_frame_as_binary_and_naive_stores_the_object_as_it_is(
    lm_server: LMServerProcess, mode: str
) -> None:
    obj = compressible()
    framed, plain = key(1, f"stored-{mode}"), key(2, f"stored-{mode}")

    async def put() -> None:
        async with clients(lm_server.url, "zstd", "naive", mode=mode) as (zstd, naive):
            await zstd.put(framed, obj)
            await naive.put(plain, obj)

    run(put())
    reply, value = stored(lm_server, framed)
    assert_a_frame_of(reply, value, "zstd")
    assert len(value) < obj.nbytes / 2
    reply, value = stored(lm_server, plain)
    assert (reply.fmt, reply.dtype) == (int(obj.fmt), DTYPE_CODES[obj.dtype])
    assert tuple(reply.shape) == obj.shape and value == bytes(obj.memoryview())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("writer", "reader"), [("zstd", "naive"), ("naive", "zstd"), ("lz4", "zstd")]
)
def test_every_reader_decodes_every_writers_values_bit_exact(
    lm_server: LMServerProcess, mode: str, writer: str, reader: str
) -> None:
    model = f"cross-{mode}-{writer}-{reader}"
    # A naive client stores a BINARY object as it is, which a client with a serde reads as
    # damage (test_a_binary_value_that_is_not_a_frame_...): left out for that writer.
    formats = [fmt for fmt in SHAPES if writer != "naive" or fmt != MemoryFormat.BINARY]
    objs = [random_obj(SHAPES[fmt], fmt=fmt, seed=n) for n, fmt in enumerate(formats)]
    objs.append(compressible(seed=9))
    keys = [key(n, model) for n in range(len(objs))]

    async def check() -> None:
        async with clients(lm_server.url, writer, reader, mode=mode) as (writing, reading):
            await writing.batched_put(keys[:2], objs[:2])
            for name, obj in zip(keys[2:], objs[2:], strict=True):
                await writing.put(name, obj)
            for name, obj in zip(keys, objs, strict=True):
                got = await reading.get(name)
                assert same(obj, got), (obj.fmt, got)
                assert got is not None
                got.release()
                dest = zeros_like(obj)
                assert await reading.get_into(name, dest)
                assert torch.equal(dest.raw, obj.raw)
            found = await reading.batched_get(keys)
            assert all(same(o, g) for o, g in zip(objs, found, strict=True))
            dests = [zeros_like(obj) for obj in objs]
            assert await reading.batched_get_into(keys, dests) == [True] * len(objs)
            assert all(torch.equal(d.raw, o.raw) for d, o in zip(dests, objs, strict=True))
            assert reading.corrupt_objects == 0

    run(check())


# -- lossy serdes -----------------------------------------------------------------------------


def within_fp8_bound(original: torch.Tensor, got: torch.Tensor) -> bool:
    """fp8's documented bound: ``|x - x'| <= |x| / 14 + A * 2**-18``, ``A`` the largest
    magnitude of x's block of 128 consecutive elements."""
    flat, back = original.reshape(-1).double(), got.reshape(-1).double()
    amax = flat.abs().view(-1, FP8_BLOCK).amax(dim=1).repeat_interleave(FP8_BLOCK)
    return bool(((flat - back).abs() <= flat.abs() / 14 + amax * 2.0**-18).all())


@pytest.mark.parametrize("mode", MODES)
def test_fp8_values_read_by_a_naive_client_are_within_the_bound(
    lm_server: LMServerProcess, mode: str
) -> None:
    obj = kv_values(seed=3)
    name = key(1, f"fp8-{mode}")

    async def check() -> None:
        async with clients(lm_server.url, "fp8", "naive", mode=mode) as (writing, reading):
            await writing.put(name, obj)
            got = await reading.get(name)
            assert got is not None and (got.shape, got.dtype) == (obj.shape, obj.dtype)
            assert not torch.equal(got.raw, obj.raw), "fp8 stored the object unchanged"
            assert within_fp8_bound(obj.tensor, got.tensor)
            got.release()

    run(check())
    reply, value = stored(lm_server, name)
    assert_a_frame_of(reply, value, "fp8")
    assert len(value) < obj.nbytes * 0.6


@pytest.mark.parametrize("mode", MODES)
def test_k16v8_keeps_keys_exact_and_refuses_objects_that_are_not_kv(
    lm_server: LMServerProcess, mode: str
) -> None:
    obj = kv_values(seed=4)
    model = f"k16v8-{mode}"

    async def check() -> None:
        async with clients(lm_server.url, "k16v8", "naive", mode=mode) as (writing, reading):
            await writing.put(key(1, model), obj)
            got = await reading.get(key(1, model))
            assert got is not None
            assert torch.equal(got.tensor[0], obj.tensor[0])
            assert within_fp8_bound(obj.tensor[1], got.tensor[1])
            got.release()
            not_kv = random_obj((4, 64), torch.bfloat16, MemoryFormat.UNDEFINED, seed=5)
            with pytest.raises(NotSupported, match="which part of an object is K"):
                await writing.put(key(2, model), not_kv)
            with pytest.raises(NotSupported):
                await writing.batched_put([key(3, model), key(4, model)], [obj, not_kv])
            assert not await reading.contains(key(2, model))
            assert not await reading.contains(key(4, model))

    run(check())


# -- values this reader cannot serve ----------------------------------------------------------


class Reversed(Serde):
    """A serde of this test only: the object's bytes reversed."""

    name = "lm-test-reversed"

    def encode(self, obj: MemoryObj, key: CacheKey | None = None) -> bytes:
        return bytes(obj.memoryview())[::-1]

    def decode(self, payload: memoryview, out: MemoryObj, key: CacheKey | None = None) -> None:
        if payload.nbytes != out.nbytes:
            raise CorruptObject(f"{payload.nbytes} bytes, {out.nbytes} needed")
        out.memoryview()[:] = bytes(payload)[::-1]


class ServesReversed:
    @hookimpl
    def kvplug_serdes(self) -> list[type[Serde]]:
        return [Reversed]


def install_reversed() -> None:
    register_plugin(ServesReversed(), name="lm-test-reversed")


@pytest.fixture
def reversed_installed() -> Iterator[None]:
    """The test serde, installed as a plugin; uninstalled (plugins found again) after."""
    install_reversed()
    yield
    reset_registry()


@pytest.mark.usefixtures("reversed_installed")
@pytest.mark.parametrize("mode", MODES)
def test_a_value_of_a_serde_not_installed_here_is_a_counted_miss_that_stays_stored(
    lm_server: LMServerProcess, mode: str
) -> None:
    obj, other = random_obj((8, 64), seed=6), random_obj((8, 64), seed=7)
    name, beside = key(1, f"unread-{mode}"), key(2, f"unread-{mode}")

    async def check() -> None:
        async with clients(lm_server.url, Reversed.name, mode=mode) as [writing]:
            await writing.batched_put([name, beside], [obj, other])
        reset_registry()  # the serde is not installed here any more
        async with clients(lm_server.url, "naive", mode=mode) as [reading]:
            assert await reading.get(name) is None
            dest = zeros_like(obj)
            assert not await reading.get_into(name, dest)
            assert not dest.raw.any()
            found = await reading.batched_get([name, beside])
            assert found[0] is None and found[1] is None
            assert reading.corrupt_objects == 4
            assert await reading.contains(name) and await reading.contains(beside)
            install_reversed()
            assert same(obj, await reading.get(name))

    run(check())


# -- damage -----------------------------------------------------------------------------------


def damaged_frames(obj: MemoryObj, name: CacheKey) -> dict[str, bytes]:
    """``obj``'s zstd frame, torn and altered in its payload and in its header."""
    header, payload = encode_frame(obj, open_serde("zstd"), name)
    frame = bytearray(header + bytes(payload))
    altered_payload, altered_header = bytearray(frame), bytearray(frame)
    altered_payload[len(header) + len(payload) // 2] ^= 0x10
    altered_header[20] ^= 0x01
    return {
        "torn": bytes(frame[: len(frame) - 7]),
        "payload altered": bytes(altered_payload),
        "header altered": bytes(altered_header),
    }


async def read_all(
    backend: LMBackend, form: str, keys: Sequence[CacheKey], like: MemoryObj
) -> list[bool]:
    """Which of ``keys`` ``form`` read (each an object like ``like``); what it read released."""
    if form == "get":
        found = [await backend.get(name) for name in keys]
    elif form == "batched_get":
        found = await backend.batched_get(keys)
    else:
        dests = [zeros_like(like) for _ in keys]
        if form == "get_into":
            pairs = zip(keys, dests, strict=True)
            hits = [await backend.get_into(name, dest) for name, dest in pairs]
        else:
            hits = await backend.batched_get_into(keys, dests)
        for hit, dest in zip(hits, dests, strict=True):
            assert hit == bool(dest.raw.any()), "a miss left bytes in the caller's buffer"
        return hits
    hits = [obj is not None for obj in found]
    for obj in found:
        if obj is not None:
            assert same(like, obj)
            obj.release()
    return hits


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("reader", ["naive", "zstd"])
@pytest.mark.parametrize("form", ["get", "get_into", "batched_get", "batched_get_into"])
def test_a_damaged_frame_is_a_counted_miss_deleted_where_the_mode_can(
    lm_server: LMServerProcess, mode: str, reader: str, form: str
) -> None:
    obj = compressible(seed=8)
    model = f"damage-{mode}-{reader}-{form}"

    async def check() -> None:
        async with clients(lm_server.url, "zstd", "naive", reader, mode=mode) as (
            writing,
            raw,
            reading,
        ):
            for n, (kind, value) in enumerate(damaged_frames(obj, key(0, model)).items()):
                good, bad, after = key(3 * n, model), key(3 * n + 1, model), key(3 * n + 2, model)
                await writing.batched_put([good, after], [obj, obj])
                await raw.put(bad, opaque(value))
                assert await read_all(reading, form, [good, bad, after], obj) == [
                    True,
                    False,
                    True,
                ], kind
                assert reading.corrupt_objects == n + 1, kind
                assert await raw.contains(bad) == (mode == "plain"), kind

    run(check())


@pytest.mark.parametrize("mode", MODES)
def test_a_binary_value_that_is_not_a_frame_is_damage_to_a_serde_and_bytes_to_naive(
    lm_server: LMServerProcess, mode: str
) -> None:
    obj = random_obj((500,), torch.uint8, MemoryFormat.BINARY, seed=9)
    name = key(1, f"not-a-frame-{mode}")

    async def check() -> None:
        async with clients(lm_server.url, "naive", "zstd", mode=mode) as (naive, zstd):
            await naive.put(name, obj)
            assert same(obj, await naive.get(name))
            assert await zstd.get(name) is None
            assert zstd.corrupt_objects == 1
            assert await naive.contains(name) == (mode == "plain")

    run(check())


@pytest.mark.parametrize("mode", MODES)
def test_get_into_a_buffer_of_another_size_than_the_frames_object_is_a_layout_mismatch(
    lm_server: LMServerProcess, mode: str
) -> None:
    obj = compressible(seed=10)
    name = key(1, f"mismatch-{mode}")

    async def check() -> None:
        async with clients(lm_server.url, "zstd", mode=mode) as [backend]:
            await backend.put(name, obj)
            short = MemoryObj.from_tensor(torch.zeros(obj.nbytes // 2, dtype=torch.uint8))
            with pytest.raises(LayoutMismatch, match=str(obj.nbytes)):
                await backend.get_into(name, short)
            assert not short.raw.any()
            assert same(obj, await backend.get(name))

    run(check())


@pytest.mark.parametrize("mode", MODES)
def test_a_sealing_serde_serves_only_what_it_sealed(
    lm_server: LMServerProcess, mode: str, tmp_path: Path
) -> None:
    # Imported here: the module is also collected in LMCache's venv, which lacks kvplug-aesgcm.
    from kvplug_aesgcm.keyring import new_entry

    keys_file = tmp_path / "keys"
    keys_file.write_text(new_entry(1) + "\n")
    keys_file.chmod(0o600)
    sealed = {"serde": "aesgcm", "serde_key_file": str(keys_file)}
    obj = random_obj((8, 64), seed=12)
    model = f"sealed-{mode}"
    mine, naive_kv, zstd_frame = key(1, model), key(2, model), key(3, model)

    async def check() -> None:
        async with clients(lm_server.url, sealed, "naive", "zstd", mode=mode) as (
            sealing,
            naive,
            zstd,
        ):
            await sealing.put(mine, obj)
            await naive.put(naive_kv, obj)
            await zstd.put(zstd_frame, obj)
            assert same(obj, await sealing.get(mine))
            assert await sealing.batched_get([naive_kv, zstd_frame]) == [None, None]
            assert sealing.corrupt_objects == 2
            deleted = mode == "extended"
            assert await naive.contains(naive_kv) != deleted
            assert await naive.contains(zstd_frame) != deleted
            # Without the key file the sealed value is unreadable, not damaged: kept.
            assert await naive.get(mine) is None
            assert naive.corrupt_objects == 1 and await naive.contains(mine)

    run(check())


# -- LMCache's own server, and configuration --------------------------------------------------


@pytest.mark.skipif(lmcache_python() is None, reason=LMCACHE_ABSENT)
def test_zstd_round_trips_through_lmcaches_own_server(lmcache_server: LMServerProcess) -> None:
    obj, binary = compressible(seed=11), random_obj((300,), torch.uint8, MemoryFormat.BINARY)
    keys = [key(1, "lmcache-zstd"), key(2, "lmcache-zstd")]

    async def check() -> None:
        async with clients(lmcache_server.url, "zstd", "naive") as (writing, reading):
            assert writing.mode == "plain"
            await writing.batched_put(keys, [obj, binary])
            for backend in (writing, reading):
                found = await backend.batched_get(keys)
                assert same(obj, found[0]) and same(binary, found[1])
                dest = zeros_like(obj)
                assert await backend.get_into(keys[0], dest)
                assert torch.equal(dest.raw, obj.raw)

    run(check())
    reply, value = stored(lmcache_server, keys[0])
    assert_a_frame_of(reply, value, "zstd")


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("serde=nosuch", r"unknown serde 'nosuch'.*Available: .*zstd.*use 'naive'"),
        ("serde=zstf", r"Did you mean 'zstd'"),
        ("serde=zstd&serde_level=99", r"serde_level='99'.*less than or equal to 22.*serde_"),
        ("serde=naive&serde_level=3", r"'naive' takes no options, got serde_level"),
    ],
)
def test_a_bad_serde_fails_at_open_naming_the_fix(query: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        run(opened(f"lm://127.0.0.1:{free_port()}?{query}"))
