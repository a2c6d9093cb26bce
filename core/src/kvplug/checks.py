"""The checks of what a public operation of a backend is given: keys and memory objects.

The template runs them before any hook, so a hook receives only checked arguments; the errors
say what was expected and how to make it. Memory objects are checked without importing torch
up front: :mod:`kvplug.memory` is imported on first use (:func:`memory_module`).

Example::

    >>> try:
    ...     check_key("llama@1@0@7", "get")
    ... except TypeError as error:
    ...     print(str(error).split(";")[0])
    get needs a kvplug.CacheKey, got str
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

from kvplug.errors import RefCountError
from kvplug.keys import CacheKey

_memory_module: ModuleType | None = None


def memory_module() -> ModuleType:
    """:mod:`kvplug.memory`, imported on first use (it imports torch)."""
    global _memory_module
    if _memory_module is None:
        import kvplug.memory

        _memory_module = kvplug.memory
    return _memory_module


def check_key(key: object, operation: str) -> None:
    if not isinstance(key, CacheKey):
        raise TypeError(
            f"{operation} needs a kvplug.CacheKey, got {type(key).__name__}; build one with "
            "CacheKey(model_name, world_size, worker_id, chunk_hash)."
        )


def check_keys(keys: object, operation: str) -> None:
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
        raise TypeError(
            f"{operation} needs a sequence of kvplug.CacheKey, got {type(keys).__name__}."
        )
    for key in keys:
        check_key(key, operation)


def check_obj(obj: object, operation: str) -> None:
    memory = memory_module()
    if not isinstance(obj, memory.MemoryObj):
        raise TypeError(
            f"{operation} needs a kvplug.MemoryObj, got {type(obj).__name__}; wrap a tensor "
            "with MemoryObj.from_tensor() or allocate one from an allocator."
        )
    if not obj.is_valid:
        raise RefCountError(
            f"{operation} got a memory object that was already freed ({obj!r}); keep a "
            "reference until the operation returns."
        )


def check_pairs(keys: Sequence[CacheKey], objs: Sequence[object], operation: str) -> None:
    """The checks of a batched operation's keys and their objects, one per key."""
    check_keys(keys, operation)
    if len(keys) != len(objs):
        raise ValueError(f"{operation} got {len(keys)} keys but {len(objs)} objects.")
    for obj in objs:
        check_obj(obj, operation)


__all__ = ["check_key", "check_keys", "check_obj", "check_pairs", "memory_module"]
