"""The aesgcm serde: bit-exact round trips, every kind of tampering a counted miss, key rotation,
per-tenant keys, keys never shown, and what a real Redis server holds at rest."""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

import kvplug
from kvplug import CacheKey, MemoryObj
from kvplug.errors import ConfigError, CorruptObject, UnknownOption, UnreadableObject
from kvplug.frame import decode_header, encode_frame, encode_header
from kvplug.runtime.config import Config
from kvplug.runtime.store import open_store
from kvplug.serde import Serde, available_serdes, open_serde
from kvplug_aesgcm.keyring import Keyring, KeyringError, main, new_entry
from kvplug_aesgcm.serde import OVERHEAD, PREFIX_BYTES
from kvplug_testing import RedisServer

KeyFile = Callable[..., Path]
KEY = CacheKey("llama", 1, 0, 0x2A, "half")
DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
]


def _serde(path: Path, **options: Any) -> Serde:
    return open_serde("aesgcm", {"key_file": str(path), **options})


def _obj(
    seed: int = 0, dtype: torch.dtype = torch.float16, shape: tuple[int, ...] = (4, 64)
) -> MemoryObj:
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (torch.Size(shape).numel() * dtype.itemsize,), generator=generator)
    return MemoryObj.from_tensor(raw.to(torch.uint8).view(dtype).view(shape))


def _opened(
    serde: Serde, payload: bytes | bytearray, like: MemoryObj, key: CacheKey = KEY
) -> MemoryObj:
    out = MemoryObj.from_tensor(torch.zeros(like.shape, dtype=like.dtype))
    serde.decode(memoryview(payload), out, key)
    return out


def test_the_plugin_provides_the_serde() -> None:
    assert "aesgcm" in available_serdes()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_round_trip_is_bit_exact_for_every_kv_dtype(
    key_file: KeyFile, dtype: torch.dtype
) -> None:
    serde = _serde(key_file(1))
    src = _obj(1, dtype)
    sealed = serde.encode(src, KEY)
    assert len(sealed) == src.nbytes + OVERHEAD
    assert torch.equal(_opened(serde, sealed, src).raw, src.raw)


def test_the_payload_hides_the_plaintext_and_no_two_seals_are_alike(key_file: KeyFile) -> None:
    serde = _serde(key_file(1))
    src = MemoryObj.from_tensor(torch.full((4096,), 7, dtype=torch.uint8))
    first, second = serde.encode(src, KEY), serde.encode(src, KEY)
    assert bytes(7 for _ in range(64)) not in first
    assert first[PREFIX_BYTES:] != second[PREFIX_BYTES:]  # a fresh nonce each time


def test_an_empty_object_round_trips(key_file: KeyFile) -> None:
    serde = _serde(key_file(1))
    src = MemoryObj.from_tensor(torch.zeros(0, dtype=torch.float16))
    assert _opened(serde, serde.encode(src, KEY), src).nbytes == 0


def _flipped(payload: bytes | bytearray, at: int) -> bytearray:
    damaged = bytearray(payload)
    damaged[at] ^= 0x01
    return damaged


@pytest.mark.parametrize("where", ["version", "flags", "key id", "nonce", "ciphertext", "tag"])
def test_any_altered_byte_is_damage_never_data(key_file: KeyFile, where: str) -> None:
    serde = _serde(key_file(1))
    src = _obj(2)
    sealed = serde.encode(src, KEY)
    at = {"version": 0, "flags": 1, "key id": 5, "nonce": 9, "ciphertext": 40, "tag": -3}[where]
    with pytest.raises(CorruptObject):
        _opened(serde, _flipped(sealed, at % len(sealed)), src)


def test_a_value_moved_under_another_key_does_not_open(key_file: KeyFile) -> None:
    serde = _serde(key_file(1))
    src = _obj(3)
    sealed = serde.encode(src, KEY)
    for other in (KEY.with_tenant("team-a"), CacheKey("llama", 1, 0, 0x2B, "half")):
        with pytest.raises(CorruptObject, match="does not authenticate"):
            _opened(serde, sealed, src, other)


def test_a_value_given_another_shape_of_the_same_size_does_not_open(key_file: KeyFile) -> None:
    serde = _serde(key_file(1))
    src = _obj(4, shape=(4, 64))
    sealed = serde.encode(src, KEY)
    reshaped = MemoryObj.from_tensor(torch.zeros((64, 4), dtype=torch.float16))
    with pytest.raises(CorruptObject, match="does not authenticate"):
        serde.decode(memoryview(sealed), reshaped, KEY)
    with pytest.raises(CorruptObject, match="bytes"):
        serde.decode(
            memoryview(sealed)[:-1],
            MemoryObj.from_tensor(torch.zeros((4, 64), dtype=torch.float16)),
            KEY,
        )


def _keys(tmp_path: Path, name: str, *entries: str) -> Path:
    path = tmp_path / name
    path.write_text("\n".join(entries) + "\n")
    path.chmod(0o600)
    return path


def test_rotation_old_values_open_new_ones_are_sealed_with_the_new_key(tmp_path: Path) -> None:
    first, second = new_entry(1), new_entry(2)
    old = _serde(_keys(tmp_path, "old", first))
    rotated = _serde(_keys(tmp_path, "rotated", first, second))
    src = _obj(5)
    old_value, new_value = old.encode(src, KEY), rotated.encode(src, KEY)
    assert struct.unpack_from("<I", old_value, 4)[0] == 1
    assert struct.unpack_from("<I", new_value, 4)[0] == 2
    assert torch.equal(_opened(rotated, old_value, src).raw, src.raw)
    with pytest.raises(UnreadableObject, match=r"key id 2, which the key file .* holds ids 1"):
        _opened(old, new_value, src)
    pinned = _serde(_keys(tmp_path, "pinned", first, second), key_id=1)
    assert struct.unpack_from("<I", pinned.encode(src, KEY), 4)[0] == 1


def test_another_key_under_the_same_id_does_not_open(tmp_path: Path) -> None:
    src = _obj(6)
    sealed = _serde(_keys(tmp_path, "a", new_entry(1))).encode(src, KEY)
    with pytest.raises(CorruptObject, match="does not authenticate") as raised:
        _opened(_serde(_keys(tmp_path, "b", new_entry(1))), sealed, src)
    assert not isinstance(raised.value, UnreadableObject)


def test_per_tenant_keys_open_nothing_of_another_tenant(key_file: KeyFile) -> None:
    path = key_file(1)
    shared, per_tenant = _serde(path), _serde(path, per_tenant=True)
    src = _obj(7)
    alice, bob = KEY.with_tenant("alice"), KEY.with_tenant("bob")
    sealed = per_tenant.encode(src, alice)
    assert sealed[1] == 1  # the per-tenant flag
    assert torch.equal(_opened(shared, sealed, src, alice).raw, src.raw)  # the flag decides
    with pytest.raises(CorruptObject):
        _opened(per_tenant, sealed, src, bob)
    with pytest.raises(CorruptObject, match="names no tenant"):
        _opened(per_tenant, sealed, src, KEY)
    assert per_tenant.encode(src, KEY)[1] == 0  # no tenant: the master's data key
    assert Keyring.from_file(path).data_key(1, "alice") != Keyring.from_file(path).data_key(
        1, "bob"
    )


def test_the_serde_needs_the_key_it_is_stored_under(key_file: KeyFile) -> None:
    serde = _serde(key_file(1))
    with pytest.raises(ConfigError, match="binds each value"):
        serde.encode(_obj())


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({}, "exactly one place"),
        ({"key_file": "/k", "key_env": "K"}, "exactly one place"),
        ({"key_env": "KVPLUG_TEST_UNSET_VARIABLE"}, "is not set"),
        ({"key_file": "/nonexistent/keys"}, "cannot be read"),
        ({"key_env": "KVPLUG_TEST_KEYS", "key_id": 9}, "key_id 9 is not in"),
        ({"key_env": "KVPLUG_TEST_KEYS", "key_id": 0}, "key_id"),
    ],
)
def test_bad_options_are_one_clear_error(
    monkeypatch: pytest.MonkeyPatch, options: dict[str, object], match: str
) -> None:
    monkeypatch.setenv("KVPLUG_TEST_KEYS", new_entry(1))
    monkeypatch.delenv("KVPLUG_TEST_UNSET_VARIABLE", raising=False)
    with pytest.raises(ConfigError, match=match):
        open_serde("aesgcm", options)


def test_an_unknown_option_names_the_valid_ones() -> None:
    with pytest.raises(UnknownOption, match=r"serde_key_fil.*Valid: serde_key_env, serde_key_file"):
        open_serde("aesgcm", {"key_fil": "/k"})


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "holds no key"),
        ("# only a comment\n", "holds no key"),
        ("1=abc", "no colon"),
        ("x:abc", "id 'x'"),
        ("0:abc", "id '0'"),
        ("1:c2hvcnQ=", "entry 1 .* is not 32 bytes"),
        ("{first}\n{first}", "repeats id 1"),
    ],
)
def test_malformed_key_material_names_the_entry_never_a_key(text: str, match: str) -> None:
    first = new_entry(1)
    with pytest.raises(KeyringError, match=match) as raised:
        Keyring.parse(text.format(first=first), source="the test")
    assert first.split(":")[1] not in str(raised.value)


def test_keys_come_from_an_environment_variable_separated_by_commas(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVPLUG_TEST_KEYS", f"{new_entry(3)}, {new_entry(5)}")
    keyring = Keyring.from_env("KVPLUG_TEST_KEYS")
    assert keyring.ids == (3, 5) and keyring.sealing_id == 5


def test_a_key_file_others_may_read_is_used_with_a_warning(
    key_file: KeyFile, caplog: pytest.LogCaptureFixture
) -> None:
    path = key_file(1)
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="kvplug_aesgcm"):
        Keyring.from_file(path)
    assert "chmod 600" in caplog.text


def test_no_repr_error_or_log_line_shows_a_key(
    key_file: KeyFile, caplog: pytest.LogCaptureFixture
) -> None:
    path = key_file(1, 2)
    secrets = [line.split(":")[1] for line in path.read_text().splitlines()[1:]]
    serde = _serde(path)
    texts = [repr(serde), repr(serde.keyring)]
    for bad in ({"key_file": str(path), "key_id": 4}, {"key_file": str(path), "nope": 1}):
        with pytest.raises(ConfigError) as raised:
            open_serde("aesgcm", bad)
        texts.append(str(raised.value))
    logging.getLogger("kvplug").warning("a careless line quoting %s", secrets[0])
    texts.append(caplog.text)
    for secret in secrets:
        assert all(secret not in text for text in texts), texts


def test_the_key_command_prints_a_usable_entry(capsys: pytest.CaptureFixture[str]) -> None:
    main(["4"])
    entry = capsys.readouterr().out.strip()
    assert Keyring.parse(entry, source="the command").ids == (4,)
    with pytest.raises(SystemExit):
        main(["0"])


# -- through a real Redis server ---------------------------------------------------------------


def _url(server: RedisServer, path: Path, **extra: str) -> str:
    query = "&".join(f"serde_{name}={value}" for name, value in extra.items())
    return f"{server.url}?serde=aesgcm&serde_key_file={path}" + (f"&{query}" if query else "")


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


@pytest.fixture
def redis_keys() -> Iterator[list[CacheKey]]:
    yield [CacheKey("sealed-model", 1, 0, chunk, "half") for chunk in range(4)]


@pytest.mark.redis
def test_redis_holds_only_sealed_bytes_and_serves_them_back(
    standalone: RedisServer, key_file: KeyFile, redis_keys: list[CacheKey]
) -> None:
    path = key_file(1)
    objs = [MemoryObj.from_tensor(torch.full((8192,), 11 + i, dtype=torch.uint8)) for i in range(4)]

    async def scenario() -> list[MemoryObj | None]:
        async with await kvplug.open_backend(_url(standalone, path)) as backend:
            await backend.batched_put(redis_keys, objs)
            return await backend.batched_get(redis_keys)

    got = _run(scenario())
    for obj, copy in zip(objs, got, strict=True):
        assert copy is not None and torch.equal(copy.raw, obj.raw)
        copy.release()
    with standalone.client() as client:
        for name in client.scan_iter(match="*sealed-model*"):
            value = client.get(name)
            header = decode_header(value)
            assert header.serde == "aesgcm"
            assert bytes(16) not in value[header.header_len :] and b"" * 64 not in value


def _forged(value: bytes, payload: bytes | bytearray, serde: str = "aesgcm") -> bytes:
    """A frame whose header is rebuilt around ``payload``: checksums that match, as someone
    who can write to the store could make them."""
    header = decode_header(value)
    return encode_header(header.shape, header.dtype, header.fmt, serde, payload) + bytes(payload)


@pytest.mark.redis
def test_a_forged_value_in_redis_is_a_counted_removed_miss(
    standalone: RedisServer, key_file: KeyFile
) -> None:
    path = key_file(1)
    key = CacheKey("forged-model", 1, 0, 1, "half")
    obj = MemoryObj.from_tensor(torch.arange(2048, dtype=torch.float16))

    async def scenario() -> tuple[list[bool], int, bool]:
        async with await kvplug.open_backend(_url(standalone, path)) as backend:
            outcomes = []
            for forge in ("altered", "plain"):
                await backend.put(key, obj)
                stored = await backend.read_raw(key)
                assert stored is not None
                payload = stored[decode_header(stored).header_len :]
                if forge == "altered":
                    forged = _forged(stored, _flipped(payload, 100))
                else:
                    forged = b"".join(bytes(part) for part in encode_frame(obj))
                await backend.write_raw(key, forged)
                outcomes.append(await backend.get(key) is None)
            present = await backend.contains(key)
            return outcomes, backend.corrupt_objects, present

    outcomes, corrupt, present = _run(scenario())
    assert outcomes == [True, True]
    assert corrupt == 2 and not present  # counted, and removed


@pytest.mark.redis
def test_a_reader_without_the_new_key_misses_and_leaves_the_value(
    standalone: RedisServer, tmp_path: Path
) -> None:
    first, second = new_entry(1), new_entry(2)
    old, rotated = _keys(tmp_path, "old", first), _keys(tmp_path, "rotated", first, second)
    key = CacheKey("rotating-model", 1, 0, 1, "half")
    obj = MemoryObj.from_tensor(torch.arange(1024, dtype=torch.float32))

    async def scenario() -> tuple[bool, int, bool, bool]:
        async with await kvplug.open_backend(_url(standalone, rotated)) as writer:
            await writer.put(key, obj)
            async with await kvplug.open_backend(_url(standalone, old)) as reader:
                missed = await reader.get(key) is None
                counted = reader.corrupt_objects
            copy = await writer.get(key)
            served = copy is not None and torch.equal(copy.raw, obj.raw)
            if copy is not None:
                copy.release()
            return missed, counted, await writer.contains(key), served

    assert _run(scenario()) == (True, 1, True, True)


@pytest.mark.redis
def test_two_tenants_sharing_redis_never_open_each_others_values(
    standalone: RedisServer, key_file: KeyFile
) -> None:
    path = key_file(1)
    url = _url(standalone, path, per_tenant="true")
    alice = CacheKey("shared-model", 1, 0, 7, "half").with_tenant("alice")
    bob = CacheKey("shared-model", 1, 0, 7, "half").with_tenant("bob")
    obj = MemoryObj.from_tensor(torch.arange(512, dtype=torch.float16))

    async def scenario() -> tuple[bool, bool, bool]:
        async with (
            await kvplug.open_backend(url) as first,
            await kvplug.open_backend(url) as second,
        ):
            await first.put(alice, obj)
            bob_misses = await second.get(bob) is None
            stolen = await first.read_raw(alice)
            assert stolen is not None
            await second.write_raw(bob, stolen)  # a copy under the other tenant's key
            copied_misses = await second.get(bob) is None
            mine = await second.get(alice)
            alice_hits = mine is not None and torch.equal(mine.raw, obj.raw)
            if mine is not None:
                mine.release()
            return bob_misses, copied_misses, alice_hits

    assert _run(scenario()) == (True, True, True)


def test_a_backend_without_a_serde_option_refuses_serde_options() -> None:
    with pytest.raises(UnknownOption, match="serde 'naive' takes no options"):
        _run(kvplug.open_backend("redis://127.0.0.1:1?serde_key_file=/k"))


def test_the_frame_checksum_is_of_the_sealed_bytes(key_file: KeyFile) -> None:
    serde = _serde(key_file(1))
    header, payload = encode_frame(_obj(8), serde, KEY)
    parsed = decode_header(header)
    assert parsed.serde == "aesgcm"
    assert parsed.payload_checksum == xxhash.xxh3_64_intdigest(payload)


def test_a_store_from_a_config_seals_its_disk_and_redis_tiers(
    standalone: RedisServer, key_file: KeyFile, tmp_path: Path
) -> None:
    """The tiers YAML form of both: the wrapper over ``file://``, the serde on ``redis://``
    (its options on the URL as LMCache's ``remote_url`` carries them), through the Store."""
    path = key_file(1)
    disk = tmp_path / "disk"
    config = Config.from_dict(
        {
            "tiers": [
                f"aesgcm://?key_file={path}::file://{disk}?max_size=64MiB",
                _url(standalone, path, per_tenant="true"),
            ]
        }
    )
    key = CacheKey("store-model", 1, 0, 9, "half").with_tenant("team-a")
    pattern = torch.full((4096,), 0x5A, dtype=torch.uint8)

    async def scenario() -> None:
        store = await open_store(config)
        try:
            obj = store.allocate((4096,), torch.uint8)
            assert obj is not None
            obj.raw.copy_(pattern)
            await store.put(key, obj)
            obj.release()
            await store.flush()
            hit = await store.get(key)
            assert hit is not None and torch.equal(hit.raw, pattern)
            hit.release()
        finally:
            await store.close()

    _run(scenario())
    files = [p for p in disk.rglob("*.kv")]
    assert len(files) == 1 and b"\x5a" * 64 not in files[0].read_bytes()
    with standalone.client() as client:
        names = list(client.scan_iter(match="*store-model*"))
        assert len(names) == 1 and b"\x5a" * 64 not in client.get(names[0])
