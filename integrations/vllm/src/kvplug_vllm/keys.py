"""vLLM ``OffloadKey`` s as kvplug :class:`~kvplug.keys.CacheKey` s, losslessly, in a namespace
that names everything that makes two chunks with the same tokens hold different bytes.

vLLM names an offloaded chunk by its ``OffloadKey``: the block hash (chained over the token ids,
LoRA, multimodal inputs and cache salt of every block before it) followed by the KV cache group
index as 4 big-endian bytes. kvplug keeps those bytes whole as the key's chunk hash, so
:func:`offload_key_of` gives the OffloadKey back exactly.

A block hash says nothing about the model, its weights or how the bytes are laid out, so the
namespace around it carries them (see :class:`ChunkNamespace`):

* the model name, as the key's model field, and the KV cache dtype;
* the layout of a primary-tier row: tokens per hash, blocks per chunk, the KV cache groups
  (tokens per block and layer names), the canonical format if any, whether the row holds one
  copy (replicated MLA) or one per worker, the row size, and the parallel sizes (TP, PP, PCP,
  DCP) unless vLLM says the bytes are the same under any topology;
* the weights' identity (:func:`model_identity`): a fingerprint of the weight files for a local
  model directory, the Hugging Face snapshot (commit) vLLM loaded for a hub id, or what the
  operator sets as ``model_identity``. vLLM's block hashes do not cover the weights, so without
  this a fine-tune saved under the same name would be served the old model's KV;
* an epoch, which changes at each cache reset of a tier told to forget what it stored before
  (``on_reset: "forget"``, for weights updated in place); by default it never changes.

These go into the key as one ``@vllm%<digest>`` tag (a SHA-256 prefix of their canonical JSON):
a chunk written under any other layout, weights or epoch is a miss, never wrong bytes.

Example::

    >>> ns = ChunkNamespace("Qwen/Qwen3-8B", world_size=1, dtype="bfloat16",
    ...                     layout={"row_bytes": 4096}, identity="abc")
    >>> key = ns.key_of(bytes(32) + (0).to_bytes(4, "big"))
    >>> str(key).startswith("Qwen/Qwen3-8B@1@0@" + "00" * 36 + "@bfloat16@vllm%")
    True
    >>> offload_key_of(key) == bytes(36)
    True
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvplug.keys import LMCACHE_DTYPE_NAMES, CacheKey, InvalidKey

NAMESPACE_TAG = "vllm"
"""Tag whose value is the digest of a :class:`ChunkNamespace`'s layout, weights and epoch."""
_DIGEST_HEX = 24
GROUP_INDEX_BYTES = 4
"""vLLM appends the KV cache group index to the block hash as this many big-endian bytes."""
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".json")
"""Files of a local model directory whose name, size and modification time identify it."""


def key_dtype(vllm_dtype: str) -> str:
    """LMCache's key name for vLLM's KV cache dtype string (``"bfloat16"`` -> ``"bfloat16"``,
    ``"float16"`` -> ``"half"``); ``"uint8"`` for vLLM's byte formats (``"fp8"``,
    ``"fp8_ds_mla"``...), whose exact name is in the namespace digest anyway."""
    dtype = getattr(torch, vllm_dtype, None)
    if isinstance(dtype, torch.dtype) and dtype in LMCACHE_DTYPE_NAMES:
        return LMCACHE_DTYPE_NAMES[dtype]
    return "uint8"


def offload_key_of(key: CacheKey) -> bytes:
    """The vLLM OffloadKey a CacheKey made by :meth:`ChunkNamespace.key_of` stands for, also
    after a round trip through its string form (which reads a hash without leading zero bytes
    as an int: the same key)."""
    text = key.chunk_hash_hex
    if len(text) % 2 or len(text) <= 2 * GROUP_INDEX_BYTES or text.startswith("-"):
        raise InvalidKey(f"{key} was not made from a vLLM OffloadKey.")
    return bytes.fromhex(text)


def _local_fingerprint(directory: Path) -> str:
    files = sorted(
        path
        for path in directory.rglob("*")
        if path.is_file() and path.name.endswith(WEIGHT_SUFFIXES)
    )
    digest = hashlib.sha256()
    for path in files:
        stat = path.stat()
        digest.update(
            f"{path.relative_to(directory)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode()
        )
    return f"files:{digest.hexdigest()[:_DIGEST_HEX]}"


def _hub_snapshot(repo_id: str, revision: str) -> str | None:
    try:
        from huggingface_hub.constants import HF_HUB_CACHE
    except ImportError:
        return None
    ref = Path(HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}" / "refs" / revision
    try:
        return f"hub:{ref.read_text().strip()}"
    except OSError:
        return None


def model_identity(model: str, revision: str = "main") -> str | None:
    """What identifies the weights vLLM serves as ``model``, or None when nothing does but the
    name.

    A local directory is fingerprinted by the names, sizes and modification times of its weight
    and config files (a retrained checkpoint written over it changes them); a Hugging Face hub
    id by the commit its ``revision`` resolves to in the local hub cache (vLLM downloads the
    weights before the scheduler starts). Operators who update weights any other way set the
    tier's ``model_identity`` instead.
    """
    path = Path(model).expanduser()
    if path.is_dir():
        return _local_fingerprint(path)
    return _hub_snapshot(model, revision)


@dataclass(frozen=True)
class ChunkNamespace:
    """The key space of one vLLM instance's primary-tier rows: everything in a key but the
    OffloadKey.

    Fields:
        model_name: vLLM's model name (``--model``).
        world_size: the workers whose data one row holds (1 when the bytes do not depend on the
            parallel layout); the key's worker id is always 0, since a row holds every worker's
            share of the chunk.
        dtype: LMCache's key name of the KV dtype (:func:`key_dtype`).
        layout: what fixes a row's bytes (see the module documentation); any JSON value.
        identity: the weights' identity (:func:`model_identity`), or None.
        epoch: changes at each cache reset under ``on_reset: "forget"``; "" at start.
    """

    model_name: str
    world_size: int
    dtype: str
    layout: Mapping[str, Any]
    identity: str | None = None
    epoch: str = ""
    digest: str = field(init=False)

    def __post_init__(self) -> None:
        canonical = json.dumps(
            {"layout": self.layout, "identity": self.identity, "epoch": self.epoch},
            sort_keys=True,
            separators=(",", ":"),
        )
        object.__setattr__(
            self, "digest", hashlib.sha256(canonical.encode()).hexdigest()[:_DIGEST_HEX]
        )
        CacheKey(self.model_name, self.world_size, 0, 0, self.dtype, self._tags())

    def _tags(self) -> tuple[tuple[str, str], ...]:
        return ((NAMESPACE_TAG, self.digest),)

    def key_of(self, offload_key: bytes) -> CacheKey:
        """The kvplug key of vLLM's ``offload_key`` in this namespace."""
        if not isinstance(offload_key, bytes) or len(offload_key) <= GROUP_INDEX_BYTES:
            raise InvalidKey(
                f"a vLLM OffloadKey is a block hash followed by {GROUP_INDEX_BYTES} bytes of "
                f"group index, got {offload_key!r}."
            )
        return CacheKey(self.model_name, self.world_size, 0, offload_key, self.dtype, self._tags())

    def owns(self, key: CacheKey) -> bool:
        """Whether ``key`` was made by this namespace."""
        try:
            return self.key_of(offload_key_of(key)) == key
        except InvalidKey:
            return False


__all__ = [
    "GROUP_INDEX_BYTES",
    "NAMESPACE_TAG",
    "ChunkNamespace",
    "key_dtype",
    "model_identity",
    "offload_key_of",
]
