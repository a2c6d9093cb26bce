"""A harness that drives SGLang's own HiCache objects on a CPU-only machine: real host pools over
real device pools, real ``HiCacheStorageConfig``s, and a single-process ``HiCacheController``
whose storage threads are driven the way SGLang's scheduler drives them.

Everything is offered as fixtures (``make_host_pool``, ``storage_config``, ``open_storage``,
``redis_server``, ``own_redis``, ``hicache_controller``, ``backup``, ``prefetch``,
``page_bytes``, ``page_hashes``): test modules here cannot import this file by name.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import shutil
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, TypeVar

import pytest
import torch
import torch.distributed as dist

from kvplug_testing import RedisServer

if TYPE_CHECKING:
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host import HostKVCache

# SGLang itself reports nothing anywhere; what it imports from Hugging Face could, so keep it
# offline and quiet. Set before anything imports huggingface_hub, which reads these once.
for _name, _value in {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "DO_NOT_TRACK": "1",
}.items():
    os.environ[_name] = _value


def _serve_torchvision_placeholders() -> None:
    # PyPI's torchvision does not load beside the CPU build of torch; SGLang's host pools and
    # controller import it at module level. Imported here: kvplug_sglang imports SGLang, which
    # imports huggingface_hub, after the environment above is set.
    from kvplug_sglang.testing_engine import serve_torchvision_placeholders_if_needed

    serve_torchvision_placeholders_if_needed()


_serve_torchvision_placeholders()


Layout = Literal["layer_first", "page_first", "page_first_direct"]
LAYOUTS: tuple[Layout, ...] = ("layer_first", "page_first", "page_first_direct")

_seeds = itertools.count(1)


class KVPools(NamedTuple):
    device: MHATokenToKVPool | MLATokenToKVPool
    host: HostKVCache


def build_kv_pools(
    layout: Layout,
    *,
    mla: bool = False,
    page_size: int = 16,
    layers: int = 4,
    heads: int = 2,
    head_dim: int = 32,
    dtype: torch.dtype = torch.bfloat16,
    pages: int = 32,
    seed: int | None = None,
) -> KVPools:
    """A real CPU device KV pool and the real HiCache host pool over it, built with the
    arguments SGLang's ``build_kv_host_pool`` passes, the host buffer filled with random data.

    The host pool holds ``pages`` pages; the device pool half as many (SGLang warns when the
    host pool is not the larger). For MLA a token row is ``kv_lora_rank = heads * head_dim``
    plus ``qk_rope_head_dim = head_dim``.
    """
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    host_tokens = pages * page_size
    device_tokens = max(page_size, host_tokens // 2)
    common: dict[str, Any] = {
        "size": device_tokens,
        "page_size": page_size,
        "dtype": dtype,
        "layer_num": layers,
        "device": "cpu",
        "enable_memory_saver": False,
    }
    host_common: dict[str, Any] = {
        "host_to_device_ratio": host_tokens / device_tokens,
        "host_size": 0,
        "page_size": page_size,
        "layout": layout,
        "pin_memory": False,
        "device": "cpu",
        "host_token_capacity": host_tokens,
    }
    device: MHATokenToKVPool | MLATokenToKVPool
    host: HostKVCache
    if mla:
        device = MLATokenToKVPool(
            kv_lora_rank=heads * head_dim, qk_rope_head_dim=head_dim, **common
        )
        host = MLATokenToKVPoolHost(
            device.get_device_pool_infos()[0].buffer_info,
            override_kv_cache_dim=device.kv_cache_dim,
            device_capacity_tokens=device.size,
            start_layer=device.start_layer,
            end_layer=device.end_layer,
            target_layer_num=device.layer_num,
            **host_common,
        )
    else:
        device = MHATokenToKVPool(head_num=heads, head_dim=head_dim, **common)
        host = MHATokenToKVPoolHost(
            device.get_device_pool_infos()[0].buffer_info,
            device_capacity_tokens=device.size,
            start_layer=device.start_layer,
            end_layer=device.end_layer,
            **host_common,
        )
    _fill_random(host.kv_buffer, next(_seeds) if seed is None else seed)
    return KVPools(device, host)


def _fill_random(buffer: torch.Tensor, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    if buffer.dtype.is_floating_point and buffer.dtype.itemsize >= 2:
        buffer.copy_(torch.randn(buffer.shape, generator=generator))
    else:
        # fp8 pools store raw bytes; any byte pattern is a valid page.
        raw = buffer.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=generator, dtype=torch.uint8))


def page_bytes(host_pool: HostKVCache, index: int | torch.Tensor) -> torch.Tensor:
    """A copy of the raw bytes of the page that starts at token slot ``index``, as SGLang's
    generic storage path reads it (``get_data_page``); compare with ``torch.equal``."""
    page: torch.Tensor = host_pool.get_data_page(int(index), flat=True)
    return page.contiguous().view(torch.uint8).clone()


def storage_config(pool: HostKVCache | None = None, **overrides: Any) -> HiCacheStorageConfig:
    """A ``HiCacheStorageConfig`` for a single rank (tp, pp and attention-cp 0 of 1) of
    "test-model", with an empty extra config. Given a host pool, MLA-ness, page-first-ness and
    the model name follow it as ``HiCacheController._generate_storage_config`` derives them.
    """
    from sglang.srt.managers.cache_controller import storage_model_name
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    fields: dict[str, Any] = {
        "tp_rank": 0,
        "tp_size": 1,
        "pp_rank": 0,
        "pp_size": 1,
        "attn_cp_rank": 0,
        "attn_cp_size": 1,
        "is_mla_model": False,
        "enable_storage_metrics": False,
        "is_page_first_layout": False,
        "model_name": "test-model",
        "extra_config": {},
    }
    if pool is not None:
        fields["is_mla_model"] = isinstance(pool, MLATokenToKVPoolHost)
        fields["is_page_first_layout"] = pool.layout == "page_first"
        fields["model_name"] = storage_model_name("test-model", pool)
    fields.update(overrides)
    return HiCacheStorageConfig(**fields)


# What get_parallel() must answer for one process that is every rank of every group.
_SINGLE_RANK_TOPOLOGY: dict[str, Any] = {
    "tp_rank": 0,
    "tp_size": 1,
    "pp_rank": 0,
    "pp_size": 1,
    "attn_tp_rank": 0,
    "attn_tp_size": 1,
    "attn_dp_rank": 0,
    "attn_dp_size": 1,
    "attn_cp_rank": 0,
    "attn_cp_size": 1,
    "attn_dcp_rank": 0,
    "attn_dcp_size": 1,
    "dcp_enabled": False,
    "launch_world_size": 1,
    "nnodes": 1,
}


@contextlib.contextmanager
def single_rank_world() -> Iterator[dist.ProcessGroup]:
    """A gloo default process group of one rank, and SGLang's parallel context saying
    "rank 0 of 1" everywhere; both undone on exit.

    The rendezvous store is an in-process ``HashStore``, not a TCPStore on 127.0.0.1: a
    TCPStore server listens on every interface and resolves its peers' names through DNS
    (reverse lookups of 127.0.0.1 leave the machine), and one rank has nobody to meet.
    """
    from sglang.srt.runtime_context import get_parallel

    if dist.is_initialized():
        raise RuntimeError("a default process group already exists; controllers cannot nest")
    saved_ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's own sockets stay on loopback too
    try:
        store = dist.HashStore()  # type: ignore[attr-defined]  # an implicit re-export
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            with get_parallel().override(**_SINGLE_RANK_TOPOLOGY):
                group = dist.group.WORLD
                assert group is not None
                yield group
        finally:
            dist.destroy_process_group()
    finally:
        if saved_ifname is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = saved_ifname


@contextlib.contextmanager
def hicache_controller(
    layout: Layout = "page_first",
    *,
    storage_backend: str = "dynamic",
    extra_config: dict[str, Any] | None = None,
    mla: bool = False,
    page_size: int = 16,
    prefetch_threshold: int | None = None,
    model_name: str = "test-model",
    **pool_options: Any,
) -> Iterator[HiCacheController]:
    """A ``HiCacheController`` with storage attached, over a real paged device allocator and a
    host pool from ``build_kv_pools`` (reach them as ``controller.mem_pool_device`` and
    ``controller.mem_pool_host``), in a single-rank world.

    ``storage_backend`` and ``extra_config`` are what ``--hicache-storage-backend`` and
    ``--hicache-storage-backend-extra-config`` give SGLang ("dynamic" loads the class that
    ``extra_config`` names). ``prefetch_threshold`` defaults to one page (SGLang's default is
    256 tokens) so small tests prefetch. On exit the storage backend is detached, which stops
    the controller's storage threads and closes the backend.
    """
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator

    with single_rank_world() as group:
        pools = build_kv_pools(layout, mla=mla, page_size=page_size, **pool_options)
        allocator = PagedTokenToKVPoolAllocator(
            pools.device.size,
            page_size,
            pools.device.dtype,
            "cpu",
            pools.device,
            need_sort=False,
        )
        controller = HiCacheController(
            token_to_kv_pool_allocator=allocator,
            mem_pool_host=pools.host,
            page_size=page_size,
            tp_group=group,
            load_cache_event=threading.Event(),
            io_backend="direct",
            storage_backend=storage_backend,
            prefetch_threshold=page_size if prefetch_threshold is None else prefetch_threshold,
            model_name=model_name,
            # SGLang pops keys from it (tp_lcm_size); keep the caller's dict intact.
            storage_backend_extra_config=dict(extra_config or {}),
        )
        try:
            yield controller
        finally:
            controller.detach_storage_backend()


_T = TypeVar("_T")


def _next(source: queue.Queue[_T], timeout: float, what: str) -> _T:
    try:
        return source.get(timeout=timeout)
    except queue.Empty:
        raise TimeoutError(f"no {what} from the HiCache controller in {timeout} s") from None


def page_hashes(
    controller: HiCacheController, token_ids: Sequence[int], last_hash: str | None = None
) -> list[str]:
    """The storage keys SGLang gives these tokens' pages: the chained page hashes its radix
    tree stores per node and its prefetch hit query recomputes (``get_storage_hash_str``)."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    if len(token_ids) % controller.page_size:
        raise ValueError(f"{len(token_ids)} tokens are not whole pages of {controller.page_size}")
    hashes = get_storage_hash_str(list(token_ids), last_hash, page_size=controller.page_size)
    assert isinstance(hashes, list)
    return hashes


def backup(
    controller: HiCacheController,
    host_indices: torch.Tensor,
    token_ids: Sequence[int],
    *,
    last_hash: str | None = None,
    prefix_keys: list[str] | None = None,
    timeout: float = 10.0,
) -> int:
    """Write host pages to storage and return how many tokens the controller stored.

    Mirrors the scheduler side of a backup (``UnifiedRadixCache.write_backup_storage`` and
    ``DecodeKVCacheOffloadManager._trigger_backup``): hash the pages, ``write_storage`` them
    for the controller's backup thread, then take the operation back from ``ack_backup_queue``
    as the scheduler's queue drain does. The host pages stay allocated to the caller.
    """
    if host_indices.numel() != len(token_ids):
        raise ValueError(f"{host_indices.numel()} host slots for {len(token_ids)} tokens")
    operation_id = controller.write_storage(
        host_indices,
        list(token_ids),
        hash_value=page_hashes(controller, token_ids, last_hash),
        prefix_keys=prefix_keys,
    )
    operation = _next(controller.ack_backup_queue, timeout, "backup ack")
    assert operation.id == operation_id, "an ack for another backup: one at a time here"
    return int(operation.completed_tokens)


def prefetch(
    controller: HiCacheController,
    token_ids: Sequence[int],
    *,
    last_hash: str | None = None,
    prefix_keys: list[str] | None = None,
    timeout: float = 10.0,
) -> tuple[int, torch.Tensor]:
    """Fetch these tokens' pages from storage into host memory; return the number of tokens
    fetched and the host slots now holding them (owned by the caller, free them with
    ``controller.mem_pool_host.free``).

    Mirrors the scheduler side of a prefetch in cache mode (``UnifiedRadixCache``'s
    ``prefetch_from_storage`` and ``_drain_storage_control_queues_impl``): ``prefetch`` queues
    the request; the controller's hit query answers on ``prefetch_hit_queue``; a hit below the
    prefetch threshold (a miss included) is revoked, anything else gets hit-sized host buffers
    (``alloc_prefetch_host_buffers``) and is handed to ``prefetch_buffer`` for the IO thread;
    ``ack_prefetch_queue`` then reports completed tokens until ``completed_req``. The slots
    past the completed prefix are freed, as the host-release drain does.
    """
    operation = controller.prefetch(
        f"harness-{uuid.uuid4().hex}", list(token_ids), last_hash, prefix_keys
    )
    queried = _next(controller.prefetch_hit_queue, timeout, "storage hit query")
    assert queried is operation, "a hit query for another prefetch: one at a time here"
    hit_tokens = operation.storage_hit_count
    if hit_tokens < controller.prefetch_threshold:
        return 0, torch.empty(0, dtype=torch.int64)
    host_indices = controller.alloc_prefetch_host_buffers(operation, hit_tokens)
    if host_indices is None:
        raise RuntimeError(f"the host pool has no room for a {hit_tokens}-token prefetch")
    operation.host_indices = host_indices
    controller.prefetch_buffer.put(operation)
    completed = 0
    while True:
        ack = _next(controller.ack_prefetch_queue, timeout, "prefetch ack")
        assert ack.operation is operation, "an ack for another prefetch: one at a time here"
        if ack.completed_tokens is not None:
            completed = ack.completed_tokens
        if ack.completed_req:
            break
    if completed < host_indices.numel():
        controller.mem_pool_host.free(host_indices[completed:])
    return completed, host_indices[:completed]


def pytest_configure(config: pytest.Config) -> None:
    # Import-time notices of SGLang and its dependencies on a CPU-only machine, not findings.
    for ignored in (
        "ignore:Only CUDA:UserWarning",
        "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning",
        "ignore:builtin type Swig:DeprecationWarning",
    ):
        config.addinivalue_line("filterwarnings", ignored)


@pytest.fixture(autouse=True)
def _no_ambient_hicache_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang reads these at use: a storage directory that beats the extra config's, random
    failures and delays injected into every backend, eviction limits. Tests set their own."""
    for name in list(os.environ):
        if name.startswith(("SGLANG_HICACHE_", "SGLANG_TEST_HICACHE_")):
            monkeypatch.delenv(name)


@pytest.fixture
def make_host_pool() -> Callable[..., HostKVCache]:
    """``make_host_pool(layout, *, mla=False, page_size=16, layers=4, heads=2, head_dim=32,
    dtype=torch.bfloat16, pages=32)``: see ``build_kv_pools``; each pool gets other data."""

    def make(layout: Layout, **options: Any) -> HostKVCache:
        return build_kv_pools(layout, **options).host

    return make


@pytest.fixture(name="storage_config")
def storage_config_fixture() -> Callable[..., HiCacheStorageConfig]:
    return storage_config


@pytest.fixture
def open_storage() -> Iterator[Callable[..., Any]]:
    """``open_storage(pool, extra_config, **config)``: a ``KvplugHiCacheStorage`` built as
    SGLang builds it (``StorageBackendFactory`` from the ``dynamic`` extra config, then
    ``register_mem_pool_host``); ``config`` overrides ``storage_config``'s fields. Closed after
    the test."""
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    from kvplug_sglang import KvplugHiCacheStorage

    opened: list[KvplugHiCacheStorage] = []

    def open_(pool: HostKVCache, extra_config: dict[str, Any], **config: Any) -> Any:
        storage = StorageBackendFactory.create_backend(
            "dynamic", storage_config(pool, extra_config=extra_config, **config), pool
        )
        assert isinstance(storage, KvplugHiCacheStorage)
        opened.append(storage)
        storage.register_mem_pool_host(pool)
        return storage

    yield open_
    for storage in opened:
        storage.close()


def _redis() -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (bash scripts/setup.sh installs it)")
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    """A redis-server on 127.0.0.1 shared by a module's tests."""
    yield from _redis()


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A redis-server of the test's own, which it may stop, restart or pause."""
    yield from _redis()


@pytest.fixture(name="hicache_controller")
def hicache_controller_fixture() -> Callable[
    ..., contextlib.AbstractContextManager[HiCacheController]
]:
    return hicache_controller


@pytest.fixture(name="backup")
def backup_fixture() -> Callable[..., int]:
    return backup


@pytest.fixture(name="prefetch")
def prefetch_fixture() -> Callable[..., tuple[int, torch.Tensor]]:
    return prefetch


@pytest.fixture(name="page_bytes")
def page_bytes_fixture() -> Callable[[HostKVCache, int | torch.Tensor], torch.Tensor]:
    return page_bytes


@pytest.fixture(name="page_hashes")
def page_hashes_fixture() -> Callable[..., list[str]]:
    return page_hashes
