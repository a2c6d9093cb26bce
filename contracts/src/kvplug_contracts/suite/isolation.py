"""Clause 12: keys are isolated per namespace; no key escapes into another key space."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from kvplug import Backend, CacheKey, FreeListAllocator, KvplugError, MemoryObj
from kvplug.backend import StoredFiles
from kvplug.url import BackendURL, split_chain
from kvplug_contracts.support import (
    ContractTimeout,
    Keyspace,
    Run,
    check_same,
    clause,
    difference,
    innermost,
    layers,
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


def _call(run: Run, what: str, coroutine: Any, number: int = 12) -> Any:
    try:
        return run(coroutine)
    except ContractTimeout:
        raise
    except Exception as error:
        violated(number, f"{what} raised {type(error).__name__}: {error}")


def _expect_absent(
    run: Run,
    backend: Backend,
    keys: Sequence[CacheKey],
    stored: dict[CacheKey, MemoryObj],
    when: str,
    number: int = 12,
) -> None:
    """Each of ``keys`` (never written) misses and is not contained."""
    for key in keys:
        got = _call(run, f"get of {_show(key)}", backend.get(key), number)
        if got is not None:
            source = _whose(got, stored)
            got.release()
            violated(
                number,
                f"{_show(key)} was never written, but {when} get returned {source}: a key "
                "escaped its namespace",
            )
        if _call(run, f"contains of {_show(key)}", backend.contains(key), number):
            violated(
                number,
                f"{_show(key)} was never written, but {when} contains is True: a key escaped "
                "its namespace",
            )


def _expect_own(
    run: Run,
    backend: Backend,
    stored: dict[CacheKey, MemoryObj],
    when: str,
    number: int = 12,
) -> None:
    """Each stored key reads back its own object, not another key's."""
    for key, obj in stored.items():
        got = _call(run, f"get of {_show(key)}", backend.get(key), number)
        try:
            if got is None:
                violated(number, f"{when}, get of {_show(key)} missed; expected its own object")
            if difference(obj, got) is not None:
                violated(
                    number,
                    f"{when}, get of {_show(key)} returned {_whose(got, stored)}, not its own",
                )
        finally:
            release_all([got])
        if not _call(run, f"contains of {_show(key)}", backend.contains(key), number):
            violated(number, f"{when}, contains of {_show(key)} is False after its put")


def _put_all(
    run: Run, backend: Backend, stored: dict[CacheKey, MemoryObj], number: int = 12
) -> None:
    for key, obj in stored.items():
        _call(run, f"put of {_show(key)}", backend.put(key, obj), number)


async def _listed(backend: Backend) -> list[CacheKey]:
    return [key async for key in backend.list_keys()]


def _check_listing(run: Run, backend: Backend, expected: set[CacheKey], number: int = 12) -> None:
    """list_keys, filtered to the models and chunk hashes of ``expected``, is exactly it."""
    if not backend.capabilities.list_keys:
        return
    models = {key.model_name for key in expected}
    hashes = {key.chunk_hash_hex for key in expected}
    listed = [
        key
        for key in _call(run, "list_keys", _listed(backend), number)
        if key.model_name in models and key.chunk_hash_hex in hashes
    ]
    unexpected = sorted(_show(k) for k in set(listed) - expected)
    missing = sorted(_show(k) for k in expected - set(listed))
    if unexpected or missing:
        violated(
            number,
            f"list_keys of the {len(expected)} keys stored here: {len(missing)} missing "
            f"({', '.join(missing[:3])}), {len(unexpected)} unexpected "
            f"({', '.join(unexpected[:3])})",
        )
    if len(listed) != len(set(listed)):
        violated(number, f"list_keys returned {len(listed)} keys, {len(set(listed))} distinct")


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


# A traversal climbs at most one directory per ".." in the key's text: a sandbox root this many
# directories below the sandbox's top keeps every such escape inside the top, where it is seen.
SANDBOX_DEPTH = 2 + max(
    text.count("..")
    for text in (
        *HOSTILE_MODEL_NAMES,
        *(part for tags in HOSTILE_TAGS for tag in tags for part in tag),
    )
)


class Sandbox:
    """A fresh directory tree the suite owns, for checking that a file-backed store keeps every
    file under its root whatever the key: the store is opened on ``top/d/.../d/root``, and any
    file or directory that appears in ``top`` outside the root escaped.

    It is used for backends that keep keys in local files (:class:`~kvplug.backend.StoredFiles`)
    and for URLs whose path names a local directory; the URL's path is pointed at the root."""

    def __init__(self, url: str, top: Path) -> None:
        self.top = top
        self.root = top.joinpath(*["d"] * SANDBOX_DEPTH, "root")
        self.root.mkdir(parents=True)
        *wrappers, inner = split_chain(url)
        rooted = replace(BackendURL.parse(inner), path=str(self.root))
        self.url = "::".join([*wrappers, rooted.secret_url()])
        self._outside = _outside_entries()

    @classmethod
    def for_backend(
        cls, backend: Backend, url: str, factory: pytest.TempPathFactory
    ) -> Sandbox | None:
        """A sandbox for ``backend`` opened from ``url``, or None when it keeps no local files."""
        path = BackendURL.parse(split_chain(url)[-1]).path
        files = any(isinstance(layer, StoredFiles) for layer in layers(backend))
        if not files and not (Path(path).is_absolute() and Path(path).is_dir()):
            return None
        return cls(url, factory.mktemp("kvplug-sandbox"))

    def open(self, open_backend: Callable[..., Backend]) -> Backend:
        """The backend under test, opened on the sandbox's root."""
        try:
            return open_backend(self.url)
        except KvplugError as error:
            not_applicable(
                f"the backend keeps local files, but the suite cannot open it on a sandbox "
                f"directory of its own (the URL's path set to {self.root}): {error}"
            )

    def check_containment(self) -> None:
        """Fail unless every file and directory in the sandbox is the root, above it or in it."""
        escaped = sorted(
            str(path.relative_to(self.top))
            for path in self.top.rglob("*")
            if path != self.root and path not in self.root.parents and self.root not in path.parents
        )
        escaped += sorted(f"/{name}" for name in _outside_entries() - self._outside)
        if escaped:
            shown = ", ".join(repr(name) for name in escaped[:3])
            violated(
                12,
                f"the backend, opened on {self.root}, wrote {len(escaped)} file(s) or "
                f"directories outside its root ({shown}{', ...' if len(escaped) > 3 else ''}): "
                "key content escaped into paths",
            )


def _outside_entries() -> set[str]:
    """Entries of ``/`` that a key joined to a root as an absolute path would create: those
    named like a key string (``...@...``) or like the first part of an absolute hostile name."""
    suspicious = {name.strip("/").split("/")[0] for name in HOSTILE_MODEL_NAMES if name[:1] == "/"}
    try:
        names = {entry.name for entry in Path("/").iterdir()}
    except OSError:
        return set()
    return {name for name in names if "@" in name or name in suspicious}


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
            if backend.capabilities.remove:
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
    def test_keys_that_differ_in_one_field_or_above_bit_63_of_the_hash_are_distinct(
        self, backend: Backend, run: Run, keyspace: Keyspace, allocator: FreeListAllocator
    ) -> None:
        _require_retention(run, backend, keyspace, allocator)
        model = keyspace.model
        high = (1 << 127) | (_unique_hash(keyspace) << 40) | 0x5EED
        digest = hashlib.sha256(model.encode()).digest()
        base = CacheKey(model, 2, 1, high, "bfloat16", tags=(("lora", "a"),))
        variants = [
            replace(base, chunk_hash=high + (1 << 100)),
            replace(base, chunk_hash=high ^ (1 << 64)),
            replace(base, chunk_hash=high & ((1 << 64) - 1)),
            replace(base, chunk_hash=high >> 64),
            replace(base, chunk_hash=-high),
            replace(base, chunk_hash=digest),
            replace(base, chunk_hash=bytes([digest[0] ^ 0x80]) + digest[1:]),
            replace(base, chunk_hash=digest[:-1] + bytes([digest[-1] ^ 0x01])),
            replace(base, model_name=f"{model}-b"),
            replace(base, world_size=3),
            replace(base, worker_id=0),
            replace(base, dtype="half"),
            replace(base, tags=()),
            replace(base, tags=(("lora", "b"),)),
            replace(base, tags=(("lorb", "a"),)),
            replace(base, tags=(("lora", "a"), ("rank", "1"))),
        ]
        objs = {
            key: make_obj(allocator, SHAPE, torch.float16, seed=700 + n)
            for n, key in enumerate([base, *variants])
        }
        try:
            _put_all(run, backend, {base: objs[base]})
            _expect_absent(run, backend, variants, objs, f"after a put of only {_show(base)},")
            _put_all(run, backend, objs)
            _expect_own(run, backend, objs, "after a put of each key")
            _check_listing(run, backend, set(objs))
        finally:
            release_all(list(objs.values()))

    @clause(12)
    def test_backends_with_different_key_prefixes_do_not_see_each_others_keys(
        self,
        backend: Backend,
        open_contract_backend: Callable[..., Backend],
        run: Run,
        keyspace: Keyspace,
        allocator: FreeListAllocator,
    ) -> None:
        inner = innermost(backend)
        if "key_prefix" not in type(inner).Options.model_fields:
            not_applicable("the backend has no key_prefix option to namespace its keys")
        _require_retention(run, backend, keyspace, allocator)
        prefix = str(getattr(inner.options, "key_prefix", ""))
        names = (f"{prefix}kvplug-contract-a/", f"{prefix}kvplug-contract-b/")
        first, second = (open_contract_backend(key_prefix=name) for name in names)
        shared, only_first = keyspace.key(1), keyspace.key(2)
        objs = [make_obj(allocator, SHAPE, torch.float16, seed=800 + n) for n in range(3)]
        try:
            _call(run, "put", first.put(shared, objs[0]))
            _call(run, "put", first.put(only_first, objs[1]))
            for key in (shared, only_first):
                seen = []
                if _call(run, "contains", second.contains(key)):
                    seen.append("contains is True")
                got = _call(run, "get", second.get(key))
                if got is not None:
                    got.release()
                    seen.append("get hits")
                if _call(run, "batched_contains", second.batched_contains([key])):
                    seen.append("batched_contains counts it")
                if seen:
                    violated(
                        12,
                        f"{_show(key)} was put only through key_prefix {names[0]!r}, but through "
                        f"key_prefix {names[1]!r} {' and '.join(seen)}: the prefixes do not "
                        "isolate",
                    )
            _call(run, "put", second.put(shared, objs[2]))
            _expect_own(run, first, {shared: objs[0], only_first: objs[1]}, "through prefix a")
            _expect_own(run, second, {shared: objs[2]}, "through prefix b")
        finally:
            release_all(objs)

    @clause(12)
    def test_hostile_model_names_and_tags_stay_in_their_own_key(
        self,
        backend: Backend,
        open_contract_backend: Callable[..., Backend],
        kvplug_url: str,
        tmp_path_factory: pytest.TempPathFactory,
        run: Run,
        keyspace: Keyspace,
        allocator: FreeListAllocator,
    ) -> None:
        sandbox = Sandbox.for_backend(backend, kvplug_url, tmp_path_factory)
        if sandbox is None:
            _check_hostile_keys(run, backend, keyspace, allocator)
            return
        sandboxed = sandbox.open(open_contract_backend)
        try:
            _check_hostile_keys(run, sandboxed, keyspace, allocator)
        finally:
            # Whatever the checks found, what matters most is whether a file escaped.
            run(sandboxed.close())
            sandbox.check_containment()


def _check_hostile_keys(
    run: Run, backend: Backend, keyspace: Keyspace, allocator: FreeListAllocator
) -> None:
    """Keys under hostile model names and tags read back their own objects, and never land
    on the keys a traversal or normalisation of them would reach."""
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
