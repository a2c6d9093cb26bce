"""Cache keys and stable chunk hashing.

A :class:`CacheKey` names one chunk of KV cache of one model, one tensor-parallel rank. Its
string form is exactly what LMCache 0.5.x writes for its ``CacheEngineKey``,
``model@world_size@worker_id@<hex chunk hash>@<dtype name>[@key%value...]``, so a Redis, file
or lm:// store can be shared with LMCache deployments, and every engine's key maps onto it with
no truncation (see ``docs/concepts.md``, "Keys").

Example::

    >>> from kvplug.keys import CacheKey, chunk_hashes
    >>> hashes = chunk_hashes(list(range(600)), chunk_size=256)
    >>> len(hashes)
    3
    >>> key = CacheKey("meta-llama/Llama-3.1-8B", 1, 0, 0x1F2E, dtype="bfloat16")
    >>> str(key)
    'meta-llama/Llama-3.1-8B@1@0@1f2e@bfloat16'
    >>> CacheKey.parse(str(key)) == key
    True
    >>> CacheKey("m", 1, 0, b"\\x00\\x1f").to_string()  # a bytes hash keeps its leading zeros
    'm@1@0@001f@half'
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, unquote

import xxhash

from kvplug.errors import ConfigError

# torch and numpy are imported where a dtype or an array is handled, not here, so that naming
# keys (the CLI, config checks, plugin discovery) does not load them.
if TYPE_CHECKING:
    import numpy as np
    import torch

    LMCACHE_DTYPE_NAMES: Mapping[torch.dtype, str]

DEFAULT_CHUNK_SIZE = 256
_INT64_SPAN = 1 << 64

_LMCACHE_NAME_BY_TORCH_DTYPE_NAME: Mapping[str, str] = {
    "float16": "half",
    "bfloat16": "bfloat16",
    "float32": "float",
    "float64": "double",
    "int8": "int8",
    "uint8": "uint8",
    "int16": "int16",
    "int32": "int32",
    "int64": "int64",
    "bool": "bool",
    "float8_e4m3fn": "fp8_e4m3fn",
    "float8_e4m3fnuz": "fp8_e4m3fnuz",
    "float8_e5m2": "fp8_e5m2",
    "float8_e5m2fnuz": "fp8_e5m2fnuz",
}

_DTYPE_NAMES = frozenset(_LMCACHE_NAME_BY_TORCH_DTYPE_NAME.values())
_HEX = re.compile(r"-?[0-9a-f]+")

TENANT_TAG = "salt"
"""The tag naming a key's tenant. LMCache's name for its per-user ``cache_salt``: a key that
LMCache's MP server stores through kvplug and one an engine stores directly name one tenant the
same way."""
MAX_TENANT_LENGTH = 128
"""The longest tenant name, in characters (LMCache's limit on ``cache_salt``)."""
# Printable ASCII except the key separators and '%' itself: quote() is then reversible and its
# text a valid tag value. The same text LMCache's salt gets in kvplug-lmcache's keys.
_TENANT_SAFE = "".join(chr(c) for c in range(33, 127) if chr(c) not in "@%")


def tenant_tag_value(tenant: str) -> str:
    """The value of the ``salt`` tag that names ``tenant`` in a key's string form
    (percent-encoded); raises :class:`InvalidKey` for a name that is not a tenant's.

    >>> tenant_tag_value("team a@b")
    'team%20a%40b'
    """
    if not isinstance(tenant, str) or not tenant:
        raise InvalidKey(f"a tenant is a non-empty string, got {tenant!r}.")
    if len(tenant) > MAX_TENANT_LENGTH:
        raise InvalidKey(
            f"tenant {tenant[:16]!r}... has {len(tenant)} characters; at most "
            f"{MAX_TENANT_LENGTH} are allowed (LMCache's limit on cache_salt). Use a shorter "
            "name, or a hash of the long one."
        )
    if "\x00" in tenant:
        raise InvalidKey("a tenant name cannot contain NUL characters.")
    return quote(tenant, safe=_TENANT_SAFE)


@functools.cache
def _lmcache_dtype_names() -> Mapping[torch.dtype, str]:
    import torch

    return {
        getattr(torch, dtype): name for dtype, name in _LMCACHE_NAME_BY_TORCH_DTYPE_NAME.items()
    }


def __getattr__(name: str) -> Any:
    # LMCACHE_DTYPE_NAMES, the dtype names LMCache writes in its key strings by torch dtype
    # (torch.float16 -> "half"), is built on first use so that importing this module needs no
    # torch.
    if name == "LMCACHE_DTYPE_NAMES":
        return _lmcache_dtype_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class InvalidKey(ConfigError):
    """A key string or key field cannot be used."""


def lmcache_dtype_name(dtype: torch.dtype) -> str:
    """The name LMCache writes for ``dtype`` in a key string (``torch.float16`` -> ``"half"``)."""
    names = _lmcache_dtype_names()
    try:
        return names[dtype]
    except KeyError:
        raise InvalidKey(
            f"{dtype} has no LMCache key name; the supported dtypes are "
            f"{', '.join(str(d) for d in names)}."
        ) from None


def _check_field(name: str, value: str, forbidden: str) -> None:
    if not isinstance(value, str) or not value:
        raise InvalidKey(f"CacheKey.{name} must be a non-empty string, got {value!r}.")
    bad = sorted({c for c in value if c in forbidden or ord(c) < 32})
    if bad:
        raise InvalidKey(
            f"CacheKey.{name} {value!r} contains {bad!r}: '@' separates key fields, '%' separates "
            "a tag's key from its value, and control characters are not allowed. "
            "Remove those characters."
        )


def _hash_text(chunk_hash: int | bytes) -> str:
    if isinstance(chunk_hash, bytes):
        return chunk_hash.hex()
    return f"{chunk_hash:x}"


def _parse_hash(text: str, key_text: str) -> int | bytes:
    if _HEX.fullmatch(text):
        if text.startswith("-"):
            if not text.startswith(("-0", "--")):
                return int(text, 16)
        elif text == "0" or not text.startswith("0"):
            return int(text, 16)
        elif len(text) % 2 == 0:
            return bytes.fromhex(text)
    raise InvalidKey(
        f"key {key_text!r}: chunk hash {text!r} is not in the form to_string writes: lowercase "
        "hex of an int (no leading zeros, '-' for negative) or of bytes (two digits a byte)."
    )


@functools.total_ordering
@dataclass(frozen=True, eq=False, slots=True)
class CacheKey:
    """The identity of one stored chunk; immutable and hashable.

    Two keys are equal when their string forms are equal (as in an LMCache store): the chunk
    hash is compared as its hex text, so ``b"\\x1f"`` and ``0x1f`` name the same chunk while
    ``b"\\x00\\x1f"`` does not. Keys sort by their string form.

    Fields:
        model_name: the model id; may contain ``/``, not ``@``.
        world_size: the number of workers that split the KV cache (tensor-parallel size).
        worker_id: this worker's rank, ``0 <= worker_id < world_size``.
        chunk_hash: the prefix hash of the chunk, an ``int`` (LMCache in-process, kvplug's own
            :func:`chunk_hashes`) or ``bytes`` (LMCache MP, SGLang, vLLM), kept whole.
        dtype: LMCache's name of the KV cache dtype (``"half"``, ``"bfloat16"``, ...; see
            :data:`LMCACHE_DTYPE_NAMES` and :func:`lmcache_dtype_name`).
        tags: ordered ``(key, value)`` pairs, written ``@key%value`` after the dtype.
    """

    model_name: str
    world_size: int
    worker_id: int
    chunk_hash: int | bytes
    dtype: str = "half"
    tags: tuple[tuple[str, str], ...] = field(default=())
    _text: str = field(init=False, repr=False)

    def __post_init__(self) -> None:
        _check_field("model_name", self.model_name, "@")
        for name in ("world_size", "worker_id"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidKey(f"CacheKey.{name} must be an int, got {value!r}.")
        if self.world_size < 1:
            raise InvalidKey(f"CacheKey.world_size must be >= 1, got {self.world_size}.")
        if not 0 <= self.worker_id < self.world_size:
            raise InvalidKey(
                f"CacheKey.worker_id must be in [0, world_size={self.world_size}), "
                f"got {self.worker_id}."
            )
        chunk_hash = self.chunk_hash
        if not (
            (isinstance(chunk_hash, int) and not isinstance(chunk_hash, bool))
            or (isinstance(chunk_hash, bytes) and chunk_hash)
        ):
            raise InvalidKey(
                f"CacheKey.chunk_hash must be an int or non-empty bytes, got {chunk_hash!r}."
            )
        if self.dtype not in _DTYPE_NAMES:
            raise InvalidKey(
                f"CacheKey.dtype {self.dtype!r} is not one of LMCache's dtype names "
                f"{sorted(_DTYPE_NAMES)}; use kvplug.keys.lmcache_dtype_name(torch_dtype)."
            )
        if isinstance(self.tags, Mapping):
            object.__setattr__(self, "tags", tuple(self.tags.items()))
        for tag_key, tag_value in self.tags:
            _check_field("tags key", tag_key, "@%")
            _check_field("tags value", tag_value, "@")
        text = f"{self.namespace}@{_hash_text(chunk_hash)}@{self.dtype}"
        object.__setattr__(self, "_text", text + "".join(f"@{k}%{v}" for k, v in self.tags))

    @property
    def namespace(self) -> str:
        """``model@world_size@worker_id``: the key space this key lives in."""
        return f"{self.model_name}@{self.world_size}@{self.worker_id}"

    @property
    def chunk_hash_hex(self) -> str:
        """The chunk hash as the string form writes it."""
        return _hash_text(self.chunk_hash)

    def to_string(self) -> str:
        """LMCache's string form: ``model@world_size@worker_id@hexhash@dtype[@k%v...]``."""
        return self._text

    __str__ = to_string

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CacheKey):
            return NotImplemented
        return self._text == other._text

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, CacheKey):
            return NotImplemented
        return self._text < other._text

    def __hash__(self) -> int:
        return hash(self._text)

    @classmethod
    def parse(cls, text: str) -> CacheKey:
        """Parse the string form; raises :class:`InvalidKey` naming what is wrong.

        Only the canonical text that :meth:`to_string` writes is accepted, so two strings never
        name one key: ``CacheKey.parse(s).to_string() == s`` for every accepted ``s``.
        """
        if not isinstance(text, str):
            raise InvalidKey(f"a key string is needed, got {type(text).__name__}.")
        parts = text.split("@")
        if len(parts) < 5:
            raise InvalidKey(
                f"key {text!r} has {len(parts)} '@'-separated fields; a key has at least five: "
                "model@world_size@worker_id@chunk_hash@dtype."
            )
        model_name, world, worker, chunk, dtype = parts[:5]
        numbers = []
        for name, raw in (("world_size", world), ("worker_id", worker)):
            # Only the canonical form that to_string writes: int() alone would also take
            # "+1", " 1", "1_0", "01" and non-ASCII digits, so two strings could name one key.
            value = int(raw, 10) if raw.isascii() and raw.lstrip("-").isdigit() else None
            if value is None or str(value) != raw:
                raise InvalidKey(
                    f"key {text!r}: {name} {raw!r} is not an integer in canonical decimal form."
                )
            numbers.append(value)
        tags = []
        for raw_tag in parts[5:]:
            tag_key, sep, tag_value = raw_tag.partition("%")
            if not sep:
                raise InvalidKey(
                    f"key {text!r}: field {raw_tag!r} after the dtype has no '%' between a tag's "
                    "key and value (LMCache's per-layer keys, which put a layer id there, are "
                    "not kvplug keys)."
                )
            tags.append((tag_key, tag_value))
        return cls(model_name, numbers[0], numbers[1], _parse_hash(chunk, text), dtype, tuple(tags))

    @property
    def tenant(self) -> str:
        """The tenant this key belongs to, ``""`` for none: the decoded value of its ``salt``
        tag (:data:`TENANT_TAG`). The tenant is part of the string form, so the same chunk hash
        under two tenants names two stored objects.

        >>> CacheKey("m", 1, 0, 7).with_tenant("team a").tenant
        'team a'
        """
        for name, value in self.tags:
            if name == TENANT_TAG:
                return unquote(value)
        return ""

    def with_tenant(self, tenant: str) -> CacheKey:
        """This key for ``tenant``: its ``salt`` tag set (in its place when the key has one,
        else last), or removed for ``""``.

        >>> str(CacheKey("m", 1, 0, 7).with_tenant("team a"))
        'm@1@0@7@half@salt%team%20a'
        """
        others = [(name, value) for name, value in self.tags if name != TENANT_TAG]
        if tenant == "":
            tags = others
        else:
            value = tenant_tag_value(tenant)
            place = next(
                (n for n, (name, _) in enumerate(self.tags) if name == TENANT_TAG), len(others)
            )
            tags = [*others[:place], (TENANT_TAG, value), *others[place:]]
        return CacheKey(
            self.model_name,
            self.world_size,
            self.worker_id,
            self.chunk_hash,
            self.dtype,
            tuple(tags),
        )

    def with_hash(self, chunk_hash: int | bytes) -> CacheKey:
        """The same namespace, dtype and tags with another chunk hash."""
        return CacheKey(
            self.model_name, self.world_size, self.worker_id, chunk_hash, self.dtype, self.tags
        )


def _to_signed64(value: int) -> int:
    return value - _INT64_SPAN if value >= _INT64_SPAN // 2 else value


def chain_hash(prefix_hash: int, token_ids: Sequence[int] | np.ndarray) -> int:
    """Stable 64-bit hash of ``token_ids`` chained onto ``prefix_hash`` (xxh3-64).

    The same tokens after the same prefix hash give the same value in every process and on every
    machine (unlike Python's salted ``hash``).
    """
    import numpy as np

    hasher = xxhash.xxh3_64()
    hasher.update((prefix_hash % _INT64_SPAN).to_bytes(8, "little"))
    hasher.update(np.ascontiguousarray(token_ids, dtype="<i8").tobytes())
    return _to_signed64(hasher.intdigest())


def chunk_hashes(
    token_ids: Sequence[int] | np.ndarray,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    prefix_hash: int = 0,
    save_unfull_chunk: bool = True,
) -> list[int]:
    """Prefix-chained hashes, one per chunk of ``chunk_size`` tokens.

    Hash ``i`` depends on every token up to the end of chunk ``i``, so equal hashes mean equal
    prefixes. A trailing partial chunk gets a hash unless ``save_unfull_chunk`` is false.
    """
    import numpy as np

    if chunk_size <= 0:
        raise ConfigError(f"chunk_size must be a positive number of tokens, got {chunk_size}.")
    tokens = np.asarray(token_ids, dtype=np.int64)
    if tokens.ndim != 1:
        raise ConfigError(f"token_ids must be one-dimensional, got shape {tokens.shape}.")
    hashes = []
    current = prefix_hash
    for start in range(0, len(tokens), chunk_size):
        chunk = tokens[start : start + chunk_size]
        if len(chunk) < chunk_size and not save_unfull_chunk:
            break
        current = chain_hash(current, chunk)
        hashes.append(current)
    return hashes


def chunk_keys(
    token_ids: Sequence[int] | np.ndarray,
    template: CacheKey,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    save_unfull_chunk: bool = True,
) -> Iterator[tuple[int, int, CacheKey]]:
    """``(start, end, key)`` for each chunk, keys built from ``template``'s namespace and tags."""
    total = len(token_ids)
    hashes = chunk_hashes(token_ids, chunk_size=chunk_size, save_unfull_chunk=save_unfull_chunk)
    for index, chunk_hash in enumerate(hashes):
        start = index * chunk_size
        yield start, min(start + chunk_size, total), template.with_hash(chunk_hash)


__all__ = [
    "LMCACHE_DTYPE_NAMES",
    "MAX_TENANT_LENGTH",
    "TENANT_TAG",
    "CacheKey",
    "InvalidKey",
    "chain_hash",
    "chunk_hashes",
    "chunk_keys",
    "lmcache_dtype_name",
    "tenant_tag_value",
]
