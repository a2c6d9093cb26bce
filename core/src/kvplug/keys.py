"""Cache keys and stable chunk hashing.

A :class:`CacheKey` names one chunk of KV cache of one model, one tensor-parallel rank. Its
string form is LMCache's, ``fmt@model@world_size@worker_id@chunk_hash[@key%value...]``, so keys
cross the ``lm://`` wire and are shared with LMCache deployments.

Example::

    >>> from kvplug.keys import CacheKey, chunk_hashes
    >>> hashes = chunk_hashes(list(range(600)), chunk_size=256)
    >>> len(hashes)
    3
    >>> key = CacheKey("vllm", "meta-llama/Llama-3.1-8B", 1, 0, hashes[0])
    >>> CacheKey.parse(str(key)) == key
    True
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import xxhash

from kvplug.errors import ConfigError

DEFAULT_CHUNK_SIZE = 256
_INT64_SPAN = 1 << 64


class InvalidKey(ConfigError):
    """A key string or key field cannot be used."""


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


@dataclass(frozen=True, order=True)
class CacheKey:
    """The identity of one stored chunk; immutable, hashable, ordered field by field."""

    fmt: str
    model_name: str
    world_size: int
    worker_id: int
    chunk_hash: int
    tags: tuple[tuple[str, str], ...] = field(default=())

    def __post_init__(self) -> None:
        _check_field("fmt", self.fmt, "@%")
        _check_field("model_name", self.model_name, "@")
        for name in ("world_size", "worker_id", "chunk_hash"):
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
        if isinstance(self.tags, Mapping):
            object.__setattr__(self, "tags", tuple(self.tags.items()))
        for tag_key, tag_value in self.tags:
            _check_field("tags key", tag_key, "@%")
            _check_field("tags value", tag_value, "@")

    @property
    def namespace(self) -> str:
        """``fmt@model@world_size@worker_id``: the key space this key lives in."""
        return f"{self.fmt}@{self.model_name}@{self.world_size}@{self.worker_id}"

    def to_string(self) -> str:
        """LMCache's string form: ``fmt@model@world_size@worker_id@chunk_hash[@k%v...]``."""
        base = f"{self.namespace}@{self.chunk_hash}"
        return base + "".join(f"@{k}%{v}" for k, v in self.tags)

    __str__ = to_string

    @classmethod
    def parse(cls, text: str) -> CacheKey:
        """Parse the string form; raises :class:`InvalidKey` naming what is wrong."""
        if not isinstance(text, str):
            raise InvalidKey(f"a key string is needed, got {type(text).__name__}.")
        parts = text.split("@")
        if len(parts) < 5:
            raise InvalidKey(
                f"key {text!r} has {len(parts)} '@'-separated fields; a key has at least five: "
                "fmt@model@world_size@worker_id@chunk_hash."
            )
        fmt, model_name, world, worker, chunk = parts[:5]
        numbers = []
        for name, raw in (("world_size", world), ("worker_id", worker), ("chunk_hash", chunk)):
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
                raise InvalidKey(f"key {text!r}: tag {raw_tag!r} has no '%' between key and value.")
            tags.append((tag_key, tag_value))
        return cls(fmt, model_name, numbers[0], numbers[1], numbers[2], tuple(tags))

    def with_hash(self, chunk_hash: int) -> CacheKey:
        """The same namespace and tags with another chunk hash."""
        return CacheKey(
            self.fmt, self.model_name, self.world_size, self.worker_id, chunk_hash, self.tags
        )


def _to_signed64(value: int) -> int:
    return value - _INT64_SPAN if value >= _INT64_SPAN // 2 else value


def chain_hash(prefix_hash: int, token_ids: Sequence[int] | np.ndarray) -> int:
    """Stable 64-bit hash of ``token_ids`` chained onto ``prefix_hash`` (xxh3-64).

    The same tokens after the same prefix hash give the same value in every process and on every
    machine (unlike Python's salted ``hash``).
    """
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


__all__ = ["CacheKey", "InvalidKey", "chain_hash", "chunk_hashes", "chunk_keys"]
