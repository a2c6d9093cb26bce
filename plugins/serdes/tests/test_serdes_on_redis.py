"""The serdes on a real Redis server and through the Store: chosen per tier in URLs and in the
tiers YAML, recorded in every frame so that a reader configured otherwise decodes the value or
misses it (counted), and refused at open with one clear line when misconfigured."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import kvplug
from kvplug import CacheKey, MemoryObj
from kvplug.errors import ConfigError, UnknownOption
from kvplug.frame import decode_header
from kvplug.memory import MemoryFormat
from kvplug.registry import reset_registry
from kvplug.runtime.cli import main
from kvplug.runtime.config import Config
from kvplug.runtime.store import open_store
from kvplug_testing import RedisServer

pytestmark = pytest.mark.redis


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def _kv(seed: int, shape: tuple[int, ...] = (2, 2, 64, 128)) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(torch.bfloat16)


def _key(chunk: int, model: str = "serde-model") -> CacheKey:
    return CacheKey(model, 1, 0, chunk, "bfloat16")


async def _put(url: str, key: CacheKey, tensor: torch.Tensor) -> None:
    async with await kvplug.open_backend(url) as backend:
        await backend.put(key, MemoryObj.from_tensor(tensor, MemoryFormat.KV_2LTD))


async def _get(url: str, key: CacheKey) -> tuple[torch.Tensor | None, int]:
    async with await kvplug.open_backend(url) as backend:
        got = await backend.get(key)
        corrupt = backend.corrupt_objects
        if got is None:
            return None, corrupt
        tensor = got.tensor.clone()
        got.release()
        return tensor, corrupt


def test_the_plugin_lists_its_serdes_in_kvplug_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    from rich.console import Console

    from kvplug.runtime import cli

    monkeypatch.setattr(cli, "console", Console(width=200))
    result = CliRunner().invoke(main, ["plugins", "--json"])
    assert result.exit_code == 0, result.output
    rows = {row["distribution"]: row for row in json.loads(result.output)}
    serdes = {row["name"]: row for row in rows["kvplug-serdes"]["serdes"]}
    assert set(serdes) == {"zstd", "lz4", "fp8", "k16v8"}
    assert serdes["fp8"]["lossy"] and not serdes["zstd"]["lossy"]
    assert all(row["error"] is None for row in serdes.values())
    table = CliRunner().invoke(main, ["plugins"]).output
    assert "k16v8" in table and "kvplug-serdes" in table


@pytest.mark.parametrize("serde", ["zstd", "lz4"])
def test_redis_holds_fewer_bytes_and_serves_them_back_bit_exact(
    standalone: RedisServer, serde: str
) -> None:
    tensor = _kv(1)
    key = _key(1, f"stored-{serde}")
    _run(_put(f"{standalone.url}?serde={serde}", key, tensor))
    got, corrupt = _run(_get(f"{standalone.url}?serde={serde}", key))
    assert got is not None and corrupt == 0
    assert torch.equal(got.view(torch.int16), tensor.view(torch.int16))
    with standalone.client() as client:
        (name,) = list(client.scan_iter(match=f"*stored-{serde}*"))
        value = client.get(name)
    assert decode_header(value).serde == serde
    assert len(value) < 0.9 * tensor.numel() * 2


@pytest.mark.parametrize(
    ("writer", "reader"),
    [("zstd", "naive"), ("naive", "zstd"), ("lz4", "zstd"), ("k16v8", "fp8"), ("fp8", "naive")],
)
def test_a_reader_configured_otherwise_decodes_with_the_writers_serde(
    standalone: RedisServer, writer: str, reader: str
) -> None:
    tensor = _kv(2)
    key = _key(2, f"mixed-{writer}-{reader}")
    _run(_put(f"{standalone.url}?serde={writer}", key, tensor))
    got, corrupt = _run(_get(f"{standalone.url}?serde={reader}", key))
    assert got is not None and corrupt == 0
    if writer in ("fp8", "k16v8"):
        error = (got.float() - tensor.float()).abs()
        assert bool((error <= tensor.float().abs() / 14 + 1e-3).all())
        assert torch.equal(got[0], tensor[0]) == (writer == "k16v8")
    else:
        assert torch.equal(got.view(torch.int16), tensor.view(torch.int16))


@pytest.fixture
def without_kvplug_serdes(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process as a reader without kvplug-serdes installed."""
    monkeypatch.setenv("KVPLUG_DISABLE_PLUGINS", "kvplug-serdes")
    reset_registry()
    yield
    monkeypatch.delenv("KVPLUG_DISABLE_PLUGINS")
    reset_registry()


def test_a_reader_without_the_plugin_misses_counts_and_leaves_the_value(
    standalone: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    tensor = _kv(3)
    key = _key(3, "unreadable")
    _run(_put(f"{standalone.url}?serde=zstd", key, tensor))
    monkeypatch.setenv("KVPLUG_DISABLE_PLUGINS", "kvplug-serdes")
    reset_registry()
    try:
        assert _run(_get(standalone.url, key)) == (None, 1)
        with pytest.raises(ConfigError, match=r"pip install 'kvplug-serdes\[zstd\]'"):
            _run(_get(f"{standalone.url}?serde=zstd", key))
    finally:
        monkeypatch.delenv("KVPLUG_DISABLE_PLUGINS")
        reset_registry()
    got, corrupt = _run(_get(standalone.url, key))
    assert got is not None and corrupt == 0
    assert torch.equal(got.view(torch.int16), tensor.view(torch.int16))


@pytest.mark.parametrize(
    ("query", "error", "match"),
    [
        ("serde=zstdd", ConfigError, "Did you mean 'zstd'"),
        (
            "serde=zstd&serde_level=99",
            ConfigError,
            "serde_level='99': Input should be less",
        ),
        ("serde=lz4&serde_level=3", UnknownOption, "serde_acceleration"),
        (
            "serde=fp8&serde_block=3",
            ConfigError,
            "serde_block='3': Input should be greater",
        ),
    ],
)
def test_a_misconfigured_serde_fails_at_open_in_one_line(
    standalone: RedisServer, query: str, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match) as caught:
        _run(kvplug.open_backend(f"{standalone.url}?{query}"))
    assert "\n" not in str(caught.value)


def test_each_tier_of_a_store_takes_its_own_serde(standalone: RedisServer) -> None:
    """The tiers YAML's mapping form (the serde and its options as keys) and the URL form, and
    LMCache's ``remote_serde``."""
    configs = {
        "mapping": Config.from_yaml(
            f"tiers:\n  - url: {standalone.url}\n    serde: zstd\n    serde_level: 3\n"
        ),
        "url": Config.from_dict({"tiers": [f"{standalone.url}?serde=lz4&serde_element_bytes=2"]}),
        "lmcache": Config.from_dict(
            {"local_cpu": False, "remote_url": standalone.url, "remote_serde": "zstd"}
        ),
    }
    written = {"mapping": "zstd", "url": "lz4", "lmcache": "zstd"}
    for name, config in configs.items():
        key = _key(4, f"tier-{name}")
        tensor = _kv(4)

        async def scenario(
            config: Config = config, key: CacheKey = key, tensor: torch.Tensor = tensor
        ) -> torch.Tensor:
            store = await open_store(config)
            try:
                await store.put(key, MemoryObj.from_tensor(tensor, MemoryFormat.KV_2LTD))
                await store.flush()
                hit = await store.get(key)
                assert hit is not None
                copy = hit.tensor.clone()
                hit.release()
                return copy
            finally:
                await store.close()

        assert torch.equal(_run(scenario()).view(torch.int16), tensor.view(torch.int16))
        with standalone.client() as client:
            (stored,) = list(client.scan_iter(match=f"*tier-{name}*"))
            assert decode_header(client.get(stored)).serde == written[name]
