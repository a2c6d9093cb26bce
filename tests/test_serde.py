"""Unit tests of kvplug.serde: the naive serde and the serde registry."""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import pytest
import torch

import kvplug.registry
import kvplug.serde as serde_module
from kvplug import hookimpl
from kvplug.errors import ConfigError, CorruptObject, PluginConflict
from kvplug.keys import CacheKey
from kvplug.memory import DTYPE_CODES, FreeListAllocator, MemoryFormat, MemoryObj
from kvplug.registry import PluginWarning, register_plugin, reset_registry
from kvplug.serde import (
    NaiveSerde,
    Serde,
    available_serdes,
    get_serde,
    register_serde,
    serde_source,
)


@pytest.fixture
def clean_registry() -> Iterator[None]:
    """Undo any serde or plugin registered by a test."""
    saved = {
        name: getattr(serde_module, name).copy()
        for name in ("_serdes", "_sources", "_from_plugins", "_conflicts", "_instances")
    }
    yield
    reset_registry()
    for name, value in saved.items():
        current = getattr(serde_module, name)
        current.clear()
        current.update(value)


def random_obj(shape: tuple[int, ...], dtype: torch.dtype) -> MemoryObj:
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    tensor = raw.view(dtype).reshape(shape) if nbytes else torch.empty(shape, dtype=dtype)
    return MemoryObj.from_tensor(tensor, MemoryFormat.KV_2LTD)


# --------------------------------------------------------------------------- naive


def test_naive_is_always_available() -> None:
    naive = get_serde("naive")
    assert isinstance(naive, NaiveSerde)
    assert naive.name == "naive"
    assert "naive" in available_serdes()
    assert get_serde("naive") is naive


@pytest.mark.parametrize("dtype", list(DTYPE_CODES), ids=str)
@pytest.mark.parametrize("shape", [(2, 3, 1, 8), (2, 3, 17, 8), (2, 3, 0, 8)])
def test_naive_round_trip_is_bit_exact(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    naive = get_serde("naive")
    src = random_obj(shape, dtype)
    allocator = FreeListAllocator(1 << 20)
    dst = allocator.allocate(shape, dtype)
    assert dst is not None
    payload = naive.encode(src)
    assert memoryview(payload).nbytes == src.nbytes
    naive.decode(memoryview(payload), dst)
    assert bytes(dst.memoryview()) == bytes(src.memoryview())
    dst.release()
    assert allocator.stats().used == 0


def test_naive_encode_is_zero_copy() -> None:
    tensor = torch.zeros(16, dtype=torch.float32)
    payload = memoryview(get_serde("naive").encode(MemoryObj.from_tensor(tensor)))
    tensor[1] = 2.0
    assert np.frombuffer(payload, dtype=np.float32)[1] == 2.0


def test_naive_decode_accepts_read_only_payload() -> None:
    src = random_obj((4, 8), torch.bfloat16)
    dst = MemoryObj.from_tensor(torch.empty(4, 8, dtype=torch.bfloat16))
    get_serde("naive").decode(memoryview(bytes(src.memoryview())), dst)
    assert torch.equal(dst.raw, src.raw)


@pytest.mark.parametrize("delta", [-1, 1, -64])
def test_naive_decode_size_mismatch_raises_corrupt_object(delta: int) -> None:
    dst = MemoryObj.from_tensor(torch.full((64,), 7, dtype=torch.uint8))
    with pytest.raises(CorruptObject, match=f"naive payload has {64 + delta} bytes"):
        get_serde("naive").decode(memoryview(bytes(64 + delta)), dst)
    assert int(dst.raw.min()) == 7  # untouched


# --------------------------------------------------------------------------- registry


def test_unknown_serde_is_config_error_with_did_you_mean() -> None:
    with pytest.raises(ConfigError) as info:
        get_serde("naiv")
    message = str(info.value)
    assert "unknown serde 'naiv'" in message
    assert "Did you mean 'naive'?" in message
    assert "Available:" in message and "naive" in message


def test_unknown_serde_far_from_any_name_has_no_suggestion() -> None:
    with pytest.raises(ConfigError) as info:
        get_serde("zzzzzzzzzz")
    assert "Did you mean" not in str(info.value)
    assert "Available: " in str(info.value)


class _Reverse(Serde):
    name = "test-reverse"

    def encode(self, obj: MemoryObj, key: CacheKey | None = None) -> bytes:
        return bytes(obj.memoryview())[::-1]

    def decode(self, payload: memoryview, out: MemoryObj, key: CacheKey | None = None) -> None:
        if payload.nbytes != out.nbytes:
            raise CorruptObject("size")
        out.memoryview()[:] = bytes(payload)[::-1]


class _OtherReverse(_Reverse):
    pass


@pytest.mark.usefixtures("clean_registry")
def test_register_serde_makes_it_available() -> None:
    register_serde(_Reverse)
    assert "test-reverse" in available_serdes()
    serde = get_serde("test-reverse")
    assert isinstance(serde, _Reverse)
    src = MemoryObj.from_tensor(torch.arange(8, dtype=torch.uint8))
    dst = MemoryObj.from_tensor(torch.zeros(8, dtype=torch.uint8))
    payload = serde.encode(src)
    assert payload == bytes(range(7, -1, -1))
    serde.decode(memoryview(payload), dst)
    assert torch.equal(dst.raw, src.raw)


@pytest.mark.usefixtures("clean_registry")
def test_register_same_class_twice_is_fine() -> None:
    register_serde(_Reverse)
    register_serde(_Reverse)
    assert isinstance(get_serde("test-reverse"), _Reverse)


@pytest.mark.usefixtures("clean_registry")
def test_register_serde_conflict_raises_unless_replace() -> None:
    register_serde(_Reverse)
    first = get_serde("test-reverse")
    with pytest.raises(PluginConflict, match="already registered") as info:
        register_serde(_OtherReverse)
    assert "replace=True" in str(info.value)
    assert __name__.rsplit(".", 1)[-1] in str(info.value)
    assert get_serde("test-reverse") is first
    register_serde(_OtherReverse, replace=True)
    replaced = get_serde("test-reverse")
    assert type(replaced) is _OtherReverse
    assert replaced is not first


@pytest.mark.usefixtures("clean_registry")
def test_naive_cannot_be_silently_replaced() -> None:
    class Impostor(NaiveSerde):
        pass

    with pytest.raises(PluginConflict, match="'naive' is served twice") as info:
        register_serde(Impostor)
    assert "kvplug (kvplug.serde.NaiveSerde)" in str(info.value)
    assert type(get_serde("naive")) is NaiveSerde


# --------------------------------------------------------------------------- from plugins


class _ServesSerdes:
    """A plugin object whose kvplug_serdes returns the given classes."""

    def __init__(self, *serdes: type[Serde]) -> None:
        self.serdes = list(serdes)

    @hookimpl
    def kvplug_serdes(self) -> list[type[Serde]]:
        return self.serdes


class _Rot(_Reverse):
    name = "test-rot"


@pytest.mark.usefixtures("clean_registry")
def test_a_plugin_serde_is_found_by_name() -> None:
    reset_registry()
    register_plugin(_ServesSerdes(_Reverse), name="reverse-plugin")
    assert "test-reverse" in available_serdes()
    assert isinstance(get_serde("test-reverse"), _Reverse)


@pytest.mark.usefixtures("clean_registry")
def test_a_serde_served_by_two_plugins_is_a_conflict_naming_both() -> None:
    reset_registry()
    register_plugin(_ServesSerdes(_Reverse, _Rot), name="plugin-one")
    register_plugin(_ServesSerdes(_OtherReverse), name="plugin-two")
    with pytest.raises(PluginConflict) as info:
        get_serde("test-reverse")
    message = str(info.value)
    assert "'test-reverse' is served twice" in message
    assert "plugin 'plugin-one'" in message and "_Reverse" in message
    assert "plugin 'plugin-two'" in message and "_OtherReverse" in message
    assert "KVPLUG_DISABLE_PLUGINS" in message
    # The conflict stays one name's problem.
    assert isinstance(get_serde("test-rot"), _Rot)
    assert isinstance(get_serde("naive"), NaiveSerde)


@pytest.mark.usefixtures("clean_registry")
def test_a_plugin_serving_naive_conflicts_with_kvplug_whatever_was_used_first() -> None:
    class Impostor(NaiveSerde):
        pass

    reset_registry()
    naive = get_serde("naive")
    assert isinstance(naive, NaiveSerde)
    register_plugin(_ServesSerdes(Impostor), name="impostor-plugin")
    with pytest.raises(PluginConflict, match=r"by kvplug \(kvplug\.serde\.NaiveSerde\)") as info:
        get_serde("naive")
    assert "plugin 'impostor-plugin'" in str(info.value)


@pytest.mark.usefixtures("clean_registry")
def test_registering_a_serde_a_plugin_serves_is_a_conflict() -> None:
    reset_registry()
    register_plugin(_ServesSerdes(_Reverse), name="reverse-plugin")
    assert isinstance(get_serde("test-reverse"), _Reverse)
    with pytest.raises(PluginConflict, match="plugin 'reverse-plugin'"):
        register_serde(_OtherReverse)
    assert type(get_serde("test-reverse")) is _Reverse


@pytest.mark.usefixtures("clean_registry")
def test_a_plugin_returning_a_non_serde_warns_and_serves_nothing() -> None:
    reset_registry()
    register_plugin(_ServesSerdes(_Rot, int), name="int-plugin")  # type: ignore[arg-type]
    with pytest.warns(PluginWarning, match=r"plugin 'int-plugin'.*not a Serde subclass"):
        names = available_serdes()
    assert "naive" in names and "test-rot" not in names


def test_plugin_serdes_are_found_again_after_the_registry_is_swapped_and_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A test that swaps in a registry of its own and resets it on the way out must not leave
    the plugins' serdes forgotten under the registry that comes back."""
    assert "aesgcm" in available_serdes()  # kvplug-aesgcm, installed by the set-up
    with monkeypatch.context() as patch:
        patch.setattr(kvplug.registry, "_registry", kvplug.registry.Registry())
        assert "aesgcm" in available_serdes()
        kvplug.registry.reset_registry()
    assert "aesgcm" in available_serdes()


def test_a_first_party_serde_not_installed_gets_its_pip_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVPLUG_DISABLE_PLUGINS", "kvplug-serdes,kvplug-aesgcm")
    reset_registry()
    try:
        for name, line in (
            ("zstd", "pip install 'kvplug-serdes[zstd]'"),
            ("fp8", "pip install kvplug-serdes"),
            ("aesgcm", "pip install kvplug-aesgcm"),
        ):
            with pytest.raises(ConfigError, match=re.escape(line)) as caught:
                get_serde(name)
            assert "not installed" in str(caught.value) and "\n" not in str(caught.value)
    finally:
        monkeypatch.delenv("KVPLUG_DISABLE_PLUGINS")
        reset_registry()
    assert isinstance(get_serde("zstd"), Serde)


class _NeedsAPackage(NaiveSerde):
    name = "test-needs-a-package"
    description = "stands for a serde whose library is missing"

    @classmethod
    def unavailable(cls) -> str | None:
        return "it needs the nosuchlib package. Install it with: pip install nosuchlib"


@pytest.mark.usefixtures("clean_registry")
def test_a_serde_that_cannot_run_here_fails_at_open_and_shows_why_in_plugins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from click.testing import CliRunner
    from rich.console import Console

    from kvplug.runtime import cli
    from kvplug.runtime.cli import main

    monkeypatch.setattr(cli, "console", Console(width=240))

    register_serde(_NeedsAPackage, source="test")
    with pytest.raises(ConfigError, match="cannot run here: it needs the nosuchlib package"):
        get_serde("test-needs-a-package")
    assert serde_source("test-needs-a-package") == "test"
    result = CliRunner().invoke(main, ["plugins", "--json"])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(main, ["plugins"])
    assert "test-needs-a-package" in result.output and "pip install nosuchlib" in result.output
