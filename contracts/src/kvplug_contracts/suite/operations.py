"""The operations the lifecycle clauses run: a call of the backend as a coroutine factory, the
keys a backend lists, letting go of whatever an operation returned, and the shape of the objects
they store."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from kvplug import Backend, CacheKey, MemoryObj
from kvplug_contracts.support import release_all

Operation = Callable[[], Coroutine[Any, Any, object]]
"""One call of a backend, made anew each time it is run."""

SHAPE = (2, 1, 16, 64)


async def listed_keys(backend: Backend) -> list[CacheKey]:
    """Every key ``backend.list_keys()`` yields."""
    return [key async for key in backend.list_keys()]


def release_result(result: object) -> None:
    """Release what an operation returned: an object, or the objects of a list."""
    if isinstance(result, MemoryObj):
        result.release()
    elif isinstance(result, list):
        release_all([r for r in result if isinstance(r, MemoryObj)])


__all__ = ["SHAPE", "Operation", "listed_keys", "release_result"]
