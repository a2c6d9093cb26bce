"""Clause 12: keys are isolated per namespace; no key escapes into another key space."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch

from kvplug import Backend, CacheKey, FreeListAllocator, MemoryObj
from kvplug_contracts.support import (
    ContractTimeout,
    Keyspace,
    Run,
    check_same,
    clause,
    difference,
    make_obj,
    not_applicable,
    release_all,
    violated,
)

# 8 KiB in float16.
SHAPE = (2, 1, 16, 64)

# Model names that try to leave their namespace on a file, URL or key-value backend.
HOSTILE_MODEL_NAMES: tuple[str, ...] = (
    "..",
    ".",
    "../../etc",
    "../../../../../../../../etc/passwd",
    "a/../../b",
    "/abs/path",
    "/",
    "//",
    "x\\..\\y",
    "..\\..\\windows",
    "C:\\windows",
    "dir/sub",
    "dir//sub",
    "dir/./sub",
    "dir/sub/",
    "name with spaces",
    " padded ",
    "模型/ünïcödé-🚀",
    "\u202eright-to-left",
    "a" * 200,
    "d/" * 100,
    "%2e%2e%2f",
    "*",
    "?",
    "~",
    "~/x",
    "key:with:colons",
    "{slot}",
    "$(touch pwned)",
    "-rf",
)

# Names a traversal or a normalisation of the hostile names could land on.
TARGET_MODEL_NAMES: tuple[str, ...] = (
    "etc",
    "etc/passwd",
    "passwd",
    "b",
    "abs",
    "abs/path",
    "path",
    "x",
    "y",
    "windows",
    "a",
    "dir",
    "sub",
    "pwned",
)

HOSTILE_TAGS: tuple[tuple[tuple[str, str], ...], ...] = (
    (("..", "../../etc"),),
    (("/abs", "x"),),
    (("a b", "c d"),),
    (("k", "v"),),
    (("k", "v%w"),),
    (("k", "v"), ("k2", "v2")),
    (("k2", "v2"), ("k", "v")),
    (("k", "../" * 10),),
    (("\\", "\\..\\"),),
    (("ünï", "🚀"),),
    (("lora", "x" * 200),),
)


def _show(key: CacheKey) -> str:
    text = repr(key.to_string())
    return text if len(text) <= 100 else f"{text[:60]}...{text[-30:]}"


def _whose(got: MemoryObj, stored: dict[CacheKey, MemoryObj]) -> str:
    """Which stored key's object ``got`` is, for the message."""
    for key, obj in stored.items():
        if difference(obj, got) is None:
            return f"the object put under {_show(key)}"
    return "an object that matches nothing put in this test"


def _call(run: Run, what: str, coroutine: Any) -> Any:
    try:
        return run(coroutine)
    except ContractTimeout:
        raise
    except Exception as error:
        violated(12, f"{what} raised {type(error).__name__}: {error}")


def _expect_absent(
    run: Run,
    backend: Backend,
    keys: Sequence[CacheKey],
    stored: dict[CacheKey, MemoryObj],
    when: str,
) -> None:
    """Each of ``keys`` (never written) misses and is not contained."""
    for key in keys:
        got = _call(run, f"get of {_show(key)}", backend.get(key))
        if got is not None:
            source = _whose(got, stored)
            got.release()
            violated(
                12,
                f"{_show(key)} was never written, but {when} get returned {source}: a key "
                "escaped its namespace",
            )
        if _call(run, f"contains of {_show(key)}", backend.contains(key)):
            violated(
                12,
                f"{_show(key)} was never written, but {when} contains is True: a key escaped "
                "its namespace",
            )


def _expect_own(run: Run, backend: Backend, stored: dict[CacheKey, MemoryObj], when: str) -> None:
    """Each stored key reads back its own object, not another key's."""
    for key, obj in stored.items():
        got = _call(run, f"get of {_show(key)}", backend.get(key))
        try:
            if got is None:
                violated(12, f"{when}, get of {_show(key)} missed; expected its own object")
            if difference(obj, got) is not None:
                violated(
                    12,
                    f"{when}, get of {_show(key)} returned {_whose(got, stored)}, not its own",
                )
        finally:
            release_all([got])
        if not _call(run, f"contains of {_show(key)}", backend.contains(key)):
            violated(12, f"{when}, contains of {_show(key)} is False after its put")


def _put_all(run: Run, backend: Backend, stored: dict[CacheKey, MemoryObj]) -> None:
    for key, obj in stored.items():
        _call(run, f"put of {_show(key)}", backend.put(key, obj))


async def _listed(backend: Backend) -> list[CacheKey]:
    return [key async for key in backend.list_keys()]


def _check_listing(run: Run, backend: Backend, expected: set[CacheKey]) -> None:
    """list_keys, filtered to the models and chunk hashes of ``expected``, is exactly it."""
    if not backend.capabilities.list:
        return
    models = {key.model_name for key in expected}
    hashes = {key.chunk_hash_hex for key in expected}
    listed = [
        key
        for key in _call(run, "list_keys", _listed(backend))
        if key.model_name in models and key.chunk_hash_hex in hashes
    ]
    unexpected = sorted(_show(k) for k in set(listed) - expected)
    missing = sorted(_show(k) for k in expected - set(listed))
    if unexpected or missing:
        violated(
            12,
            f"list_keys of the {len(expected)} keys stored here: {len(missing)} missing "
            f"({', '.join(missing[:3])}), {len(unexpected)} unexpected "
            f"({', '.join(unexpected[:3])})",
        )
    if len(listed) != len(set(listed)):
        violated(12, f"list_keys returned {len(listed)} keys, {len(set(listed))} distinct")


def _require_retention(
    run: Run, backend: Backend, keyspace: Keyspace, allocator: FreeListAllocator
) -> None:
    """Not applicable when the backend keeps nothing (there is nothing to isolate)."""
    key = keyspace.key(999_999)
    obj = make_obj(allocator, SHAPE, torch.float16, seed=500)
    try:
        run(backend.put(key, obj))
        got = run(backend.get(key))
        if got is None:
            not_applicable("a plain put then get misses: the backend keeps nothing (clause 2)")
        try:
            check_same(2, obj, got, "round trip of a plain key")
        finally:
            got.release()
    finally:
        obj.release()


def _unique_hash(keyspace: Keyspace) -> int:
    return int(hashlib.sha1(keyspace.model.encode()).hexdigest()[:15], 16)


class IsolationContract:
    """Clause 12: keys are isolated per model name, worker, world size, chunk hash, dtype and
    tags; no key content escapes into paths or other key spaces."""

    @clause(12)
    def test_one_chunk_hash_in_other_namespaces_is_another_key(
        self, backend: Backend, run: Run, keyspace: Keyspace, allocator: FreeListAllocator
    ) -> None:
        _require_retention(run, backend, keyspace, allocator)
        model = keyspace.model
        base = CacheKey(model, 1, 0, 7)
        variants = [
            CacheKey(f"{model}-other", 1, 0, 7),
            CacheKey(f"{model}/sub", 1, 0, 7),
            CacheKey(f"{model}/1/0", 1, 0, 7),
            CacheKey(model, 2, 0, 7),
            CacheKey(model, 2, 1, 7),
            CacheKey(model, 4, 3, 7),
            CacheKey(model, 1, 0, 7, "bfloat16"),
            CacheKey(model, 1, 0, 7, "fp8_e4m3fn"),
            CacheKey(model, 1, 0, b"\x07"),
            CacheKey(model, 1, 0, b"\x00\x07"),
            CacheKey(model, 1, 0, 7, tags=(("lora", "a"),)),
            CacheKey(model, 1, 0, 7, tags=(("lora", "b"),)),
            CacheKey(model, 1, 0, 7, tags=(("lora", "a"), ("rank", "1"))),
            CacheKey(model, 1, 0, 7, tags=(("rank", "1"), ("lora", "a"))),
            CacheKey(model, 1, 0, 70),
            CacheKey(model, 1, 0, -7),
        ]
        objs = {
            key: make_obj(allocator, SHAPE, torch.float16, seed=510 + n)
            for n, key in enumerate([base, *variants])
        }
        replacement = make_obj(allocator, SHAPE, torch.float16, seed=509)
        try:
            _put_all(run, backend, {base: objs[base]})
            _expect_absent(run, backend, variants, objs, f"after a put of only {_show(base)},")
            _put_all(run, backend, objs)
            _expect_own(run, backend, objs, "after a put under each namespace")
            _call(run, f"put of {_show(base)}", backend.put(base, replacement))
            _expect_own(
                run, backend, {**objs, base: replacement}, f"after overwriting {_show(base)}"
            )
            _check_listing(run, backend, set(objs))
            if backend.capabilities.delete:
                _call(run, f"remove of {_show(base)}", backend.remove(base))
                _expect_absent(run, backend, [base], {}, "after its remove")
                _expect_own(
                    run,
                    backend,
                    {k: v for k, v in objs.items() if k != base},
                    f"after removing {_show(base)}",
                )
        finally:
            release_all([*objs.values(), replacement])

    @clause(12)
    def test_hostile_model_names_and_tags_stay_in_their_own_key(
        self, backend: Backend, run: Run, keyspace: Keyspace, allocator: FreeListAllocator
    ) -> None:
        _require_retention(run, backend, keyspace, allocator)
        chunk = _unique_hash(keyspace)
        model = keyspace.model
        prefix_names = (
            f"{model}x",
            f"{model}/1/0",
            f"{model}/1/0/{chunk}",
            f"{model}_1_0_{chunk}",
            f"vllm/{model}",
        )
        hostile_names = (
            *HOSTILE_MODEL_NAMES,
            *(f"{model}/{name}" for name in HOSTILE_MODEL_NAMES),
            *prefix_names,
        )
        hostile = [CacheKey(name, 1, 0, chunk) for name in hostile_names]
        hostile += [CacheKey(model, 1, 0, chunk, tags=tags) for tags in HOSTILE_TAGS]
        targets = [CacheKey(name, 1, 0, chunk) for name in TARGET_MODEL_NAMES]
        targets += [CacheKey(f"{model}/{name}", 1, 0, chunk) for name in TARGET_MODEL_NAMES]
        targets.append(CacheKey(model, 1, 0, chunk))
        objs = {
            key: make_obj(allocator, SHAPE, torch.float16, seed=600 + n)
            for n, key in enumerate(hostile)
        }
        target_objs = {
            key: make_obj(allocator, SHAPE, torch.float16, seed=900 + n)
            for n, key in enumerate(targets)
        }
        try:
            _expect_absent(run, backend, targets, {}, "before any put,")
            _put_all(run, backend, objs)
            _expect_absent(run, backend, targets, objs, "after puts under hostile names,")
            _expect_own(run, backend, objs, "after puts under hostile names")
            _put_all(run, backend, target_objs)
            everything = {**objs, **target_objs}
            _expect_own(run, backend, everything, "after puts under hostile and plain names")
            _check_listing(run, backend, set(everything))
        finally:
            release_all([*objs.values(), *target_objs.values()])


__all__ = ["IsolationContract"]
