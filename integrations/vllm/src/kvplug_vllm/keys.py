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

A request's tenant follows, as kvplug's tenant tag (``@salt%<name>``,
:attr:`kvplug.keys.CacheKey.tenant`), so the store can tell whose chunk it holds (per-tenant
quotas and keys) and the same chunk of two tenants is two objects. vLLM folds a request's
``cache_salt`` into its block hashes but does not hand it to a tier (its ``ReqContext`` carries
``kv_transfer_params``, not the salt): :func:`request_tenant` reads the tenant from
``kv_transfer_params["kvplug_tenant"]`` (:data:`TENANT_PARAM`), else the tier's ``tenant``
setting.

Example::

    >>> ns = ChunkNamespace("Qwen/Qwen3-8B", world_size=1, dtype="bfloat16",
    ...                     layout={"row_bytes": 4096}, identity="abc")
    >>> key = ns.key_of(bytes(32) + (0).to_bytes(4, "big"))
    >>> str(key).startswith("Qwen/Qwen3-8B@1@0@" + "00" * 36 + "@bfloat16@vllm%")
    True
    >>> offload_key_of(key) == bytes(36)
    True
    >>> ns.key_of(bytes(36), tenant="team-a").tenant
    'team-a'
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvplug.keys import (
    LMCACHE_DTYPE_NAMES,
    MAX_TENANT_LENGTH,
    TENANT_TAG,
    CacheKey,
    InvalidKey,
    tenant_tag_value,
)

NAMESPACE_TAG = "vllm"
"""Tag whose value is the digest of a :class:`ChunkNamespace`'s layout, weights and epoch."""
_DIGEST_HEX = 24
GROUP_INDEX_BYTES = 4
"""vLLM appends the KV cache group index to the block hash as this many big-endian bytes."""
TENANT_PARAM = "kvplug_tenant"
"""The ``kv_transfer_params`` key that names a request's tenant."""
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


def checked_tenant(value: Any, where: str) -> str:
    """``value`` as a tenant name; :class:`~kvplug.keys.InvalidKey` saying ``where`` it came
    from, what is wrong with it and the fix, when it is no tenant name (a non-empty string of at
    most :data:`~kvplug.keys.MAX_TENANT_LENGTH` characters, without NUL).

    >>> checked_tenant("team-a", "tenant")
    'team-a'
    """
    try:
        if not isinstance(value, str):  # a client's value: its repr is cut short for the logs
            raise InvalidKey(f"a tenant is a non-empty string, got {repr(value)[:40]}.")
        tenant_tag_value(value)
    except InvalidKey as error:
        raise InvalidKey(
            f"{where} is refused: {error} Set it to the tenant's name, a string of 1 to "
            f"{MAX_TENANT_LENGTH} characters without NUL."
        ) from None
    name: str = value
    return name


def request_tenant(kv_transfer_params: object, deployment: str = "") -> str:
    """The tenant a request's chunks are looked up, loaded and stored under: what its
    ``kv_transfer_params["kvplug_tenant"]`` names, else ``deployment`` (the tier's ``tenant``
    setting; ``""`` for none: keys without a tenant).

    Raises :class:`~kvplug.keys.InvalidKey` (the tier then serves the request without kvplug)
    for a name that is no tenant name, and for a tenant other than ``deployment`` where one is
    set: such a request never falls back to another tenant's keys, nor to keys without one.

    Example (a tenant other than the deployment's is refused)::

        >>> request_tenant({"kvplug_tenant": "team-a", "max_load_tokens": 0})
        'team-a'
        >>> request_tenant(None, deployment="team-b"), request_tenant({}), request_tenant(None)
        ('team-b', '', '')
        >>> request_tenant({"kvplug_tenant": "team-a"}, deployment="team-b")
        Traceback (most recent call last):
        ...
        kvplug.keys.InvalidKey: kv_transfer_params['kvplug_tenant'] names tenant 'team-a', ...
    """
    named = (
        kv_transfer_params.get(TENANT_PARAM) if isinstance(kv_transfer_params, Mapping) else None
    )
    if named is None:
        return deployment
    tenant = checked_tenant(named, f"kv_transfer_params[{TENANT_PARAM!r}]")
    if deployment and tenant != deployment:
        raise InvalidKey(
            f"kv_transfer_params[{TENANT_PARAM!r}] names tenant {tenant[:32]!r}, but this tier "
            f"serves tenant {deployment!r} only (its tenant setting). Send other tenants' "
            "requests to their own deployment, or remove the tier's tenant setting so that each "
            "request names its own."
        )
    return tenant


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

    def _tags(self, tenant: str = "") -> tuple[tuple[str, str], ...]:
        namespace = (NAMESPACE_TAG, self.digest)
        return (namespace, (TENANT_TAG, tenant_tag_value(tenant))) if tenant else (namespace,)

    def key_of(self, offload_key: bytes, tenant: str = "") -> CacheKey:
        """The kvplug key of vLLM's ``offload_key`` in this namespace, for ``tenant`` (``""``:
        none)."""
        return self.keys_of([offload_key], tenant)[0]

    def keys_of(self, offload_keys: Iterable[bytes], tenant: str = "") -> list[CacheKey]:
        """The kvplug keys of ``offload_keys`` in this namespace, for ``tenant`` (``""``:
        none)."""
        tags = self._tags(tenant)
        keys = []
        for offload_key in offload_keys:
            if not isinstance(offload_key, bytes) or len(offload_key) <= GROUP_INDEX_BYTES:
                raise InvalidKey(
                    f"a vLLM OffloadKey is a block hash followed by {GROUP_INDEX_BYTES} bytes "
                    f"of group index, got {offload_key!r}."
                )
            keys.append(
                CacheKey(self.model_name, self.world_size, 0, offload_key, self.dtype, tags)
            )
        return keys

    def owns(self, key: CacheKey) -> bool:
        """Whether ``key`` was made by this namespace, for any tenant."""
        try:
            return self.key_of(offload_key_of(key), key.tenant) == key
        except InvalidKey:
            return False


__all__ = [
    "GROUP_INDEX_BYTES",
    "NAMESPACE_TAG",
    "TENANT_PARAM",
    "ChunkNamespace",
    "checked_tenant",
    "key_dtype",
    "model_identity",
    "offload_key_of",
    "request_tenant",
]
