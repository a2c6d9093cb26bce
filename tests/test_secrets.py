"""Secrets never appear in kvplug's output (docs/urls.md, docs/config.md).

One rule (kvplug.secrets) decides what a secret is: a URL's password, and the value of every
option, query parameter or config entry whose name looks secret. Each issue-10 item (13-17)
has a focused regression test here; the last test plants one secret everywhere at once and
drives every CLI command and Python failure path, with every log record captured at DEBUG.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets as stdlib_secrets
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from click.testing import CliRunner
from pydantic import SecretStr

import kvplug
from kvplug import BackendSpec, CacheKey, KvplugError
from kvplug.backend import BackendOptions
from kvplug.cli import main
from kvplug.config import Config, TierConfig, load_config
from kvplug.errors import InvalidBackendURL, UnknownOption
from kvplug.registry import create_backend, open_backend, reset_registry
from kvplug.store import Store
from kvplug.url import BackendURL, split_chain
from kvplug_cpu.backend import CpuBackend, CpuOptions

ROOT = Path(__file__).parents[1]
CONTRACT_URL_ENV = "KVPLUG_CONTRACT_URL"


def new_secret(tag: str = "") -> str:
    """A value that cannot occur by chance in any output."""
    return f"Zq{tag}{stdlib_secrets.token_hex(8)}"


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def invoke(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)
    return result.exit_code, result.output


class TokenOptions(CpuOptions):
    """A cpu tier that also takes secret-named options, as a vendor's backend might."""

    token: str | None = None
    api_key: str | None = None
    secret: str | None = None
    password: SecretStr | None = None


class TokenCpu(CpuBackend):
    """``tokencpu://``: ``cpu://`` with secret-named options (for the tests here)."""

    Options: ClassVar[type[BackendOptions]] = TokenOptions


@pytest.fixture
def tokencpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A fresh registry that also serves ``tokencpu://``."""
    monkeypatch.setattr(kvplug.registry, "_registry", kvplug.registry.Registry())
    kvplug.register_backend(BackendSpec("tokencpu", ("tokencpu",), f"{__name__}:TokenCpu"))
    yield "tokencpu"
    reset_registry()


# --------------------------------------------------------------------------- item 13


def test_kvplug_config_masks_password_options_of_every_tier(tmp_path: Path) -> None:
    secret, number, nested = new_secret("a"), "829371645", new_secret("b")
    config = tmp_path / "kvplug.yaml"
    config.write_text(
        "tiers:\n"
        "  - url: redis://127.0.0.1:6379\n"
        f"    password: {secret}\n"
        f"  - url: redis+sentinel://127.0.0.1:26379/mymaster\n"
        f"    sentinel_password: {number}\n"
        "    db: 3\n"
        "extra_config:\n"
        f"  s3_credentials: {{access_key: {nested}}}\n"
    )
    code, output = invoke("config", "--config", str(config))
    assert code == 0, output
    for planted in (secret, number, nested):
        assert planted not in output
    assert "password: '***'" in output and "sentinel_password: '***'" in output
    assert "db: 3" in output and "url: redis://127.0.0.1:6379" in output


def test_kvplug_config_masks_query_secrets_and_env_tiers() -> None:
    secret, token = new_secret("c"), new_secret("d")
    env = {"KVPLUG_TIERS": f"redis://app:{secret}@127.0.0.1:6379?token={token}&db=1"}
    code, output = invoke("config", env=env)
    assert code == 0, output
    assert secret not in output and token not in output
    assert "redis://app:***@127.0.0.1:6379?token=***&db=1" in output


def test_tier_and_config_reprs_mask_secret_named_options_of_any_type() -> None:
    tier = TierConfig("cpu://", {"password": 829371645, "api_key": ["k1x9"], "max_size": 1})
    text = repr(tier) + repr(Config.from_dict({"tiers": [tier]}))
    assert "829371645" not in text and "k1x9" not in text
    assert "'max_size': 1" in text


# --------------------------------------------------------------------------- item 14


@pytest.mark.parametrize("value", [829371645, 8293716.45, ["Zq1x9w"], {"p": "Zq1x9w"}])
def test_invalid_password_option_value_is_not_echoed(value: object) -> None:
    with pytest.raises(UnknownOption) as info:
        create_backend(f"redis://127.0.0.1:{closed_port()}", password=value)
    message = str(info.value) + repr(info.value)
    assert "829371645" not in message and "8293716" not in message and "Zq1x9w" not in message
    assert "password=***" in message


def test_invalid_secret_option_from_config_is_not_echoed_by_store_or_check(
    tmp_path: Path,
) -> None:
    config = tmp_path / "kvplug.yaml"
    config.write_text(
        f"tiers:\n  - url: redis://127.0.0.1:{closed_port()}\n    sentinel_password: 829371645\n"
    )
    with pytest.raises(UnknownOption) as info:
        asyncio.run(Store.open(load_config(config)))
    assert "829371645" not in str(info.value)
    code, output = invoke("check", "--config", str(config))
    assert code == 1 and "829371645" not in output and "sentinel_password" in output


# --------------------------------------------------------------------------- item 15


def _kvplug_contract(*args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != CONTRACT_URL_ENV}
    done = subprocess.run(
        [sys.executable, "-c", "from kvplug.cli import main; main()", "contract", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    return done.stdout + done.stderr


def test_kvplug_contract_never_prints_the_url_password_or_secret_options() -> None:
    password, option = new_secret("e"), new_secret("f")
    url = f"redis://app:{password}@127.0.0.1:{closed_port()}"
    # db=x fails inside tests that take kvplug_url and kvplug_options as arguments, so pytest
    # prints their values in the failure's traceback.
    output = _kvplug_contract(
        url,
        "-o",
        "db=x",
        "-o",
        f"sentinel_password={option}",
        "-k",
        "many_threads or never_stored_returns",
        "--timeout",
        "5",
    )
    assert "kvplug_url = " in output and "FAIL" in output, output
    assert password not in output and option not in output
    assert "redis://app:***@127.0.0.1" in output


# --------------------------------------------------------------------------- item 16


@pytest.mark.parametrize("special", ["/", "?", "#", "/?#@", "::", "@", "://"])
def test_url_with_special_characters_in_its_password_never_shows_it(special: str) -> None:
    left, right = new_secret("g"), new_secret("h")
    text = f"redis://u:{left}{special}{right}@127.0.0.1:6379"
    for attempt in (
        lambda: BackendURL.parse(text),
        lambda: Config.from_dict({"tiers": [text]}),
        lambda: Config.from_dict({"remote_url": text}),
        lambda: create_backend(text),
    ):
        try:
            result = attempt()
        except KvplugError as error:
            shown = str(error) + repr(error)
            assert "***" in shown
        else:  # '@' is legal in a password: the last '@' ends it
            shown = str(result) + repr(result)
        assert left not in shown and right not in shown, shown


def test_malformed_url_in_a_chain_or_without_scheme_separator_is_masked() -> None:
    secret = new_secret("i")
    for text in (
        f"audit::redis://u:{secret[:6]}/{secret[6:]}@h:1",
        f"audit://?fail_rate=0.1::redis://u:{secret[:6]}?{secret[6:]}@h:1",
        f"redis//u:{secret}@h:1",
        f"redis:u:{secret}@h:1",
        f"redis://u:{secret}@h:1/db@x",
    ):
        with pytest.raises(InvalidBackendURL) as info:
            Config.from_dict({"tiers": [text]})
        assert secret[:6] not in str(info.value) and secret[6:] not in str(info.value), text


def test_at_sign_in_a_path_without_a_password_stays_legal_and_readable() -> None:
    url = BackendURL.parse("file:///var/cache/kv@node1")
    assert url.path == "/var/cache/kv@node1" and url.password is None
    assert "***" not in str(url) and "kv" in str(url)


# --------------------------------------------------------------------------- item 17

SECRET_NAMES = [
    "token",
    "secret",
    "password",
    "key",
    "sentinel_password",
    "api_key",
    "apiKey",
    "access_key",
    "auth",
    "credential",
    "client_secret",
    "auth_token",
    "X-Api-Key",
    "pwd",
]


@pytest.mark.parametrize("name", SECRET_NAMES)
def test_secret_named_query_options_are_masked_in_str_and_repr(name: str) -> None:
    secret = new_secret("j")
    url = BackendURL.parse(f"redis://h:6379?db=2&{name}={secret}&ttl=5")
    shown = str(url) + repr(url) + str([url])
    assert secret not in shown
    assert f"{name}=***" in shown and "db=2" in shown and "ttl=5" in shown
    assert url.options[name] == secret
    assert secret in url.secret_url()


@pytest.mark.parametrize("name", ["key_prefix", "max_tokens", "db", "timeout", "ttl"])
def test_ordinary_option_names_are_not_masked(name: str) -> None:
    assert str(BackendURL.parse(f"redis://h:6379?{name}=v1")) == f"redis://h:6379?{name}=v1"


def test_query_secrets_never_reach_tier_names_metrics_health_or_audit_lines(
    tokencpu: str, caplog: pytest.LogCaptureFixture
) -> None:
    token, api_key = new_secret("k"), new_secret("l")
    url = f"audit::{tokencpu}://?token={token}&api_key={api_key}&max_size=64MiB"

    async def scenario() -> list[str]:
        store = await Store.open(Config.from_dict({"tiers": [url]}))
        key = CacheKey("vllm", "llama", 1, 0, 7)
        obj = store.allocate((2, 2, 16, 8), torch.float16)
        assert obj is not None
        await store.put(key, obj)
        obj.release()
        await store.flush()
        hit = await store.get(key)
        assert hit is not None
        hit.release()
        texts = [
            *store.tier_names,
            store.prometheus_text(),
            repr(store.stats()),
            repr(store.health()),
            repr(store.tiers),
        ]
        await store.close()
        return texts

    with caplog.at_level(logging.DEBUG):
        texts = asyncio.run(scenario())
    everything = "\n".join(texts) + caplog.text
    assert "op=put" in caplog.text and "token=***" in everything
    assert token not in everything and api_key not in everything
