"""KvplugConnector inside LMCache's own in-process code, against cpu://, file:// and a real
redis-server: LMCache's ``basic_check --mode test_remote``, an ``LMCacheEngine`` round trip,
the failure behaviour LMCache expects (misses, failed puts, no hang, recovery) and loud set-up
errors. Runs in each LMCache venv (0.5.6 and 0.5.7rc2)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.exceptions import IrrecoverableException
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.storage_backend import CreateStorageBackends
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.v1.storage_backend.remote_backend import RemoteBackend
from lmcache_support import (
    CHUNK,
    DEADLINE,
    DOCUMENTED_URL,
    HIDDEN,
    LAYERS,
    PREFIX,
    connector_of,
    documented_check,
    documented_config,
    engine_config,
    engine_key,
    filled,
    metadata,
    plugin_extra,
    remote_backend,
    same_bits,
    wait_until,
)

from kvplug.errors import KvplugError
from kvplug.runtime.engine import open_client
from kvplug.stats import summarize
from kvplug_lmcache.connector import (
    INPROCESS_PACKAGE,
    KvplugConnector,
    KvplugConnectorError,
    inprocess_module,
)
from kvplug_testing import RedisServer
from kvplug_testing.threads import loop_thread

cache_engine: Any = inprocess_module("cache_engine")
GPUConnectorInterface: Any = inprocess_module("gpu_connector.gpu_connectors").GPUConnectorInterface

BACKENDS = ["cpu", "file", "redis", "tiers"]
"""kvplug URLs, and a kvplug tiers YAML (a cpu tier over a file tier)."""


# -- LMCache scaffolding ---------------------------------------------------------------------------


class CpuKVConnector(GPUConnectorInterface):  # type: ignore[misc]
    """LMCache's GPU connector interface over a CPU tensor ``kv`` of shape
    ``[2, layers, tokens, hidden]`` passed as a keyword to store and retrieve."""

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, LAYERS, num_tokens, HIDDEN])

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        memory_obj.tensor.copy_(kwargs["kv"][:, :, start:end])

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        kwargs["kv"][:, :, start:end].copy_(memory_obj.tensor)

    def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(obj, start, end, **kwargs)

    def batched_to_gpu(
        self, memory_objs: Any = None, starts: Any = None, ends: Any = None, **kwargs: Any
    ) -> None:
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(obj, start, end, **kwargs)


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def text(self, level: int = logging.DEBUG) -> str:
        return "\n".join(r.getMessage() for r in self.records if r.levelno >= level)


@contextlib.contextmanager
def lmcache_logs() -> Iterator[Records]:
    """What LMCache and the connector log (their loggers do not propagate to the root)."""
    handler = Records()
    names = [
        name
        for name in list(logging.root.manager.loggerDict)
        if name.startswith(("lmcache", "kvplug"))
    ]
    loggers = [logging.getLogger(name) for name in names]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield handler
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


def connector_backend(connector: KvplugConnector) -> Any:
    return connector._client.backend


# -- backends --------------------------------------------------------------------------------------


@pytest.fixture(params=BACKENDS)
def backend(
    request: pytest.FixtureRequest, tmp_path: Path
) -> tuple[str, dict[str, Any], Callable[[], int]]:
    """The backend's name, the connector's settings and a count of the objects stored there
    (-1 for cpu://: its tier lives in the process that opened it, so only the connector's
    counters tell)."""
    name = request.param
    directory = tmp_path / "kv"
    if name == "cpu":
        return name, {"url": "cpu://?max_size=64MiB"}, lambda: -1
    if name == "file":
        return name, {"url": directory.as_uri()}, lambda: len(list(directory.rglob("*.kv")))
    if name == "tiers":
        tiers = tmp_path / "kvplug.yaml"
        tiers.write_text(f"tiers: ['cpu://?max_size=64MiB', '{directory.as_uri()}']\n")
        return name, {"config": str(tiers)}, lambda: len(list(directory.rglob("*.kv")))
    server: RedisServer = request.getfixturevalue("redis_server")
    with server.client() as client:
        client.flushall()

    def stored() -> int:
        with server.client() as client:
            return int(client.dbsize())

    return name, {"url": server.url}, stored


# -- LMCache's own checks --------------------------------------------------------------------------


def run_basic_check(
    tmp_path: Path, settings: dict[str, Any], config: dict[str, Any] | None = None
) -> subprocess.CompletedProcess[str]:
    """LMCache's ``basic_check --mode test_remote`` on ``config`` (LMCache's YAML as a dict),
    by default one of the kvplug plugin with ``settings`` and ``remote_url`` (which the check
    reads), as the docs' command gives it (``LMCACHE_REMOTE_URL``)."""
    if config is None:
        config = {
            "chunk_size": 256,
            "local_cpu": True,
            "max_local_cpu_size": 0.1,
            "remote_serde": "naive",
            "remote_storage_plugins": ["kvplug"],
            "extra_config": plugin_extra(**settings),
        }
    env, command = documented_check()
    assert command == ["python", "-m", "lmcache.inprocess.v1.basic_check", *CHECK_MODE], command
    path = tmp_path / "lmcache.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return subprocess.run(
        [sys.executable, "-m", f"{INPROCESS_PACKAGE}.basic_check", *CHECK_MODE],
        env={**os.environ, **env, "LMCACHE_CONFIG_FILE": str(path), "LMCACHE_LOG_LEVEL": "INFO"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


CHECK_MODE = ["--mode", "test_remote"]


def passed_basic_check(result: subprocess.CompletedProcess[str]) -> str:
    """``basic_check``'s output, once it is known to have stored and read back 5 chunks."""
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "Test Failed" not in output, output
    assert "Validation (content correct): 5/5 passed" in output, output
    assert output.count("Validation: 5/5 passed") == 3, output  # exists x2, put
    closed = "5 chunks written (5120 bytes, 0 put failures), 5 read (5 hits, 0 misses, 5120 bytes)"
    assert closed in output, output
    return output


def test_basic_check_test_remote(
    backend: tuple[str, dict[str, Any], Callable[[], int]], tmp_path: Path
) -> None:
    """LMCache's basic_check stores 5 chunks through the connector and reads them back
    bit-exact, and they are really in the kvplug store."""
    _, settings, stored = backend
    passed_basic_check(run_basic_check(tmp_path, settings))
    if stored() != -1:
        assert stored() == 5


@pytest.mark.parametrize("kind", ["file", "redis"])
def test_the_documented_config_passes_lmcache_basic_check(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """docs/lmcache.md's in-process YAML and its check command, read from the doc, pointed at
    a real store (and with a small CPU buffer: the doc's 5 GB would be allocated), pass
    LMCache's own check, and the 5 chunks are in the store."""
    if kind == "file":
        url = (tmp_path / "kv").as_uri()
        stored: Callable[[], int] = lambda: len(list((tmp_path / "kv").rglob("*.kv")))  # noqa: E731
    else:
        server: RedisServer = request.getfixturevalue("redis_server")
        with server.client() as client:
            client.flushall()
        url = server.url

        def stored() -> int:
            with server.client() as client:
                return int(client.dbsize())

    config = {**documented_config(url), "max_local_cpu_size": 0.1}
    passed_basic_check(run_basic_check(tmp_path, {}, config))
    assert stored() == 5


def test_lmcache_builds_one_connector_from_the_documented_config_and_refuses_a_second(
    tmp_path: Path,
) -> None:
    """The documented config gives LMCache one kvplug connector. The same config with
    remote_url added (which basic_check reads) makes LMCache build two to one store: the
    second refuses with kvplug's message, which stops LMCache's start."""
    values = {**documented_config((tmp_path / "kv").as_uri()), "max_local_cpu_size": 0.05}
    meta = metadata(f"twice-{uuid.uuid4().hex[:8]}")
    with loop_thread("test-lmcache-loop") as loop:
        backends = CreateStorageBackends(
            LMCacheEngineConfig.from_defaults(**values), meta, loop, dst_device="cpu"
        )
        try:
            remote = [b for name, b in backends.items() if name.startswith("RemoteBackend")]
            assert [type(connector_of(b)) for b in remote] == [KvplugConnector], list(backends)
        finally:
            for created in backends.values():
                created.close()

        twice = LMCacheEngineConfig.from_defaults(**values, remote_url="plugin://kvplug")
        with lmcache_logs() as logs, pytest.raises(KvplugConnectorError) as refused:
            CreateStorageBackends(twice, meta, loop, dst_device="cpu")
    assert "names this plugin twice" in str(refused.value), str(refused.value)
    assert "LMCACHE_REMOTE_URL=plugin://kvplug" in str(refused.value)
    assert "names this plugin twice" in logs.text(logging.ERROR)

    # When the first connector did not start, the second says why, not that it is a twin.
    extra = {**values["extra_config"], DOCUMENTED_URL: "nosuchscheme://host/kv"}
    broken = LMCacheEngineConfig.from_defaults(
        **{**values, "extra_config": extra}, remote_url="plugin://kvplug"
    )
    with loop_thread("test-lmcache-loop") as loop, pytest.raises(KvplugConnectorError) as failed:
        CreateStorageBackends(broken, meta, loop, dst_device="cpu")
    assert "nosuchscheme" in str(failed.value) and "twice" not in str(failed.value)


def test_basic_check_fails_loudly_on_unknown_scheme(tmp_path: Path) -> None:
    """With remote_url: plugin://kvplug, a bad kvplug URL stops LMCache with kvplug's
    message."""
    result = run_basic_check(tmp_path, {"url": "nosuchscheme://host/x"})
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "cannot be set up" in output and "nosuchscheme" in output, output
    assert "KvplugConnectorError" in output, output


# -- an in-process LMCacheEngine -------------------------------------------------------------------


def test_engine_store_clear_lookup_retrieve(
    backend: tuple[str, dict[str, Any], Callable[[], int]],
) -> None:
    """LMCacheEngine stores 200 tokens (3 chunks and a partial one), the CPU tier is cleared,
    lookup finds them all in kvplug, and retrieve brings them back bit-exact."""
    _, settings, stored = backend
    model = f"engine-{uuid.uuid4().hex[:8]}"
    instance = f"kvplug-test-{uuid.uuid4().hex[:8]}"
    config = engine_config(settings)
    builder = cache_engine.LMCacheEngineBuilder
    engine = builder.get_or_create(
        instance, config, metadata(model), CpuKVConnector(), lambda *a: None, lambda o, *a: o
    )
    try:
        engine.post_init()
        tokens = torch.arange(200) * 7 + 3
        source = torch.randn(2, LAYERS, 200, HIDDEN, dtype=torch.bfloat16)
        engine.store(tokens, kv=source)
        remote = engine.storage_manager.storage_backends["RemoteBackend-kvplug"]
        connector = connector_of(remote)
        wait_until(lambda: connector.stats()["writes"] == 4, "4 chunks written through kvplug")
        assert connector.stats()["bytes_written"] == source.numel() * 2
        if stored() != -1:
            wait_until(lambda: stored() == 4, "4 chunks in the store")  # tiers write behind
        # LMCache's own CPU tier also takes the chunks behind the store call: a clear that ran
        # before they were all in left some there (seen under a CPU hog).
        wait_until(
            lambda: engine.lookup(tokens, search_range=["LocalCPUBackend"]) == 200,
            "200 tokens in LMCache's CPU tier",
        )

        engine.clear(locations=["LocalCPUBackend"])
        assert engine.lookup(tokens, search_range=["LocalCPUBackend"]) == 0
        assert engine.lookup(tokens) == 200

        target = torch.zeros_like(source)
        mask = engine.retrieve(tokens, kv=target)
        assert bool(mask.all())
        assert same_bits(target, source)
        stats = connector.stats()
        assert (stats["reads"], stats["hits"], stats["bytes_read"]) == (4, 4, source.numel() * 2)
        # LMCache's health check pings meanwhile: only the reads and writes stay put.
        summary = summarize(connector._client.backend.operation_stats()).as_dict()
        quiet = ("writes", "bytes_written", "reads", "hits", "misses", "bytes_read")
        assert {name: stats[name] for name in quiet} == {name: summary[name] for name in quiet}
    finally:
        builder.destroy(instance)


def test_puts_copy_only_where_the_backend_keeps_objects(
    backend: tuple[str, dict[str, Any], Callable[[], int]],
) -> None:
    """cpu:// and a Store that writes behind keep what they store, and a backend that does not
    let go of a buffer at once when a put is cancelled may still read it, so their puts copy;
    the others (file://, redis://) write from LMCache's buffer. Either way, changing LMCache's
    buffer after the put does not change the stored chunk. Then LMCache's remove and the
    connector's list."""
    name, settings, _ = backend
    model = f"copy-{uuid.uuid4().hex[:8]}"
    with remote_backend(settings, model) as (remote, cpu, meta):
        connector = connector_of(remote)
        lets_go = connector_backend(connector).capabilities.releases_on_cancel
        assert connector.copies_puts == (name in ("cpu", "tiers") or not lets_go)
        obj = filled(cpu, meta, seed=1)
        original = obj.tensor.clone()
        key = engine_key(model, 11)
        remote.submit_put_task(key, obj).result(DEADLINE)
        obj.tensor.zero_()
        got = remote.get_blocking(key)
        assert got is not None
        assert same_bits(got.tensor, original)
        got.ref_count_down()
        obj.ref_count_down()

        listing = asyncio.run_coroutine_threadsafe(connector.list(), remote.loop).result(DEADLINE)
        can_list = connector_backend(connector).capabilities.list_keys
        assert listing == ([key.to_string()] if can_list else [])
        assert remote.remove(key) is True
        assert remote.contains(key) is False
        assert remote.remove(key) is False


# -- failures --------------------------------------------------------------------------------------


def test_down_redis_misses_fails_puts_and_recovers(tmp_path: Path) -> None:
    """With redis-server killed, LMCache's reads miss, its puts fail with kvplug's message and
    the connection is kept; when the server is back on the same port, the same connector
    stores and reads again."""
    model = f"down-{uuid.uuid4().hex[:8]}"
    with RedisServer() as server:
        settings = {"url": server.url, "timeout": 1}
        with remote_backend(settings, model, blocking_timeout_secs=2) as (remote, cpu, meta):
            connector = connector_of(remote)
            first, second, third = (engine_key(model, h) for h in (1, 2, 3))
            health = inprocess_module(
                "health_monitor.checks.remote_backend_check"
            ).RemoteBackendHealthCheck(remote)
            assert health.check() is True
            obj = filled(cpu, meta, seed=1)
            remote.submit_put_task(first, obj).result(DEADLINE)
            assert remote.contains(first)

            server.stop()
            assert health.check() is False  # LMCache's health check pings the connector
            with lmcache_logs() as logs:
                assert remote.get_blocking(first) is None
                assert remote.contains(first) is False
                assert remote.batched_get_blocking([first, second]) == [None, None]
                assert remote.connection is not None  # LMCache did not drop the connection
                assert remote.batched_contains([first, second]) == 0
                failed = remote.put_failed_count
                future = remote.submit_put_task(second, obj)
                with pytest.raises(Exception, match=str(server.port)):
                    future.result(DEADLINE)
                # LMCache counts, then logs, in the future's callback: maybe after result().
                wait_until(lambda: "Put task failed" in logs.text(), "LMCache's error line")
                assert remote.put_failed_count == failed + 1
            warnings = logs.text(logging.WARNING)
            failure = next(line for line in warnings.splitlines() if "Put task failed" in line)
            assert str(server.port) in failure and "unreachable" in failure, failure
            assert warnings.count("reporting misses until it answers") == 1, warnings

            server.start()
            with lmcache_logs() as logs:
                remote.submit_put_task(third, obj).result(DEADLINE)
                got = remote.get_blocking(third)
            assert got is not None and same_bits(got.tensor, obj.tensor)
            got.ref_count_down()
            assert connector_of(remote) is connector
            assert "answers again" in logs.text(), logs.text()
            assert health.check() is True
            obj.ref_count_down()


def test_chunks_of_several_layer_groups_are_refused(tmp_path: Path) -> None:
    """kvplug keeps one shape and dtype per chunk: a put of a two-group chunk fails with the
    reason and stores nothing."""
    model = f"groups-{uuid.uuid4().hex[:8]}"
    settings = {"url": (tmp_path / "kv").as_uri()}
    with remote_backend(settings, model) as (remote, cpu, _):
        shapes = [torch.Size([2, 2, CHUNK, 16]), torch.Size([1, 3, CHUNK, 8])]
        obj = cpu.allocate(shapes, [torch.bfloat16, torch.float32], MemoryFormat.KV_2LTD)
        key = engine_key(model, 9)
        with lmcache_logs() as logs:
            future = remote.submit_put_task(key, obj)
            with pytest.raises(Exception, match="2 layer groups"):
                future.result(DEADLINE)
            wait_until(lambda: "Put task failed" in logs.text(), "LMCache's error line")
        assert remote.put_failed_count == 1
        assert "2 layer groups" in logs.text(logging.ERROR), logs.text()
        assert remote.contains(key) is False
        obj.ref_count_down()


BAD_SETUPS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "unknown scheme": ({"url": "nosuchscheme://host/x"}, {}),
    "bad URL": ({"url": "redis://127.0.0.1:notaport"}, {}),
    "unknown option": ({"url": "redis://:s3cret-pw@127.0.0.1:1", "colour": "blue"}, {}),
    "url and config": ({"url": "cpu://", "config": "/nonexistent/kvplug.yaml"}, {}),
    "neither url nor config": ({}, {}),
    "missing tiers file": ({"config": "/nonexistent/kvplug.yaml"}, {}),
    "layerwise": ({"url": "cpu://"}, {"use_layerwise": True}),
    "remote_serde": ({"url": "cpu://"}, {"remote_serde": "cachegen"}),
}
FRAGMENTS = {"layerwise": "use_layerwise: false", "remote_serde": "remote_serde: naive"}


def kvplug_message(settings: dict[str, Any]) -> str:
    """What kvplug itself says about these settings."""
    options = {k: v for k, v in settings.items() if k not in ("url", "config")}
    with pytest.raises(KvplugError) as error:
        open_client(
            url=settings.get("url"),
            config=settings.get("config"),
            options=options,
            what=f"extra_config {PREFIX}*",
        ).close()
    return str(error.value)


@pytest.mark.parametrize("case", list(BAD_SETUPS))
def test_bad_setup_is_loud(case: str) -> None:
    """LMCache only logs a remote plugin that fails to build and runs on without it; the
    connector logs an ERROR with kvplug's message, LMCache names it too, no secret is shown,
    and where LMCache lets errors through (remote_url) the start fails."""
    settings, overrides = BAD_SETUPS[case]
    expected = FRAGMENTS.get(case) or kvplug_message(settings)
    model = f"bad-{uuid.uuid4().hex[:8]}"
    config = engine_config(settings, **overrides)
    meta = metadata(model)
    with loop_thread("test-lmcache-loop") as loop, lmcache_logs() as logs:
        backends = CreateStorageBackends(config, meta, loop, dst_device="cpu")
        try:
            assert "RemoteBackend-kvplug" not in backends
        finally:
            for created in backends.values():
                created.close()
        errors = logs.text(logging.ERROR)
        ours = [r.getMessage() for r in logs.records if r.name == "kvplug_lmcache.connector"]
        assert any("cannot be set up" in m and expected in m for m in ours), logs.text()
        assert "Failed to create remote backend for plugin kvplug" in errors, errors
        assert expected in errors.split("Failed to create remote backend")[-1], errors
        assert "s3cret-pw" not in logs.text()

        legacy = engine_config(settings, remote_url="plugin://kvplug", **overrides)
        cpu = LocalCPUBackend(config=legacy, metadata=meta, dst_device="cpu")
        with pytest.raises(KvplugConnectorError) as error:
            RemoteBackend(legacy, meta, loop, cpu, "cpu")
    assert isinstance(error.value, IrrecoverableException)
    assert expected in str(error.value)
    assert "s3cret-pw" not in str(error.value)


def test_one_kvplug_plugin_per_lmcache(tmp_path: Path) -> None:
    """Two plugins of this class cannot be told apart by the connector: refused, naming both."""
    extra = plugin_extra(url="cpu://")
    extra.update(
        {
            "remote_storage_plugin.other.module_path": "kvplug_lmcache.connector",
            "remote_storage_plugin.other.class_name": "KvplugConnector",
            "remote_storage_plugin.other.url": (tmp_path / "kv").as_uri(),
        }
    )
    config = engine_config({}, remote_storage_plugins=["kvplug", "other"], extra_config=extra)
    with pytest.raises(Exception, match="kvplug, other"):
        KvplugConnector.plugin_settings(config)
