"""The tests that the Redis and the Valkey tier each run against servers of their own family:
a tier's test module subclasses a class here as ``Test...``, so that its distribution tests
itself when run alone. The servers come from :mod:`kvplug_testing.server_fixtures` (the
``conftest.py`` names the family); what differs by tier is a class attribute.

* :class:`TierScenarios`: the Sentinel service's default, the stored layout, values over the
  server's proto-max-bulk-len, a Cluster batch over every node, a client library of an untested
  major version, and TLS with a client certificate.
* :class:`ReleasesOnCancelScenarios`: ``releases_on_cancel`` on every path the bytes take
  (kvplug's own connections, the client library, TLS, Sentinel, Cluster; asyncio and uvloop),
  with :mod:`kvplug_testing.cancellation`'s checks.

Imports torch, pytest and kvplug, like :mod:`kvplug_testing.tier_checks`: import it by name."""

from __future__ import annotations

import gc
import logging
from collections.abc import Sequence
from types import ModuleType
from typing import Any, ClassVar

import pytest

import kvplug
from kvplug import CacheKey, PluginLoadError
from kvplug_testing.cancellation import OPERATIONS, MasterOf, Tap, check_operation, run_on
from kvplug_testing.cluster import RedisCluster
from kvplug_testing.redis import RedisServer
from kvplug_testing.sentinel import SentinelGroup
from kvplug_testing.server_family import ServerFamily
from kvplug_testing.tier_checks import (
    keys_of,
    make_obj,
    new_model,
    opened,
    oversize_values_are_refused,
    releasing,
    round_trip,
    run,
    same,
    the_client_certificate_is_required,
)

LOOPS = ("asyncio", "uvloop")


class TierScenarios:
    """What a tier's servers and client library must do, whichever the family."""

    client_module: ClassVar[ModuleType]
    """The client library's module, whose ``__version__`` a test sets to an untested one."""
    client_requirement: ClassVar[str]
    """The pip requirement the refusal of an untested version names: ``redis>=5.3,<9``."""
    untested_versions: ClassVar[Sequence[str]]
    """Versions just outside :attr:`client_requirement`."""

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "untested_version" in metafunc.fixturenames:
            metafunc.parametrize("untested_version", self.untested_versions)

    def test_the_sentinel_service_defaults_to_the_tiers_environment_variable(
        self, server_family: ServerFamily, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """REDIS_SERVICE_NAME for redis+sentinel://, VALKEY_SERVICE_NAME for
        valkey+sentinel://, never the other's; a service in the URL's path wins."""
        for family in ("redis", "valkey"):
            monkeypatch.setenv(f"{family.upper()}_SERVICE_NAME", f"{family}-one")
        scheme = f"{server_family.name}+sentinel"
        backend: Any = kvplug.create_backend(f"{scheme}://h1:26379")
        assert backend.target.service == f"{server_family.name}-one"
        explicit: Any = kvplug.create_backend(f"{scheme}://h1:26379/from-path")
        assert explicit.target.service == "from-path"

    def test_one_key_per_chunk_holds_the_whole_frame(self, standalone: RedisServer) -> None:
        assert run(round_trip(standalone.url, key_prefix="tier:"))
        model = new_model()

        async def put_one() -> None:
            obj = make_obj(1)
            with releasing(obj):
                async with opened(standalone.url) as backend:
                    await backend.put(keys_of(model, 1)[0], obj)

        run(put_one())
        with standalone.client() as client:
            names = [k.decode() for k in client.scan_iter(match=f"*{model}*")]
            assert names == [f"kvplug:{model}@1@0@0@half"]
            value = client.get(names[0])
            assert isinstance(value, bytes) and value[:4] == b"KVPF"
            assert client.ttl(names[0]) == -1

    @pytest.mark.parametrize("mib", [2, 64], ids=["2MiB-error-reply", "64MiB-reset-mid-send"])
    def test_a_value_over_the_servers_proto_max_bulk_len_is_capacity_exceeded(
        self, small_bulk_server: RedisServer, mib: int
    ) -> None:
        """The server answers a value a little over its limit with a protocol error and drops
        the connection; a large one it cuts off mid-send. Either is a size error, not an
        outage."""
        run(oversize_values_are_refused(small_bulk_server.url, mib))

    def test_a_value_over_a_clusters_proto_max_bulk_len_is_capacity_exceeded(
        self, server_family: ServerFamily
    ) -> None:
        with server_family.cluster(extra_config={"proto-max-bulk-len": "1mb"}) as small_bulk:
            run(oversize_values_are_refused(small_bulk.url, 64))

    def test_cluster_batches_and_listing_span_every_node(self, cluster: RedisCluster) -> None:
        keys = keys_of(new_model(), 64)
        objs = [make_obj(2000 + n) for n in range(len(keys))]

        async def scenario() -> set[CacheKey]:
            async with opened(cluster.url) as backend:
                await backend.batched_put(keys, objs)
                got = await backend.batched_get(keys)
                with releasing(*got):
                    assert all(same(o, g) for o, g in zip(objs, got, strict=True))
                assert await backend.batched_contains(keys) == len(keys)
                await backend.remove(keys[10])
                assert await backend.batched_contains(keys) == 10
                return {key async for key in backend.list_keys()}

        with releasing(*objs):
            assert run(scenario()) == set(keys) - {keys[10]}
        for node in cluster.nodes:
            with node.client() as client:
                assert client.dbsize() > 0  # every master holds some of the batch

    def test_an_untested_client_major_fails_at_open_with_the_fix(
        self, server_family: ServerFamily, untested_version: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(self.client_module, "__version__", untested_version)
        with pytest.raises(PluginLoadError) as refused:
            run(kvplug.open_backend(f"{server_family.name}://127.0.0.1:1"))
        message = str(refused.value)
        library = f"{self.client_module.__name__}-py"
        assert f"{library} {untested_version} is installed" in message, message
        assert f"pip install '{self.client_requirement}'" in message, message

    def test_tls_with_a_client_certificate_against_redis_server(
        self, server_family: ServerFamily
    ) -> None:
        """The tier's TLS scheme (the client library's SSL connection, certificates, mutual
        TLS) against redis-server's TLS, which Debian builds in (the valkey-server of a wheel
        has none)."""
        with RedisServer(tls=True, tls_auth_clients=True) as server:
            scheme = server_family.server.tls_scheme
            the_client_certificate_is_required(server.url.replace("rediss://", f"{scheme}://"))


class ReleasesOnCancelScenarios:
    """A cancelled ``get_into`` or put (and their batched forms) lets go of the caller's memory
    by the time its cancellation ends, on every path through the tier's backend."""

    urls: ClassVar[Sequence[str]]
    """A URL of each of the tier's modes, none of them reachable."""
    tls_loops: ClassVar[Sequence[str]] = LOOPS
    """The event loops the checks over TLS run on."""
    cluster_loops: ClassVar[Sequence[str]] = LOOPS
    """The event loops the checks against a Cluster run on."""

    library: ClassVar[dict[str, Any]] = {"direct_reads": False, "direct_writes": False}
    """Options that send reads and writes through the client library."""

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        for argument, loops in (("tls_loop", self.tls_loops), ("cluster_loop", self.cluster_loops)):
            if argument in metafunc.fixturenames:
                metafunc.parametrize(argument, loops)

    @pytest.mark.parametrize("loop", LOOPS)
    @pytest.mark.parametrize("operation", list(OPERATIONS))
    @pytest.mark.parametrize("path", ["direct", "client library"])
    def test_a_cancelled_operation_lets_go_of_the_callers_memory(
        self,
        standalone: RedisServer,
        server_family: ServerFamily,
        path: str,
        operation: str,
        loop: str,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        """Through a :class:`Tap`, which also sees any byte of the caller's buffer sent after
        the cancellation (a half-sent command the server then drops)."""
        options = self.library if path == "client library" else {}
        with caplog.at_level(logging.ERROR, logger="asyncio"), Tap(*standalone.address) as tap:
            url = tap.url(server_family.name)
            run_on(loop, check_operation(url, tap, operation, **options))
            gc.collect()
        # A reply future that a cancelled send left behind is let go of, not failed unseen later.
        assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]

    @pytest.mark.parametrize("operation", list(OPERATIONS))
    def test_over_tls_a_cancelled_operation_lets_go_of_the_callers_memory(
        self, tls_server: RedisServer, operation: str, tls_loop: str
    ) -> None:
        """Reads on kvplug's own TLS connections (an asyncio transport), puts through the client
        library."""
        run_on(tls_loop, check_operation(tls_server.url, tls_server, operation))

    @pytest.mark.parametrize("operation", list(OPERATIONS))
    def test_with_sentinel_a_cancelled_operation_lets_go_of_the_callers_memory(
        self, sentinel_group: SentinelGroup, operation: str
    ) -> None:
        hold = MasterOf(sentinel_group)
        run_on("asyncio", check_operation(sentinel_group.url, hold, operation))

    @pytest.mark.parametrize("operation", list(OPERATIONS))
    def test_on_a_cluster_a_cancelled_operation_lets_go_of_the_callers_memory(
        self, cluster: RedisCluster, operation: str, cluster_loop: str
    ) -> None:
        run_on(cluster_loop, check_operation(cluster.url, cluster, operation))

    def test_every_mode_declares_releases_on_cancel(self) -> None:
        for url in self.urls:
            for options in ({}, self.library):
                assert kvplug.create_backend(url, **options).capabilities.releases_on_cancel, url


__all__ = ["LOOPS", "ReleasesOnCancelScenarios", "TierScenarios"]
