"""Secrets never appear in kvplug's output (docs/urls.md, docs/config.md).

One rule (kvplug.secrets) decides what a secret is: a URL's password, and the value of every
option, query parameter or config entry whose name looks secret. Each issue-10 item (13-17)
has a focused regression test here; the last test plants one secret everywhere at once and
drives every CLI command and Python failure path, with every log record captured at DEBUG.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets as stdlib_secrets
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import quote

import pytest
import torch
from click.testing import CliRunner
from pydantic import SecretStr

import kvplug
from kvplug import BackendSpec, CacheKey, KvplugError
from kvplug.backend import BackendOptions
from kvplug.errors import InvalidBackendURL, UnknownOption
from kvplug.registry import create_backend, open_backend, reset_registry
from kvplug.runtime.cli import main
from kvplug.runtime.config import Config, TierConfig, load_config
from kvplug.runtime.store import open_store
from kvplug.runtime.sync import SyncClient
from kvplug.secrets import (
    SECRET_FILTER,
    install_log_filter,
    is_secret_name,
    mask_data,
    mask_text,
    mask_url,
    remember,
    remembered_only_inside,
)
from kvplug.url import BackendURL
from kvplug_cpu.backend import CpuBackend, CpuOptions
from kvplug_testing import free_port

ROOT = Path(__file__).parents[1]
CONTRACT_URL_ENV = "KVPLUG_CONTRACT_URL"


def new_secret(tag: str = "") -> str:
    """A value that cannot occur by chance in any output."""
    return f"Zq{tag}{stdlib_secrets.token_hex(8)}"


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
        create_backend(f"redis://127.0.0.1:{free_port()}", password=value)
    message = str(info.value) + repr(info.value)
    assert "829371645" not in message and "8293716" not in message and "Zq1x9w" not in message
    assert "password=***" in message


def test_invalid_secret_option_from_config_is_not_echoed_by_store_or_check(
    tmp_path: Path,
) -> None:
    config = tmp_path / "kvplug.yaml"
    config.write_text(
        f"tiers:\n  - url: redis://127.0.0.1:{free_port()}\n    sentinel_password: 829371645\n"
    )
    with pytest.raises(UnknownOption) as info:
        asyncio.run(open_store(load_config(config)))
    assert "829371645" not in str(info.value)
    code, output = invoke("check", "--config", str(config))
    assert code == 1 and "829371645" not in output and "sentinel_password" in output


# --------------------------------------------------------------------------- item 15


def _kvplug_contract(*args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != CONTRACT_URL_ENV}
    done = subprocess.run(
        [sys.executable, "-c", "from kvplug.runtime.cli import main; main()", "contract", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    return done.stdout + done.stderr


def test_kvplug_contract_never_prints_the_url_password_or_secret_options() -> None:
    password, option = new_secret("e"), new_secret("f")
    url = f"redis://app:{password}@127.0.0.1:{free_port()}"
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


def test_an_option_without_equals_sign_is_not_echoed() -> None:
    secret = new_secret("q")
    for pair in (f"password:{secret}", f"={secret}", secret):
        code, output = invoke("check", "cpu://", "-o", pair)
        assert code == 2 and "NAME=VALUE" in output and secret not in output
        output = _kvplug_contract("cpu://", "-o", pair, "-k", "never_stored_returns")
        assert "NAME=VALUE" in output and secret not in output, output


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
        store = await open_store(Config.from_dict({"tiers": [url]}))
        key = CacheKey("llama", 1, 0, 7)
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
    assert "op=batched_put" in caplog.text and "token=***" in everything
    assert token not in everything and api_key not in everything


def test_vendor_run_of_the_suite_with_long_tracebacks_and_locals_hides_secrets(
    tmp_path: Path,
) -> None:
    password, option = new_secret("m"), new_secret("n")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {k: v for k, v in os.environ.items() if k != CONTRACT_URL_ENV}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--pyargs",
            "kvplug_contracts",
            "-p",
            "no:cacheprovider",
            "--kvplug-url",
            f"redis://app:{password}@127.0.0.1:{free_port()}",
            "--kvplug-option",
            "db=x",
            "--kvplug-option",
            f"password={option}",
            "--tb=long",
            "--showlocals",
            "-rA",
            "-k",
            "many_threads or never_stored_returns",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 1 and "kvplug_options = " in output, output
    assert password not in output and option not in output
    assert "'password': '***'" in output


# --------------------------------------------------------------------------- the rule


@pytest.mark.parametrize(
    ("name", "secret"),
    [
        ("password", True),
        ("PASSWORD", True),
        ("sentinel_password", True),
        ("sentinelPassword", True),
        ("ssl_keyfile_password", True),
        ("passwd", True),
        ("pwd", True),
        ("token", True),
        ("auth_token", True),
        ("accessToken", True),
        ("secret", True),
        ("client_secret", True),
        ("key", True),
        ("api_key", True),
        ("apikey", True),
        ("X-Api-Key", True),
        ("access_key", True),
        ("secret_access_key", True),
        ("private_key", True),
        ("auth", True),
        ("Authorization", True),
        ("credential", True),
        ("credentials", True),
        ("x-amz-credential", True),
        ("sig", True),
        ("pass%77ord", True),
        ("key_prefix", False),
        ("max_tokens", False),
        ("tokenizer", False),
        ("ssl_keyfile", False),
        ("username", False),
        ("sentinel_username", False),
        ("db", False),
        ("max_size", False),
        ("serde", False),
        ("", False),
    ],
)
def test_is_secret_name(name: str, secret: bool) -> None:
    assert is_secret_name(name) is secret


def test_non_string_names_are_not_secret() -> None:
    assert not is_secret_name(3) and not is_secret_name(None)


@pytest.mark.parametrize(
    ("text", "masked"),
    [
        ("redis://app:pw@h:1", "redis://app:***@h:1"),
        ("redis://:pw@h:1/0", "redis://:***@h:1/0"),
        ("redis://app@h:1", "redis://app@h:1"),
        ("redis://us@er:pw@h:1", "redis://us@er:***@h:1"),
        ("redis://app:p@ss@h:1", "redis://app:***@h:1"),
        ("redis://app:pa/ss@h:1", "redis://app:***@h:1"),
        ("redis://app:pa?ss@h:1", "redis://app:***@h:1"),
        ("redis://app:pa#ss@h:1", "redis://app:***@h:1"),
        ("redis://app:pa://ss@h:1", "redis://app:***@h:1"),
        ("redis://app:pa::ss@h:1", "redis://app:***@h:1"),
        ("redis//app:pass@h:1", "redis//app:***@h:1"),
        ("app:pass@h:1", "app:***@h:1"),
        ("redis://h:1?db=2&token=abc&ttl=3", "redis://h:1?db=2&token=***&ttl=3"),
        ("redis://h:1?token=a&b&c=d", "redis://h:1?token=***&c=d"),
        ("redis://h:1?token=a#b", "redis://h:1?token=***"),
        ("audit::redis://u:pw@h:1::x", "audit::redis://u:***@h:1::x"),
        ("audit://?verify=true::redis://u:pw@h:1", "audit://?verify=true::redis://u:***@h:1"),
        ("audit://?x=1::file:///data/kv@node", "audit://?x=1::file:///data/kv@node"),
        ("audit://?token=t1::redis://h?api_key=k2", "audit://?token=***::redis://h?api_key=***"),
        ("redis://[::1]:6379", "redis://[::1]:6379"),
        ("redis://u:pw@[::1]:6379", "redis://u:***@[::1]:6379"),
        ("cpu://", "cpu://"),
        ("not a url", "not a url"),
    ],
)
def test_mask_url(text: str, masked: str) -> None:
    assert mask_url(text) == masked


def test_mask_data_masks_secret_keys_at_any_depth_and_urls_in_values() -> None:
    data = {
        "tiers": [{"url": "redis://:pw1@h:1?token=t1", "password": 829371645, "db": 2}],
        "extra_config": {"nested": {"access_key": ["k1"], "on": True}, "auth": None},
    }
    assert mask_data(data) == {
        "tiers": [{"url": "redis://:***@h:1?token=***", "password": "***", "db": 2}],
        "extra_config": {"nested": {"access_key": "***", "on": True}, "auth": None},
    }
    assert mask_data(SecretStr("abc")) == "***"


def test_mask_text_masks_urls_assignments_and_mapping_items_in_free_text() -> None:
    text = (
        "open redis://app:pw1@h:1 failed; password=829371645 "
        "{'sentinel_password': 'pw3', \"api_key\": \"pw4\"} op=get key=llama@1@0@7@half"
    )
    masked = mask_text(text)
    for secret in ("pw1", "829371645", "pw3", "pw4"):
        assert secret not in masked
    assert "redis://app:***@h:1" in masked and "password=***" in masked
    assert "key=llama@1@0@7@half" in masked  # a cache key in an audit line is not a secret


def test_remembered_secrets_are_hidden_wherever_they_turn_up() -> None:
    secret = new_secret("o")
    BackendURL.parse(f"redis://app:{secret}%40x@h:1")
    assert mask_text(f"AUTH failed for {secret}@x!") == "AUTH failed for ***!"
    assert mask_text(f"sent {quote(secret + '@x', safe='')}") == "sent ***"


def test_short_secrets_are_not_searched_for_in_free_text() -> None:
    BackendURL.parse("redis://app:ab@h:1")
    assert mask_text("about a cab") == "about a cab"


WORD_OF_THE_CODE = "kvplug-disk"  # property tests draw passwords from the code's strings
PATH_WITH_THAT_WORD = "/dev/shm/kvplug-disk-test-1/kv"


def test_one_test_may_remember_a_word_of_the_code_as_a_password() -> None:
    BackendURL.parse(f"redis://app:{WORD_OF_THE_CODE}@h:1")
    assert mask_text(PATH_WITH_THAT_WORD) == "/dev/shm/***-test-1/kv"


def test_the_next_test_does_not_inherit_that_password() -> None:
    # Runs after the test above (file order): the root conftest.py forgets what it remembered.
    assert mask_text(PATH_WITH_THAT_WORD) == PATH_WITH_THAT_WORD


def test_secrets_remembered_before_a_block_outlive_it() -> None:
    kept, passing = new_secret("k"), new_secret("t")
    remember(kept)
    with remembered_only_inside():
        remember(passing)
        assert mask_text(f"{kept} {passing}") == "*** ***"
    assert mask_text(f"{kept} {passing}") == f"*** {passing}"


def test_log_filter_masks_records_of_every_kvplug_logger(
    caplog: pytest.LogCaptureFixture,
) -> None:
    child = logging.getLogger("kvplug.test_secrets.child")
    install_log_filter()
    assert SECRET_FILTER in child.filters and SECRET_FILTER in logging.getLogger("kvplug").filters
    secret = new_secret("p")
    with caplog.at_level(logging.DEBUG):
        child.debug("connecting to %s", f"redis://app:{secret}@h:1")
        child.info("options %r", {"password": secret})
        try:
            raise ValueError(f"redis://app:{secret}@h:1 refused")
        except ValueError:
            child.exception("failed")
    assert len(caplog.records) == 3
    assert secret not in caplog.text and "redis://app:***@h:1" in caplog.text
    assert "ValueError" in caplog.text


def test_a_plugin_logger_gets_the_filter_when_its_backend_is_constructed(
    tokencpu: str,
) -> None:
    plugin_logger = logging.getLogger("kvplug_tokencpu_test")
    assert SECRET_FILTER not in plugin_logger.filters
    create_backend(f"{tokencpu}://")
    assert SECRET_FILTER in plugin_logger.filters


# --------------------------------------------------------------------------- acceptance
#
# One secret of each kind is planted everywhere a user can put one; every CLI command and every
# failure path of the Python API runs; everything printed, raised, warned and logged (at DEBUG,
# every logger) is collected, and no part of any secret may appear in it.

SERVER_PASSWORD = new_secret("srv")
"""The real server's password: the good paths use it."""
WRONG_PASSWORD = new_secret("bad")
NUMBER = str(100_000_000_000 + stdlib_secrets.randbelow(899_999_999_999))
"""A secret that is not a string: a YAML number."""
TOKEN = new_secret("tok")
PLANTED = (SERVER_PASSWORD, WRONG_PASSWORD, NUMBER, TOKEN)


def _pieces(secret: str) -> set[str]:
    """Every 8-character window of ``secret``: a partial leak is a leak."""
    return {secret[i : i + 8] for i in range(len(secret) - 7)}


LEAK_PIECES = set().union(*(_pieces(secret) for secret in PLANTED))


class Collected:
    """Everything the acceptance run printed, raised or warned, by where it came from."""

    def __init__(self) -> None:
        self.texts: list[tuple[str, str]] = []

    def add(self, where: str, text: str) -> None:
        self.texts.append((where, text))

    def raised(self, where: str, action: Any) -> BaseException | None:
        """Run ``action``; collect the str and repr of what it raises and of the exceptions
        a traceback of it shows (its cause, or its context unless suppressed)."""
        try:
            action()
        except Exception as error:
            current: BaseException | None = error
            while current is not None:
                self.add(where, f"{current}\n{current!r}")
                shown_context = None if current.__suppress_context__ else current.__context__
                current = current.__cause__ or shown_context
            return error
        return None

    def cli(self, where: str, *args: str, env: dict[str, str] | None = None) -> int:
        result = CliRunner().invoke(main, list(args), env=env)
        self.add(f"{where}: kvplug {' '.join(args)}", result.output)
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            self.raised(where, lambda: (_ for _ in ()).throw(result.exception))
        return result.exit_code

    def leaks(self) -> list[str]:
        return [
            f"{where}: {piece!r} in {text[:2000]!r}"
            for where, text in self.texts
            for piece in LEAK_PIECES
            if piece in text
        ]


def _malformed(secret: str) -> list[str]:
    left, right = secret[:12], secret[12:]
    return [
        f"redis://app:{left}{special}{right}@127.0.0.1:{free_port()}"
        for special in ("/", "?", "#", "/?#", "::", "://", "@")
    ] + [f"redis//app:{secret}@127.0.0.1:1", f"redis:app:{secret}@h:1", f"REDIS://app:{secret}@h"]


@pytest.fixture(scope="module")
def guarded_server() -> Iterator[Any]:
    from kvplug_testing import RedisServer

    with RedisServer(password=SERVER_PASSWORD) as server:
        yield server


def _cli_scenarios(out: Collected, tmp_path: Path, server: Any) -> None:
    good = f"redis://:{SERVER_PASSWORD}@127.0.0.1:{server.port}"
    unreachable = f"redis://app:{WRONG_PASSWORD}@127.0.0.1:{free_port()}?timeout=2"
    small = ["--shape", "2,2,16,64"]
    env = {
        "KVPLUG_TIERS": f"cpu://?max_size=64MiB;{good}",
        "KVPLUG_EXTRA_CONFIG": json_text({"redis_password": WRONG_PASSWORD, "token": NUMBER}),
        "REDIS_PASSWORD": SERVER_PASSWORD,
    }
    config = tmp_path / "secret.yaml"
    config.write_text(
        "tiers:\n"
        f"  - url: tokencpu://?token={TOKEN}&max_size=64MiB\n"
        f"    api_key: {WRONG_PASSWORD}\n"
        f"  - url: redis://127.0.0.1:{server.port}\n"
        f"    password: {SERVER_PASSWORD}\n"
        "extra_config:\n"
        f"  secret_key: {NUMBER}\n"
        f"  credentials: [{WRONG_PASSWORD}]\n"
    )
    sentinel = tmp_path / "sentinel.yaml"
    sentinel.write_text(
        f"tiers:\n  - url: redis+sentinel://127.0.0.1:{free_port()}/mymaster?timeout=1\n"
        f"    sentinel_password: {NUMBER}\n"
    )
    numeric = tmp_path / "numeric.yaml"
    numeric.write_text(
        f"tiers:\n  - url: redis://127.0.0.1:{server.port}\n    password: {NUMBER}\n"
    )
    unreachable_config = tmp_path / "unreachable.yaml"
    unreachable_config.write_text(f"tiers:\n  - cpu://\n  - '{unreachable}'\n")
    bad_configs = {
        "malformed": "tiers:\n" + "".join(f"  - '{url}'\n" for url in _malformed(TOKEN)[:1]),
        "bad item": f"tiers:\n  - {{url: 5, password: {TOKEN}}}\n",
        "bad yaml": f"tiers:\n  - url: cpu://\n    password: {TOKEN}\n   - x: [\n",
        "duplicate": f"tiers:\n  - url: cpu://\n    password: {TOKEN}\n    password: {TOKEN}\n",
        "mixed forms": f"remote_url: 'redis://:{TOKEN}@h:1'\ntiers: [cpu://]\n",
        "bad remote": f"remote_url: 'redis://:{TOKEN}@h:notaport'\n",
        "audit": f"remote_url: 'audit://h:1?token={TOKEN}'\n",
    }

    out.cli("plugins", "plugins", env=env)
    out.cli("plugins", "plugins", "--json", env=env)
    out.cli("config from env", "config", env=env)
    out.cli("config file", "config", "--config", str(config))
    out.cli("config numeric", "config", "--config", str(numeric))
    out.cli("config sentinel", "config", "--config", str(sentinel))
    out.cli("check sentinel", "check", "--config", str(sentinel), *small)
    out.cli("config env beside tiers", "config", env={"KVPLUG_REMOTE_URL": unreachable, **env})
    bad_envs = {
        "malformed remote": {"KVPLUG_REMOTE_URL": _malformed(TOKEN)[0]},
        "malformed tiers": {"KVPLUG_TIERS": f"cpu://;{_malformed(TOKEN)[1]}"},
        "unknown variable": {"KVPLUG_PASSWORD": TOKEN},
        "bad json": {"KVPLUG_EXTRA_CONFIG": f'{{"password": "{TOKEN}"'},
        "bad value": {"KVPLUG_CHUNK_SIZE": TOKEN},
    }
    for name, variables in bad_envs.items():
        assert out.cli(f"config env {name}", "config", env=variables) == 1
        assert out.cli(f"check env {name}", "check", env=variables) == 1
    for name, text in bad_configs.items():
        path = tmp_path / f"{name.replace(' ', '-')}.yaml"
        path.write_text(text)
        assert out.cli(f"config {name}", "config", "--config", str(path)) == 1
        assert out.cli(f"check {name}", "check", "--config", str(path)) == 1

    assert out.cli("check good", "check", good, *small, "--rounds", "1") == 0
    assert (
        out.cli("check env password", "check", f"redis://127.0.0.1:{server.port}", *small, env=env)
        == 0
    )
    out.cli(
        "check option password",
        "check",
        f"redis://127.0.0.1:{server.port}",
        "-o",
        f"password={SERVER_PASSWORD}",
        *small,
    )
    out.cli("check config", "check", "--config", str(config), *small)
    out.cli("check numeric", "check", "--config", str(numeric), *small)
    out.cli("check unreachable", "check", unreachable, *small)
    out.cli(
        "check wrong password",
        "check",
        f"redis://:{WRONG_PASSWORD}@127.0.0.1:{server.port}",
        *small,
    )
    out.cli("check bad option", "check", good, "-o", "db=x", "-o", f"sentinel_password={TOKEN}")
    out.cli("check query token", "check", f"{good}?token={TOKEN}")
    out.cli("check query password", "check", f"redis://127.0.0.1:{server.port}?password={TOKEN}")
    out.cli("check audit", "check", f"audit::{good}", *small, "--rounds", "1")
    for url in _malformed(TOKEN):
        assert out.cli("check malformed", "check", url) == 1
    assert out.cli("bench config", "bench", "--config", str(config), *small, "--count", "2") == 0
    out.cli(
        "bench unreachable", "bench", "--config", str(unreachable_config), *small, "--count", "2"
    )
    out.cli("bench numeric", "bench", "--config", str(numeric), *small, "--count", "2")


@contextlib.contextmanager
def warnings_recorded() -> Iterator[list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def json_text(value: Any) -> str:
    import json

    return json.dumps(value)


def _contract_scenarios(out: Collected, server: Any) -> None:
    good = f"redis://:{SERVER_PASSWORD}@127.0.0.1:{server.port}"
    selected = ["-k", "never_stored or many_threads", "--timeout", "10"]
    out.add("contract good", _kvplug_contract(good, *selected))
    out.add(
        "contract bad option",
        _kvplug_contract(good, "-o", "db=x", "-o", f"sentinel_password={TOKEN}", *selected),
    )
    out.add(
        "contract unreachable",
        _kvplug_contract(f"redis://:{WRONG_PASSWORD}@127.0.0.1:{free_port()}?timeout=1", *selected),
    )
    out.add("contract malformed", _kvplug_contract(_malformed(TOKEN)[0], *selected))


def _python_scenarios(out: Collected, server: Any) -> None:
    good = f"redis://:{SERVER_PASSWORD}@127.0.0.1:{server.port}"
    unreachable = f"redis://:{WRONG_PASSWORD}@127.0.0.1:{free_port()}?timeout=1"
    for url in _malformed(TOKEN):
        out.raised("parse", lambda url=url: BackendURL.parse(url))
        out.raised("config", lambda url=url: Config.from_dict({"tiers": [url]}))
        out.raised("open", lambda url=url: asyncio.run(open_backend(url)))
    out.raised("bad option", lambda: create_backend(good, password=int(NUMBER)))
    out.raised("bad option", lambda: create_backend(good, sentinel_password=[TOKEN]))
    out.raised("query password", lambda: create_backend(f"{good}?password={TOKEN}"))
    out.raised(
        "wrong password",
        lambda: asyncio.run(_round_trip(f"redis://:{WRONG_PASSWORD}@127.0.0.1:{server.port}")),
    )
    out.raised("unreachable", lambda: asyncio.run(_round_trip(unreachable)))
    config = Config.from_dict(
        {
            "tiers": [
                f"tokencpu://?max_size=64MiB&secret={TOKEN}",
                {"url": f"audit::{good}", "db": 1},
                {"url": unreachable, "password": TOKEN},
            ],
            "extra_config": {"secret_key": TOKEN},
        }
    )
    out.add("config repr", f"{config!r} {config.tiers!r} {[str(t) for t in config.tiers]}")
    out.add("store", asyncio.run(_store_texts(config)))
    misplaced = Config.from_dict({"tiers": [{"url": unreachable, "sentinel_password": TOKEN}]})
    out.raised("store misplaced option", lambda: asyncio.run(open_store(misplaced)))
    client = SyncClient(unreachable)
    out.raised("sync client", lambda: client.get(CacheKey("m", 1, 0, 1)).result(30))
    out.add("sync client repr", repr(client))
    client.close()


async def _round_trip(url: str) -> None:
    backend = await open_backend(url)
    try:
        await backend.get(CacheKey("m", 1, 0, 1))
    finally:
        await backend.close()


async def _store_texts(config: Config) -> str:
    store = await open_store(config)
    key = CacheKey("llama", 1, 0, 7)
    obj = store.allocate((2, 2, 16, 64), torch.float16)
    assert obj is not None
    refused = ""
    try:  # refused while a tier that outlives the process is unreachable: its text counts too
        await store.put(key, obj)
    except KvplugError as error:
        refused = f"{type(error).__name__}: {error}"
    obj.release()
    await store.flush(timeout=30)
    hit = await store.get(key)
    if hit is not None:
        hit.release()
    texts = [
        refused,
        repr(store.tier_names),
        store.prometheus_text(),
        repr(store.stats()),
        repr(store.health()),
        repr(store.tiers),
    ]
    await store.close()
    return "\n".join(texts)


@pytest.mark.redis
def test_planted_secrets_never_appear_in_any_output_log_or_error(
    guarded_server: Any,
    tokencpu: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    out = Collected()
    with caplog.at_level(logging.DEBUG), warnings_recorded() as warned:
        _cli_scenarios(out, tmp_path, guarded_server)
        _python_scenarios(out, guarded_server)
        _contract_scenarios(out, guarded_server)
    out.add("warnings", "\n".join(str(w.message) for w in warned))
    out.add("log text", caplog.text)
    for record in caplog.records:
        out.add(f"log record {record.name}", f"{record.getMessage()}\n{record.exc_text or ''}")
    captured = capfd.readouterr()
    out.add("process stdout", captured.out)
    out.add("process stderr", captured.err)
    # The scenarios did run: the good paths passed and the failure paths said why.
    everything = "\n".join(text for _, text in out.texts)
    assert "OK" in everything and "PASS" in everything and "FAIL" in everything
    assert "***" in everything and "op=get" in caplog.text and "verified" in everything
    assert not out.leaks(), "\n".join(out.leaks()[:5])
