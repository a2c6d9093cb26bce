"""The harness in conftest.py, proven against SGLang's built-in ``file`` backend (HiCacheFile):
pages survive storage bit-exact in every host layout, and the controller's backup -> prefetch
round trip gives back exactly what was backed up."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheFile
from sglang.srt.mem_cache.pool_host import HostKVCache
from sglang.srt.mem_cache.storage import StorageBackendFactory

LAYOUTS = ("layer_first", "page_first", "page_first_direct")
PAGE = 16

PageBytes = Callable[[HostKVCache, int | torch.Tensor], torch.Tensor]


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_pages_survive_the_file_backend_bit_exact(
    layout: str,
    mla: bool,
    tmp_path: Path,
    make_host_pool: Callable[..., HostKVCache],
    storage_config: Callable[..., Any],
    page_bytes: PageBytes,
) -> None:
    source = make_host_pool(layout, mla=mla, page_size=PAGE)
    target = make_host_pool(layout, mla=mla, page_size=PAGE)
    backend = StorageBackendFactory.create_backend(
        "file", storage_config(source, extra_config={"file_storage_path": str(tmp_path)}), source
    )
    assert isinstance(backend, HiCacheFile)
    backend.register_mem_pool_host(source)
    keys = [f"selfcheck-{layout}-{i}" for i in range(3)]
    source_slots = [3 * PAGE, 7 * PAGE, 8 * PAGE]
    target_slots = [0, 5 * PAGE, 9 * PAGE]
    untouched = page_bytes(target, PAGE)
    sent = [page_bytes(source, slot) for slot in source_slots]
    assert not any(
        torch.equal(page, page_bytes(target, slot))
        for page, slot in zip(sent, target_slots, strict=True)
    )

    # HiCacheController._generic_page_set, then _generic_page_get into another pool.
    assert backend.batch_set(keys, [source.get_data_page(slot) for slot in source_slots])
    assert len(list(tmp_path.glob("*.bin"))) == len(keys)
    assert all(backend.exists(key) for key in keys)
    pages = backend.batch_get(keys, [target.get_dummy_flat_data_page() for _ in keys])
    assert all(page is not None for page in pages)
    for slot, page in zip(target_slots, pages, strict=True):
        target.set_from_flat_data_page(slot, page)

    for page, slot in zip(sent, target_slots, strict=True):
        assert torch.equal(page_bytes(target, slot), page)
    assert torch.equal(page_bytes(target, PAGE), untouched)
    assert backend.batch_get(["never-stored"], [target.get_dummy_flat_data_page()]) == [None]


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_controller_backup_then_prefetch_round_trip(
    layout: str,
    mla: bool,
    tmp_path: Path,
    hicache_controller: Callable[..., contextlib.AbstractContextManager[Any]],
    backup: Callable[..., int],
    prefetch: Callable[..., tuple[int, torch.Tensor]],
    page_bytes: PageBytes,
) -> None:
    extra = {"file_storage_path": str(tmp_path)}
    with hicache_controller(
        layout, storage_backend="file", extra_config=extra, mla=mla, page_size=PAGE
    ) as controller:
        assert isinstance(controller.storage_backend, HiCacheFile)
        assert controller.storage_config.is_mla_model is mla
        host = controller.mem_pool_host
        tokens = list(range(1000, 1000 + 4 * PAGE))
        source = host.alloc(len(tokens))
        sent = [page_bytes(host, slot) for slot in source[::PAGE]]

        assert backup(controller, source, tokens) == len(tokens)
        assert len(list(tmp_path.glob("*.bin"))) == 4

        free_before = host.available_size()
        fetched, slots = prefetch(controller, tokens)
        assert fetched == len(tokens)
        assert slots.numel() == len(tokens)
        assert set(slots.tolist()).isdisjoint(source.tolist())
        assert host.available_size() == free_before - len(tokens)
        for page, slot in zip(sent, slots[::PAGE], strict=True):
            assert torch.equal(page_bytes(host, slot), page)
        host.free(slots)

        # Only the stored prefix of a longer request comes back.
        longer = [*tokens, *range(7000, 7000 + 2 * PAGE)]
        fetched, slots = prefetch(controller, longer)
        assert fetched == len(tokens)
        assert host.available_size() == free_before - len(tokens)
        host.free(slots)

        fetched, slots = prefetch(controller, list(range(5000, 5000 + 2 * PAGE)))
        assert fetched == 0
        assert slots.numel() == 0
        assert host.available_size() == free_before


def test_dynamic_backend_loads_the_class_the_extra_config_names(
    tmp_path: Path,
    hicache_controller: Callable[..., contextlib.AbstractContextManager[Any]],
    backup: Callable[..., int],
    prefetch: Callable[..., tuple[int, torch.Tensor]],
) -> None:
    """SGLang will load kvplug's backend as "dynamic"; HiCacheFile stands in for it here."""
    extra = {
        "backend_name": "selfcheck",
        "module_path": "sglang.srt.mem_cache.hicache_storage",
        "class_name": "HiCacheFile",
        "file_storage_path": str(tmp_path),
    }
    with hicache_controller("page_first", extra_config=extra, page_size=PAGE) as controller:
        assert type(controller.storage_backend) is HiCacheFile
        assert controller.storage_config.extra_config == extra
        tokens = list(range(2 * PAGE))
        source = controller.mem_pool_host.alloc(len(tokens))
        assert backup(controller, source, tokens) == len(tokens)
        assert prefetch(controller, tokens)[0] == len(tokens)
    assert controller.storage_backend is None
    assert not controller.backup_thread.is_alive()
