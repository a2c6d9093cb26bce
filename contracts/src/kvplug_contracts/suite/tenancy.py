"""Clause 16: tenants never see each other's chunks.

One shared store serves several tenants (teams, customers, LoRA adapters); the same prompt
under two tenants hashes to the same chunk, so the tenant (:attr:`kvplug.keys.CacheKey.tenant`,
LMCache's ``cache_salt``) is the only thing that tells their keys apart. A backend that drops
or truncates it, or maps two tenant names to one stored name, hands one tenant's KV cache to
another: this clause stores one chunk hash under many tenants, names that differ in case, in
characters that need escaping, in length up to the longest allowed, and checks every way a
backend answers (get, contains, batched_exists, batched_get, remove, list_keys).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from kvplug import Backend, CacheKey, FreeListAllocator, MemoryObj
from kvplug.keys import MAX_TENANT_LENGTH
from kvplug_contracts.suite.isolation import (
    SHAPE,
    _call,
    _check_listing,
    _expect_absent,
    _expect_own,
    _put_all,
    _require_retention,
    _show,
)
from kvplug_contracts.support import Keyspace, Run, clause, make_obj, release_all, violated

TENANT_NAMES: tuple[str, ...] = (
    "alice",
    "bob",
    "Alice",
    "alice ",
    "team a",
    "a@b",
    "a%40b",
    "../bob",
    "租户-ünï",
    "t" * MAX_TENANT_LENGTH,
    "t" * (MAX_TENANT_LENGTH - 1) + "u",
)
"""Tenant names that a careless backend could merge: case, spaces, the key string's own
separators and escapes, a path, non-ASCII, and the longest names, differing in the last
character only."""


class TenancyContract:
    """Clause 16: the same chunk under other tenants is another key, in every operation.

    :attr:`tenant_names` are the tenants tried; a backend whose protocol cannot carry the
    longest keys (LMCache's plain lm:// protocol: 150 bytes) leaves those out in its own class,
    saying why."""

    tenant_names: ClassVar[tuple[str, ...]] = TENANT_NAMES

    @clause(16)
    def test_one_chunk_under_other_tenants_is_another_key(
        self, backend: Backend, run: Run, keyspace: Keyspace, allocator: FreeListAllocator
    ) -> None:
        _require_retention(run, backend, keyspace, allocator)
        base = CacheKey(keyspace.model, 1, 0, 16)
        first, *others = [base.with_tenant(name) for name in self.tenant_names]
        tagged = CacheKey(keyspace.model, 1, 0, 16, tags=(("lora", "a"),)).with_tenant("alice")
        keys = [first, *others, base, tagged]
        objs = {
            key: make_obj(allocator, SHAPE, torch.float16, seed=1600 + n)
            for n, key in enumerate(keys)
        }
        try:
            _put_all(run, backend, {first: objs[first]}, 16)
            _expect_absent(
                run,
                backend,
                [*others, base, tagged],
                objs,
                f"after a put of only {_show(first)},",
                16,
            )
            _put_all(run, backend, objs, 16)
            _expect_own(run, backend, objs, "after a put under each tenant", 16)
            _check_listing(run, backend, set(objs), 16)
            if backend.capabilities.remove:
                _call(run, f"remove of {_show(first)}", backend.remove(first), 16)
                _expect_absent(run, backend, [first], {}, "after its remove", 16)
                rest = {key: obj for key, obj in objs.items() if key != first}
                _expect_own(run, backend, rest, f"after removing {_show(first)}", 16)
        finally:
            release_all(list(objs.values()))

    @clause(16)
    def test_batched_calls_keep_tenants_apart(
        self, backend: Backend, run: Run, keyspace: Keyspace, allocator: FreeListAllocator
    ) -> None:
        _require_retention(run, backend, keyspace, allocator)
        keys = [
            CacheKey(keyspace.model, 1, 0, 17).with_tenant(name) for name in self.tenant_names[:6]
        ]
        stored = keys[::2]
        objs = [
            make_obj(allocator, SHAPE, torch.float16, seed=1700 + n) for n in range(len(stored))
        ]
        found: list[MemoryObj | None] = []
        try:
            _call(run, "batched_put under three tenants", backend.batched_put(stored, objs), 16)
            exists = _call(run, "batched_exists", backend.batched_exists(keys), 16)
            expected = [key in stored for key in keys]
            if list(exists) != expected:
                violated(
                    16,
                    f"batched_exists of one chunk under {len(keys)} tenants, stored under every "
                    f"other one, answered {list(exists)}; expected {expected}",
                )
            found = _call(run, "batched_get", backend.batched_get(keys), 16)
            for key, got in zip(keys, found, strict=True):
                want = objs[stored.index(key)] if key in stored else None
                if want is None and got is not None:
                    violated(16, f"batched_get of {_show(key)}, never written, returned an object")
                if want is not None and (got is None or not torch.equal(got.raw, want.raw)):
                    violated(16, f"batched_get of {_show(key)} did not return its own object")
        finally:
            release_all([*objs, *found])
