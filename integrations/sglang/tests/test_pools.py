"""What KvplugHiCacheStorage needs from SGLang, and its fallbacks where SGLang gives less: no
model name (as SGLang's own backends allow), a model name with key separators, a host pool with
pinned memory on a machine without an accelerator (SGLang's CPU engine), a pool without
``dtype`` or ``get_dummy_flat_data_page`` (as in SGLang's own storage tests), and pools kvplug
cannot serve, refused with what they lack."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.pool_host import HostKVCache
from sglang.srt.mem_cache.storage import StorageBackendFactory

from kvplug.errors import ConfigError
from kvplug_sglang import KvplugHiCacheStorage
from kvplug_sglang.keys import UNNAMED_MODEL

PAGE = 16
DYNAMIC = {
    "backend_name": "kvplug",
    "module_path": "kvplug_sglang",
    "class_name": "KvplugHiCacheStorage",
    "interface_v1": 1,
}
PageBytes = Callable[[HostKVCache, int | torch.Tensor], torch.Tensor]
OpenStorage = Callable[..., KvplugHiCacheStorage]


def slots(*pages: int) -> torch.Tensor:
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


def stored_model_fields(storage: KvplugHiCacheStorage) -> set[str]:
    backend = storage._client.backend

    async def fields() -> set[str]:
        return {key.model_name async for key in backend.list_keys()}

    return storage._client.run(fields()).result()


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_without_a_model_name_pages_are_keyed_as_sglangs_own_backends_key_them(
    layout: str,
    tmp_path: Path,
    make_host_pool: Callable[..., HostKVCache],
    open_storage: OpenStorage,
    page_bytes: PageBytes,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """SGLang passes model_name=None where its caller gave none (its own Mooncake and SiMM
    tests do); its backends then key pages by rank alone. kvplug does the same under a field
    no model name maps to, and says how to keep models apart."""
    url = {**DYNAMIC, "url": f"file://{tmp_path}/store"}
    pool = make_host_pool(layout, page_size=PAGE)
    with caplog.at_level(logging.WARNING, logger="kvplug.sglang"):
        nameless = open_storage(pool, url, model_name=None)
    assert "SGLang passed no model name" in caplog.text
    assert "--served-model-name" in caplog.text
    keys = [f"{i:02x}" * 32 for i in range(1, 3)]
    assert nameless.batch_set_v1(keys, slots(2, 5)) == [True, True]
    assert stored_model_fields(nameless) == {UNNAMED_MODEL}

    dest = make_host_pool(layout, page_size=PAGE)
    reader = open_storage(dest, url, model_name=None)
    assert reader.batch_get_v1(keys, slots(0, 1)) == [True, True]
    for sent, got in ((2, 0), (5, 1)):
        assert torch.equal(page_bytes(dest, got * PAGE), page_bytes(pool, sent * PAGE))
    named = open_storage(make_host_pool(layout, page_size=PAGE), url, model_name="test-model")
    assert named.batch_exists(keys) == 0  # a named model never reads the unnamed pages


def test_a_model_name_with_key_separators_is_escaped_and_kept_apart(
    tmp_path: Path, make_host_pool: Callable[..., HostKVCache], open_storage: OpenStorage
) -> None:
    """'@' separates a key's fields; SGLang allows it in a model path. The name is escaped,
    and the escape never makes two names one."""
    url = {**DYNAMIC, "url": f"file://{tmp_path}/store"}
    pool = make_host_pool("page_first", page_size=PAGE)
    at_sign = open_storage(pool, url, model_name="/models/llama@v2")
    look_alike = open_storage(pool, url, model_name="/models/llama%40v2")
    keys = ["ab" * 32]
    assert at_sign.batch_set_v1(keys, slots(3)) == [True]
    assert at_sign.batch_exists(keys) == 1
    assert look_alike.batch_exists(keys) == 0
    assert stored_model_fields(at_sign) == {"/models/llama%40v2"}


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_a_pinned_host_pool_on_a_machine_without_an_accelerator_is_served(
    layout: str,
    tmp_path: Path,
    make_host_pool: Callable[..., HostKVCache],
    open_storage: OpenStorage,
    page_bytes: PageBytes,
) -> None:
    """SGLang's engine builds its host pools with pin_memory=True, also on --device cpu, where
    pinned allocation (get_dummy_flat_data_page) raises: kvplug never allocates through the
    pool, for the page API or the copying one."""
    pool = make_host_pool(layout, page_size=PAGE)
    pool.pin_memory = True  # as SGLang's engine builds it (the buffer itself is plain here)
    with pytest.raises(RuntimeError, match="pin_memory"):
        pool.get_dummy_flat_data_page()  # what SGLang's own generic path would allocate
    storage = open_storage(pool, {**DYNAMIC, "url": f"file://{tmp_path}/store"})
    keys = ["cd" * 32, "ef" * 32]
    assert storage.batch_set_v1(keys, slots(1, 4)) == [True, True]
    pages = storage.batch_get(keys)  # the copying API, with no target tensors given
    assert all(page is not None for page in pages)
    for page, slot in zip(pages, (1, 4), strict=True):
        assert page is not None and page.dtype == pool.dtype
        assert torch.equal(page.view(torch.uint8), page_bytes(pool, slot * PAGE))


class BareHostPool:
    """A host pool with only what SGLang's own storage tests give theirs (Mooncake's and
    SiMM's ``MockHostKVCache``: ``kv_buffer``, ``layout``, ``page_size`` and
    ``get_page_buffer_meta``, a page as K and V regions): no ``dtype``, no
    ``get_dummy_flat_data_page``, no ``get_data_page``."""

    def __init__(self, pages: int, page_elements: int, dtype: torch.dtype) -> None:
        self.kv_buffer = torch.randn(pages * 2 * page_elements).to(dtype)
        self.layout = "page_first"
        self.page_size = 1
        self.page_elements = page_elements

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        size = self.page_elements * self.kv_buffer.element_size()
        pointers = []
        for index in indices.tolist():
            start = index * 2 * self.page_elements
            pointers += [
                self.kv_buffer[start:].data_ptr(),
                self.kv_buffer[start + self.page_elements :].data_ptr(),
            ]
        return pointers, [size] * len(pointers)

    def page(self, index: int) -> torch.Tensor:
        start = index * 2 * self.page_elements
        return self.kv_buffer[start : start + 2 * self.page_elements].clone()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_pool_with_only_page_regions_round_trips_keyed_by_its_buffers_dtype(
    dtype: torch.dtype, tmp_path: Path, storage_config: Callable[..., Any]
) -> None:
    pool = BareHostPool(pages=16, page_elements=256, dtype=dtype)
    extra = {**DYNAMIC, "url": f"file://{tmp_path}/store"}
    storage = StorageBackendFactory.create_backend(
        "dynamic", storage_config(extra_config=extra, is_page_first_layout=True), pool
    )
    try:
        storage.register_mem_pool_host(pool)
        keys = [f"{i:02x}" * 32 for i in range(1, 4)]
        sent = [pool.page(i) for i in (0, 1, 2)]
        assert storage.batch_set_v1(keys, torch.tensor([0, 1, 2])) == [True] * 3
        assert storage.batch_exists(keys) == 3
        assert storage.batch_get_v1(keys, torch.tensor([7, 8, 9])) == [True] * 3
        for page, index in zip(sent, (7, 8, 9), strict=True):
            assert torch.equal(pool.page(index), page)
        other = {str(key.dtype) for key in storage._keys(keys)}
        assert other == {"float" if dtype == torch.float32 else "bfloat16"}
    finally:
        storage.close()


def test_a_pool_that_holds_no_kv_is_refused_naming_what_it_lacks(
    storage_config: Callable[..., Any],
) -> None:
    """DeepSeek V4's anchor pool (LogicalHostPool) holds no KV: it is served through SGLang's
    multi-pool v2 API, which kvplug-sglang does not implement."""
    from sglang.srt.mem_cache.memory_pool_host import LogicalHostPool

    storage = StorageBackendFactory.create_backend(
        "dynamic", storage_config(extra_config={**DYNAMIC, "url": "cpu://"}), None
    )
    try:
        with pytest.raises(ConfigError, match=r"LogicalHostPool.*get_page_buffer_meta.*v2 API"):
            storage.register_mem_pool_host(LogicalHostPool(64, PAGE))
        unnamed_layout = BareHostPool(pages=4, page_elements=8, dtype=torch.float16)
        del unnamed_layout.layout
        with pytest.raises(ConfigError, match="has no layout"):
            storage.register_mem_pool_host(unnamed_layout)
        assert storage.batch_set_v1(["ab" * 32], torch.arange(PAGE)) == [False]  # none registered
    finally:
        storage.close()
