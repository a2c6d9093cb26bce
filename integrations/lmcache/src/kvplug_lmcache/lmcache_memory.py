"""LMCache's memory as kvplug sees it: the bytes of an LMCache memory object
(:func:`byte_view`) and the tags LMCache 0.5.7 asks of an adapter for where a backend keeps
them (:func:`memory_tags`)."""

from __future__ import annotations

from typing import Any

import torch

from kvplug.backend import Backend
from kvplug.errors import KvplugError
from kvplug.runtime.engine import tiers_of

try:  # LMCache 0.5.7 and later: adapters declare the memory they keep bytes in
    from lmcache.v1.distributed.api import MemoryResidency, MemorySegment, MemoryTags
except ImportError:  # LMCache 0.5.6
    MemoryResidency = MemorySegment = MemoryTags = None


def byte_view(obj: Any) -> torch.Tensor:
    """The logical bytes of an LMCache memory object as a flat uint8 tensor (no copy)."""
    raw = obj.raw_tensor
    if raw is None:
        raise KvplugError("LMCache handed over an invalidated memory object; it has no bytes.")
    if not raw.is_contiguous():
        raise KvplugError("LMCache handed over a memory object whose buffer is not contiguous.")
    flat = raw.reshape(-1).view(torch.uint8)
    size = int(obj.get_size())
    if flat.numel() < size:
        raise KvplugError(
            f"LMCache's memory object says it holds {size} bytes but its buffer has only "
            f"{flat.numel()}."
        )
    view: torch.Tensor = flat[:size]
    return view


def memory_tags(backend: Backend, shared: bool) -> Any:
    """LMCache's tags for where the backend keeps its bytes, seen through wrappers: REMOTE
    where other hosts may see them (LMCache's meaning), so not for ``file://``, whose directory
    the processes of one host share (LMCache says ``shared`` for one on a network
    filesystem)."""
    tiers = tiers_of(backend)
    remote = shared or any(
        tier.capabilities.shared_across_processes and tier.url.scheme != "file" for tier in tiers
    )
    residency = MemoryResidency.REMOTE if remote else MemoryResidency.LOCAL
    if all(tier.url.scheme in ("gds", "weka") for tier in tiers):
        segment = MemorySegment.GDS
    elif all(tier.capabilities.zero_copy and not tier.capabilities.persistent for tier in tiers):
        segment = MemorySegment.DRAM
    else:
        segment = MemorySegment.STORAGE
    return MemoryTags(segment, residency)


__all__ = ["MemoryTags", "byte_view", "memory_tags"]
