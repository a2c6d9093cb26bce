"""What a KvplugTier accepts when vLLM's ``SecondaryTierFactory`` builds it: the primary tier's
memory as a view of any item type (vLLM's own tier tests hand a float32 view; a row is its
bytes), a precise error for a view kvplug cannot use, and a tier whose start failed that still
prints (a traceback or a log line formats it)."""

from __future__ import annotations

import math
import mmap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from vllm.v1.kv_offload.base import OffloadingSpec, OffloadKey, ReqContext
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager, TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

from kvplug.errors import KvplugError
from kvplug_vllm import KvplugTier
from kvplug_vllm.testing import chunk_keys, offloading_config

CHUNKS = 8


@pytest.fixture
def spec() -> OffloadingSpec:
    return OffloadingSpecFactory.create_spec(offloading_config([]))


@pytest.fixture
def tiers() -> Iterator[list[SecondaryTierManager]]:
    """Tiers a test builds, shut down after it."""
    built: list[SecondaryTierManager] = []
    yield built
    for tier in built:
        tier.shutdown()
    built.clear()  # before the region the tiers viewed is unmapped


def build(
    tiers: list[SecondaryTierManager], spec: OffloadingSpec, view: memoryview, **tier: Any
) -> SecondaryTierManager:
    """The tier ``tier`` names, built by vLLM's factory over ``view``."""
    made = SecondaryTierFactory.create_secondary_tier(tier, view, spec)
    tiers.append(made)
    return made


def run(tier: SecondaryTierManager, job: TransferJob) -> bool:
    """Submit ``job``, drain, and whether it succeeded."""
    (tier.submit_load if job.is_promotion else tier.submit_store)(job)
    tier.drain_jobs()
    (result,) = tier.get_finished_jobs()
    assert result.job_id == job.job_id
    return bool(result.success)


def job(job_id: int, keys: list[OffloadKey], rows: list[int], promotion: bool) -> TransferJob:
    return TransferJob(job_id, keys, np.array(rows), promotion, ReqContext(f"req-{job_id}"))


@pytest.mark.parametrize(
    ("dtype", "row_shape"),
    [("float32", (4096,)), ("float16", (2, 16, 64)), ("int8", (4096,))],
    ids=["float32", "float16-3d", "int8"],
)
def test_a_primary_view_of_any_item_type_round_trips_its_bytes_as_vllms_fs_tier_does(
    tiers: list[SecondaryTierManager],
    spec: OffloadingSpec,
    tmp_path: Path,
    dtype: str,
    row_shape: tuple[int, ...],
) -> None:
    region = mmap.mmap(-1, CHUNKS * math.prod(row_shape) * np.dtype(dtype).itemsize)
    primary = np.frombuffer(region, dtype=dtype).reshape(CHUNKS, *row_shape)  # page-aligned
    view = memoryview(primary)
    row_bytes = primary[0].nbytes
    rng = np.random.default_rng(7)
    primary[:2] = np.frombuffer(rng.bytes(2 * row_bytes), dtype=dtype).reshape(2, *row_shape)
    original = primary[:2].copy()
    keys = chunk_keys(2)
    ours = build(tiers, spec, view, type="kvplug", url=f"file://{tmp_path}/kv")
    fs = build(tiers, spec, view, type="fs", root_dir=str(tmp_path / "fs"))
    assert ours.block_size_bytes == fs.block_size_bytes == row_bytes
    for number, tier in enumerate((ours, fs)):
        assert run(tier, job(10 * number + 1, keys, [0, 1], promotion=False))
        primary[2:] = 0
        assert run(tier, job(10 * number + 2, keys, [5, 6], promotion=True))
        assert primary[5:7].tobytes() == original.tobytes(), type(tier).__name__
        assert not primary[2:5].any() and not primary[7:].any()


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda a: a[:, ::2], ["not C-contiguous", "shape (8, 2048)", "strides (16384, 8)"]),
        (lambda a: a.reshape(-1), ["1 dimension(s)", "shape (32768,)"]),
        (lambda a: np.asfortranarray(a), ["not C-contiguous", "strides (4, 32)"]),
        (lambda a: a[::-1], ["not C-contiguous", "strides (-16384, 4)"]),
    ],
    ids=["strided-rows", "1-d", "fortran", "reversed"],
)
def test_a_primary_view_kvplug_cannot_use_is_refused_naming_its_shape_and_strides(
    spec: OffloadingSpec, tmp_path: Path, make: Any, words: list[str]
) -> None:
    base = np.zeros((CHUNKS, 4096), dtype=np.float32)
    with pytest.raises(KvplugError) as raised:
        KvplugTier(spec, memoryview(make(base)), "kvplug", url=f"file://{tmp_path}/kv")
    message = str(raised.value)
    for word in words:
        assert word in message, message
    assert "version" not in message  # the view is wrong, not the vLLM release


def test_a_read_only_primary_view_is_refused_as_read_only(
    spec: OffloadingSpec, tmp_path: Path
) -> None:
    view = memoryview(bytes(CHUNKS * 1024)).cast("B", (CHUNKS, 1024))
    with pytest.raises(KvplugError, match=r"read-only: loads write into it \(shape \(8, 1024\)"):
        KvplugTier(spec, view, "kvplug", url=f"file://{tmp_path}/kv")


@pytest.mark.parametrize(
    "settings",
    [{}, {"url": "cpu://", "on_reset": "drop"}, {"url": "cpu://", "options": "not a mapping"}],
    ids=["no-target", "bad-option", "options-not-a-mapping"],
)
def test_a_tier_whose_settings_are_refused_still_prints(
    spec: OffloadingSpec, settings: dict[str, Any]
) -> None:
    """The half-built tier a failed ``__init__`` leaves behind (a traceback's or a log line's
    formatting reaches it) prints, where it raised AttributeError."""
    tier = KvplugTier.__new__(KvplugTier)
    view = memoryview(np.zeros((CHUNKS, 64), dtype=np.uint8))
    with pytest.raises(KvplugError):
        tier.__init__(spec, view, "kvplug", **settings)  # type: ignore[misc]
    assert repr(tier) == "KvplugTier(not set up)"
