"""What the tests of both LMCache modes share: LMCache's MP adapter built from its plugin JSON
and driven through its event fds as LMCache's controllers do (``make_adapter``, ``Driver``),
``lmcache server`` with the adapter (``LMCacheServer``), and the in-process connector inside
LMCache's own ``RemoteBackend`` (``remote_backend``)."""

from __future__ import annotations

import argparse
import contextlib
import json
import select
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("lmcache", reason="these tests need LMCache (run them in an LMCache venv)")

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.l2_adapters import create_l2_adapter
from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.platform import consume_fd
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.v1.storage_backend.remote_backend import RemoteBackend

from kvplug import BackendSpec, register_backend
from kvplug_disk import DiskBackend
from kvplug_lmcache.connector import KvplugConnector
from kvplug_testing import free_port
from kvplug_testing.threads import loop_thread

DEADLINE = 60.0
"""Seconds any one wait may take: generous, for a busy 2-core machine (a hang detector)."""

# -- the MP adapter ----------------------------------------------------------------------------

LAYOUT = MemoryLayoutDesc(shapes=[torch.Size([2, 4, 16, 64])], dtypes=[torch.float16])
CHUNK_BYTES = 2 * 4 * 16 * 64 * 2
RECHECK = 0.05


def plugin_spec(params: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "plugin",
        "module_path": "kvplug_lmcache.l2_adapter",
        "class_name": "KvplugL2Adapter",
        "adapter_params": params,
    }


def make_adapter(params: dict[str, Any]) -> Any:
    """Build the adapter exactly as ``lmcache server --l2-adapter JSON`` does."""
    namespace = argparse.Namespace(l2_adapter=[json.dumps(plugin_spec(params))])
    (config,) = parse_args_to_l2_adapters_config(namespace).adapters
    return create_l2_adapter(config)


def l1_object(data: torch.Tensor) -> TensorMemoryObj:
    """An LMCache memory object over ``data`` (as L1 hands them to adapters)."""
    meta = MemoryObjMetadata(
        shape=data.shape,
        dtype=data.dtype,
        address=data.data_ptr(),
        phy_size=data.numel() * data.element_size(),
        ref_count=1,
        fmt=MemoryFormat.KV_2LTD,
    )
    return TensorMemoryObj(data, meta, parent_allocator=None)


def chunk(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*LAYOUT.shapes[0], generator=generator).to(torch.float16)


def key(model: str, n: int, **fields: Any) -> ObjectKey:
    return ObjectKey(chunk_hash=n.to_bytes(8, "big"), model_name=model, kv_rank=0, **fields)


class Driver:
    """Submits tasks and waits on the adapter's event fds, as LMCache's controllers do.
    Threads may share one (one of them may consume a wake-up meant for another: each looks
    for its result again every :data:`RECHECK` seconds)."""

    def __init__(self, adapter: Any) -> None:
        self.adapter = adapter
        self._stores: dict[int, Any] = {}

    @staticmethod
    def _wait(fd: int, result: Callable[[], Any]) -> Any:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        deadline = time.monotonic() + DEADLINE
        while (found := result()) is None:
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"the adapter did not finish a task within {DEADLINE} s"
            if poller.poll(min(remaining, RECHECK) * 1000):
                with contextlib.suppress(BlockingIOError):
                    consume_fd(fd)
        return found

    def store(self, keys: list[ObjectKey], objects: list[Any]) -> bool:
        task = self.adapter.submit_store_task(keys, objects)

        def done() -> Any:
            self._stores.update(self.adapter.pop_completed_store_tasks())
            return self._stores.pop(task, None)

        return bool(self._wait(self.adapter.get_store_event_fd(), done).is_successful())

    def lookup(self, keys: list[ObjectKey]) -> list[bool]:
        task = self.adapter.submit_lookup_and_lock_task(keys, {})
        bitmap = self._wait(
            self.adapter.get_lookup_and_lock_event_fd(),
            lambda: self.adapter.query_lookup_and_lock_result(task),
        )
        return [bitmap.test(i) for i in range(len(keys))]

    def load(self, keys: list[ObjectKey], objects: list[Any]) -> list[bool]:
        task = self.adapter.submit_load_task(keys, objects)
        bitmap = self._wait(
            self.adapter.get_load_event_fd(), lambda: self.adapter.query_load_result(task)
        )
        return [bitmap.test(i) for i in range(len(keys))]

    def settle(self) -> None:
        """Wait until the fire-and-forget calls submitted so far (unlock, touch) ran."""
        self.lookup([])


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {DEADLINE} s"
        time.sleep(0.02)


# -- lmcache server -------------------------------------------------------------------------

LMCACHE_CLI = Path(sys.executable).with_name("lmcache")


def server_command(
    params: dict[str, Any], port: int, http_port: int, *more: str, l1_gb: float = 0.05
) -> list[str]:
    """``lmcache server`` on loopback with the kvplug adapter of ``params`` and ``more``
    arguments."""
    return [
        str(LMCACHE_CLI),
        "server",
        *("--host", "127.0.0.1", "--port", str(port)),
        *("--http-host", "127.0.0.1", "--http-port", str(http_port)),
        *("--l1-size-gb", str(l1_gb), "--eviction-policy", "LRU", "--disable-observability"),
        *("--l2-adapter", json.dumps(plugin_spec(params)), *more),
    ]


class LMCacheServer:
    """``lmcache server`` with the kvplug adapter of ``params`` on free loopback ports, as a
    context manager: entered once it says it runs and its HTTP API answers; left with SIGINT
    (killed if it does not stop in time). ``more`` and ``l1_gb`` as :func:`server_command`."""

    def __init__(self, params: dict[str, Any], *more: str, l1_gb: float = 0.05) -> None:
        self.port, self.http_port = free_port(), free_port()
        self.command = server_command(params, self.port, self.http_port, *more, l1_gb=l1_gb)
        self.lines: list[str] = []
        self.process: subprocess.Popen[str] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def __enter__(self) -> LMCacheServer:
        process = self.process = subprocess.Popen(
            self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self._reader = threading.Thread(
            target=lambda: self.lines.extend(process.stdout or []), daemon=True
        )
        self._reader.start()
        try:
            wait_until(lambda: self.running() or process.poll() is not None, "lmcache server start")
            assert process.poll() is None, "".join(self.lines)
            answered: list[dict[str, Any]] = []

            def answers() -> bool:
                with contextlib.suppress(OSError):
                    answered.append(self.status())
                return bool(answered)

            wait_until(answers, "the HTTP status endpoint")
        except BaseException:
            self.__exit__()
            raise
        return self

    def running(self) -> bool:
        return any("cache server is running" in line for line in self.lines)

    def status(self) -> dict[str, Any]:
        """The server's HTTP ``/status``."""
        with urllib.request.urlopen(f"{self.url}/status", timeout=10) as response:
            return dict(json.load(response))

    def adapter_status(self) -> dict[str, Any]:
        """The kvplug adapter's part of ``/status``."""
        (adapter,) = self.status()["storage_manager"]["l2_adapters"]
        return dict(adapter)

    def clear_l1(self) -> None:
        """Empty LMCache's L1 (its ``POST /cache/clear``): later hits come from L2."""
        request = urllib.request.Request(f"{self.url}/cache/clear", method="POST")
        with urllib.request.urlopen(request, timeout=30) as response:
            assert json.load(response)["status"] == "ok"

    def __exit__(self, *exc_info: object) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        process.send_signal(signal.SIGINT)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
        self._reader.join(10)


# -- the in-process connector --------------------------------------------------------------

DOCS = Path(__file__).resolve().parents[3] / "docs" / "lmcache.md"
DOCUMENTED_URL = "remote_storage_plugin.kvplug.url"


DOCUMENTED_CHECK = "basic_check --mode test_remote"


def _inprocess_section() -> str:
    return DOCS.read_text().split("## In-process mode", 1)[1].split("\n## ", 1)[0]


def documented_config(url: str) -> dict[str, Any]:
    """The in-process LMCache YAML of docs/lmcache.md (the first ``yaml`` block of its
    "In-process mode" section), read as LMCache reads it, with its kvplug URL replaced by
    ``url``: what an operator copies, pointed at a test's store."""
    block = _inprocess_section().split("```yaml\n", 1)[1].split("```", 1)[0]
    config = yaml.safe_load(block)
    assert DOCUMENTED_URL in config["extra_config"], block
    config["extra_config"][DOCUMENTED_URL] = url
    return dict(config)


def documented_check() -> tuple[dict[str, str], list[str]]:
    """The environment and the command of the ``basic_check`` line of docs/lmcache.md's
    "In-process mode" section (``NAME=value ... python -m MODULE --mode test_remote``)."""
    (line,) = [
        line
        for line in _inprocess_section().splitlines()
        if line.rstrip().endswith(DOCUMENTED_CHECK)
    ]
    words = shlex.split(line)
    env = dict(word.split("=", 1) for word in words if "=" in word)
    return env, [word for word in words if "=" not in word]


PREFIX = "remote_storage_plugin.kvplug."
LAYERS, HEADS, HEAD_SIZE, CHUNK = 4, 2, 8, 64
HIDDEN = HEADS * HEAD_SIZE


def plugin_extra(**settings: Any) -> dict[str, Any]:
    extra = {
        PREFIX + "module_path": "kvplug_lmcache.connector",
        PREFIX + "class_name": "KvplugConnector",
    }
    extra.update({PREFIX + name: value for name, value in settings.items()})
    return extra


def engine_config(settings: dict[str, Any], **overrides: Any) -> Any:
    values: dict[str, Any] = {
        "chunk_size": CHUNK,
        "local_cpu": True,
        "max_local_cpu_size": 0.05,
        "save_unfull_chunk": True,
        "remote_serde": "naive",
        "remote_storage_plugins": ["kvplug"],
        "extra_config": plugin_extra(**settings),
    }
    values.update(overrides)
    return LMCacheEngineConfig.from_defaults(**values)


def metadata(model: str) -> LMCacheMetadata:
    return LMCacheMetadata(
        model_name=model,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.bfloat16,
        kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD_SIZE),
        chunk_size=CHUNK,
    )


def engine_key(model: str, chunk_hash: int) -> CacheEngineKey:
    return CacheEngineKey(model, 1, 0, chunk_hash, torch.bfloat16)


def filled(cpu: LocalCPUBackend, meta: LMCacheMetadata, seed: int) -> Any:
    obj = cpu.allocate(meta.get_shapes(), meta.get_dtypes(), MemoryFormat.KV_2LTD)
    assert obj is not None
    generator = torch.Generator().manual_seed(seed)
    obj.tensor.copy_(torch.randn(obj.tensor.shape, generator=generator))
    return obj


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


@contextlib.contextmanager
def remote_backend(
    settings: dict[str, Any], model: str, **overrides: Any
) -> Iterator[tuple[RemoteBackend, LocalCPUBackend, LMCacheMetadata]]:
    """LMCache's RemoteBackend for the kvplug plugin, as its storage manager builds it."""
    config = engine_config(settings, **overrides)
    meta = metadata(model)
    with loop_thread("test-lmcache-loop") as loop:
        cpu = LocalCPUBackend(config=config, metadata=meta, dst_device="cpu")
        remote = RemoteBackend(config, meta, loop, cpu, "cpu", plugin_name="kvplug")
        try:
            yield remote, cpu, meta
        finally:
            if remote.connection is not None:
                remote.close()


def connector_of(remote: RemoteBackend) -> KvplugConnector:
    assert remote.connection is not None, "LMCache has no connection to the kvplug connector"
    inner = remote.connection.getWrappedConnector()
    assert isinstance(inner, KvplugConnector)
    return inner


# -- a backend that does not declare releases_on_cancel --------------------------------------


class DiskWithoutRelease(DiskBackend):
    """kvplug's ``file://`` backend, declaring no ``releases_on_cancel``: what the integrations
    see of a backend that does not (many third-party ones), so that LMCache's buffers are
    copied for stores and read into kvplug's own memory for loads. Served as
    :data:`UNDECLARED` by :func:`serve_undeclared`."""

    capabilities = replace(DiskBackend.capabilities, releases_on_cancel=False)


UNDECLARED = "nolend"
"""The URL scheme of :class:`DiskWithoutRelease` (``nolend:///dir``)."""


def serve_undeclared() -> None:
    """Serve :data:`UNDECLARED` from this process (idempotent)."""
    spec = BackendSpec(
        name="kvplug-lmcache-tests",
        schemes=(UNDECLARED,),
        factory=f"{__name__}:DiskWithoutRelease",
        description="file:// without releases_on_cancel (kvplug-lmcache's tests)",
    )
    register_backend(spec, replace=True)
