"""Wire compatibility with LMCache 0.5.6, both ways, with LMCache's own code:

* LMCache's ``lm://`` client (``LMCServerConnector``, and ``RemoteBackend`` as LMCache's storage
  manager builds it from ``remote_url: lm://...``) stores into and reads from
  ``kvplug lm-server`` bit-exact;
* kvplug's ``lm://`` client works against LMCache's ``lmcache_server`` (plain mode);
* both clients share one server's objects, on either server (an LMCache deployment moves to
  kvplug's server, or adds kvplug clients, without losing its cache).

Needs lmcache 0.5.6: scripts/test.sh runs this module in ``.venv-lmcache-0.5.6``; elsewhere it
is skipped with that reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import pytest

os.environ.update({"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"})

pytestmark = pytest.mark.lmcache
pytest.importorskip(
    "lmcache.v1.storage_backend.connector.lm_connector",
    reason="needs lmcache 0.5.6 (LMCache removed lm:// in 0.5.7rc2): scripts/test.sh runs "
    "this module in .venv-lmcache-0.5.6",
)

import torch  # noqa: E402
from lmcache.utils import CacheEngineKey  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat as LMFormat  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402
from lmcache.v1.storage_backend.connector.lm_connector import LMCServerConnector  # noqa: E402
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend  # noqa: E402
from lmcache.v1.storage_backend.remote_backend import RemoteBackend  # noqa: E402

import kvplug  # noqa: E402
from kvplug import CacheKey, MemoryFormat, MemoryObj  # noqa: E402
from kvplug.memory import nbytes_of  # noqa: E402
from kvplug_testing.lm import LMServerProcess  # noqa: E402
from kvplug_testing.threads import loop_thread  # noqa: E402

T = TypeVar("T")
LAYERS, HEADS, HEAD_SIZE, CHUNK = 4, 2, 64, 256
HIDDEN = HEADS * HEAD_SIZE
WAIT = 60.0
KV_DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.uint8,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


@pytest.fixture(scope="module")
def kvplug_server() -> Iterator[LMServerProcess]:
    with LMServerProcess(["--max-memory", "512MiB"], python=sys.executable) as server:
        yield server


@pytest.fixture(scope="module")
def lmcache_server() -> Iterator[LMServerProcess]:
    with LMServerProcess.lmcache(sys.executable) as server:
        yield server


@pytest.fixture(params=["kvplug lm-server", "lmcache_server"])
def any_server(request: pytest.FixtureRequest) -> LMServerProcess:
    name = "kvplug_server" if request.param == "kvplug lm-server" else "lmcache_server"
    server: LMServerProcess = request.getfixturevalue(name)
    return server


# -- LMCache's side --------------------------------------------------------------------------


def lmcache_config(remote_url: str | None) -> Any:
    return LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK,
        local_cpu=True,
        max_local_cpu_size=0.25,
        remote_url=remote_url,
        remote_serde="naive",
    )


def lmcache_metadata(model: str, dtype: torch.dtype) -> Any:
    return LMCacheMetadata(
        model_name=model,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=dtype,
        kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD_SIZE),
        chunk_size=CHUNK,
    )


class LMCacheClient:
    """LMCache's own ``LMCServerConnector`` on a loop thread, with a ``LocalCPUBackend`` that
    allocates what it reads (as LMCache's RemoteBackend sets it up)."""

    def __init__(self, port: int, loop: asyncio.AbstractEventLoop, dtype: torch.dtype) -> None:
        self.loop = loop
        self.config = lmcache_config(None)
        self.meta = lmcache_metadata("lm-compat", dtype)
        self.cpu = LocalCPUBackend(config=self.config, metadata=self.meta, dst_device="cpu")
        self.connector = LMCServerConnector("127.0.0.1", port, loop, self.cpu)
        self.held: list[Any] = []

    def run(self, work: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(work, self.loop).result(WAIT)

    def new_object(self, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> Any:
        obj = self.cpu.allocate(torch.Size(shape), dtype, LMFormat.KV_2LTD)
        assert obj is not None, "LMCache's CPU backend is out of memory"
        obj.tensor.view(torch.uint8).copy_(random_bytes(obj.tensor.view(torch.uint8).shape, seed))
        self.held.append(obj)
        return obj

    def get(self, key: Any) -> Any:
        """LMCache's get; the object is released with the client."""
        got = self.run(self.connector.get(key))
        if got is not None:
            self.held.append(got)
        return got

    def close(self) -> None:
        self.run(self.connector.close())
        for obj in self.held:
            obj.ref_count_down()  # as LMCache's storage manager does when it is done


@contextlib.contextmanager
def lmcache_client(port: int, dtype: torch.dtype = torch.bfloat16) -> Iterator[LMCacheClient]:
    with loop_thread("lmcache-loop") as loop:
        client = LMCacheClient(port, loop, dtype)
        try:
            yield client
        finally:
            client.close()


def random_bytes(shape: torch.Size | tuple[int, ...], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, tuple(shape), dtype=torch.uint8, generator=generator)


def lmcache_key(chunk_hash: int, dtype: torch.dtype, tags: dict[str, str] | None = None) -> Any:
    configs = {f"lmcache.tag.{k}": v for k, v in (tags or {}).items()} or None
    return CacheEngineKey("lm-compat/model", 1, 0, chunk_hash, dtype, request_configs=configs)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


# -- kvplug's side ---------------------------------------------------------------------------


def kvplug_run(url: str, work: Callable[[kvplug.Backend], Coroutine[Any, Any, T]]) -> T:
    async def main() -> T:
        backend = await kvplug.open_backend(url)
        try:
            return await work(backend)
        finally:
            await backend.close()

    return asyncio.run(main())


def kvplug_object(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> MemoryObj:
    raw = random_bytes((nbytes_of(shape, dtype),), seed)
    return MemoryObj(raw, shape, dtype, MemoryFormat.KV_2LTD)


SHAPE = (2, LAYERS, CHUNK, HIDDEN)


# -- LMCache's client against kvplug's server -------------------------------------------------


@pytest.mark.parametrize("dtype", KV_DTYPES, ids=str)
def test_lmcache_client_round_trips_every_kv_dtype_through_kvplug_server(
    kvplug_server: LMServerProcess, dtype: torch.dtype
) -> None:
    with lmcache_client(kvplug_server.port, dtype) as client:
        key = lmcache_key(0x1000 + KV_DTYPES.index(dtype), dtype)
        obj = client.new_object(SHAPE, dtype, seed=1)
        assert not client.run(client.connector.exists(key))
        client.run(client.connector.put(key, obj))
        assert client.run(client.connector.exists(key))
        got = client.get(key)
        assert got is not None, "LMCache's client missed what it had just put"
        assert tuple(got.get_shape()) == SHAPE
        assert got.get_dtype() == dtype
        assert got.get_memory_format() == LMFormat.KV_2LTD
        assert same_bytes(got.tensor, obj.tensor)


def test_lmcache_client_misses_and_overwrites_on_kvplug_server(
    kvplug_server: LMServerProcess,
) -> None:
    with lmcache_client(kvplug_server.port) as client:
        key = lmcache_key(0x2000, torch.bfloat16, tags={"user": "alice"})
        assert client.get(key) is None
        first = client.new_object(SHAPE, torch.bfloat16, seed=2)
        second = client.new_object(SHAPE, torch.bfloat16, seed=3)
        client.run(client.connector.put(key, first))
        client.run(client.connector.put(key, second))
        got = client.get(key)
        assert got is not None and same_bytes(got.tensor, second.tensor)


def test_lmcache_client_keeps_one_token_and_partial_chunks(kvplug_server: LMServerProcess) -> None:
    with lmcache_client(kvplug_server.port) as client:
        for n, tokens in enumerate((1, 17, CHUNK)):
            shape = (2, LAYERS, tokens, HIDDEN)
            key = lmcache_key(0x3000 + n, torch.bfloat16)
            obj = client.new_object(shape, torch.bfloat16, seed=10 + n)
            client.run(client.connector.put(key, obj))
            got = client.get(key)
            assert got is not None and tuple(got.get_shape()) == shape
            assert same_bytes(got.tensor, obj.tensor)


def test_lmcache_remote_backend_stores_and_retrieves_through_kvplug_server(
    kvplug_server: LMServerProcess,
) -> None:
    """LMCache's RemoteBackend, built from ``remote_url: lm://...`` as its storage manager
    builds it, against kvplug's server."""
    config = lmcache_config(kvplug_server.url)
    meta = lmcache_metadata("lm-compat-remote", torch.bfloat16)
    with loop_thread("lmcache-loop") as loop:
        cpu = LocalCPUBackend(config=config, metadata=meta, dst_device="cpu")
        remote = RemoteBackend(config, meta, loop, cpu, "cpu")
        objs: list[Any] = []
        try:
            assert remote.connection is not None, "LMCache did not connect to kvplug's server"
            keys = [CacheEngineKey("lm-compat-remote", 1, 0, h, torch.bfloat16) for h in (1, 2)]
            for n, key in enumerate(keys):
                obj = cpu.allocate(torch.Size(SHAPE), torch.bfloat16, LMFormat.KV_2LTD)
                obj.tensor.view(torch.uint8).copy_(
                    random_bytes(obj.tensor.view(torch.uint8).shape, n)
                )
                objs.append(obj)
                future = remote.submit_put_task(key, obj)
                assert future is not None
                future.result(WAIT)
            for key, obj in zip(keys, objs, strict=True):
                assert remote.contains(key)
                got = remote.get_blocking(key)
                assert got is not None and same_bytes(got.tensor, obj.tensor)
                got.ref_count_down()
            missing = CacheEngineKey("lm-compat-remote", 1, 0, 99, torch.bfloat16)
            assert not remote.contains(missing)
            assert remote.get_blocking(missing) is None
        finally:
            remote.close()
            for obj in objs:
                obj.ref_count_down()


# -- one server, both clients -------------------------------------------------------------------


def test_kvplug_client_reads_what_lmcache_client_stored(any_server: LMServerProcess) -> None:
    lm_key = lmcache_key(0x4000 + any_server.port % 1000, torch.bfloat16, tags={"tenant": "t1"})
    with lmcache_client(any_server.port) as client:
        obj = client.new_object(SHAPE, torch.bfloat16, seed=40)
        client.run(client.connector.put(lm_key, obj))
        # LMCache's PUT has no reply: its put returns once the bytes are sent. An EXIST on the
        # same connection returns once the server (which takes a connection's requests in
        # order) stored them; another connection could look earlier and miss.
        assert client.run(client.connector.exists(lm_key))
        expected = obj.tensor.clone()
    key = CacheKey.parse(lm_key.to_string())
    assert key.to_string() == lm_key.to_string()

    async def read(backend: kvplug.Backend) -> tuple[bool, MemoryObj | None]:
        return await backend.contains(key), await backend.get(key)

    found, got = kvplug_run(any_server.url, read)
    assert found and got is not None
    try:
        assert got.shape == SHAPE and got.dtype == torch.bfloat16
        assert got.fmt == MemoryFormat.KV_2LTD
        assert same_bytes(got.tensor, expected)
    finally:
        got.release()


def test_lmcache_client_reads_what_kvplug_client_stored(any_server: LMServerProcess) -> None:
    key = CacheKey("lm-compat/model", 1, 0, 0x5000 + any_server.port % 1000, dtype="bfloat16")
    obj = kvplug_object(SHAPE, torch.bfloat16, seed=50)

    async def write(backend: kvplug.Backend) -> None:
        await backend.put(key, obj)

    kvplug_run(any_server.url, write)
    with lmcache_client(any_server.port) as client:
        lm_key = lmcache_key(key.chunk_hash, torch.bfloat16)  # type: ignore[arg-type]
        assert lm_key.to_string() == key.to_string()
        assert client.run(client.connector.exists(lm_key))
        got = client.get(lm_key)
        assert got is not None
        assert tuple(got.get_shape()) == SHAPE and got.get_dtype() == torch.bfloat16
        assert same_bytes(got.tensor, obj.tensor)


def test_kvplug_client_speaks_plain_to_lmcache_server(lmcache_server: LMServerProcess) -> None:
    async def check(backend: kvplug.Backend) -> dict[str, str]:
        return backend.describe()

    assert kvplug_run(lmcache_server.url, check).get("mode") == "plain"


def test_kvplug_client_speaks_extended_to_kvplug_server(kvplug_server: LMServerProcess) -> None:
    async def check(backend: kvplug.Backend) -> dict[str, str]:
        return backend.describe()

    assert kvplug_run(kvplug_server.url, check).get("mode") == "extended"
