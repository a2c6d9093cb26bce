"""What is particular to acme://; the contract itself is checked by kvplug-contracts."""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import kvplug
from kvplug import (
    BackendTimeout,
    BackendUnavailable,
    CacheKey,
    InvalidBackendURL,
    MemoryObj,
    UnknownOption,
)
from kvplug_acme import AcmeBackend

KEY = CacheKey("llama", 1, 0, 42)


def _ones(n: int = 16) -> MemoryObj:
    return MemoryObj.from_tensor(torch.ones(n, dtype=torch.float16))


@pytest.mark.parametrize(
    "url",
    ["acme://", "acme://db.sqlite", "acme://host/tmp/db.sqlite", "acme:///tmp/dir/"],
    ids=["no-path", "relative-as-host", "host", "directory"],
)
def test_a_url_without_an_absolute_file_path_is_rejected_with_the_fix(url: str) -> None:
    with pytest.raises(InvalidBackendURL, match=r"acme:///var/cache/kv\.sqlite"):
        kvplug.create_backend(url)


def test_the_scheme_resolves_through_the_entry_point(tmp_path: Path) -> None:
    backend = kvplug.create_backend(f"acme://{tmp_path}/kv.sqlite?busy_timeout=0.5")
    assert isinstance(backend, AcmeBackend)
    assert backend.options.busy_timeout == 0.5


def test_an_unknown_option_is_rejected_with_a_did_you_mean(tmp_path: Path) -> None:
    with pytest.raises(UnknownOption, match="Did you mean 'busy_timeout'"):
        kvplug.create_backend(f"acme://{tmp_path}/kv.sqlite?busy_timout=1")


def test_a_missing_directory_fails_at_open_not_at_first_use(tmp_path: Path) -> None:
    with pytest.raises(BackendUnavailable, match="writable database"):
        asyncio.run(kvplug.open_backend(f"acme://{tmp_path}/absent/kv.sqlite"))


def test_data_written_by_another_process_is_read_here_while_open(tmp_path: Path) -> None:
    url = f"acme://{tmp_path}/kv.sqlite"
    writer = textwrap.dedent(
        f"""
        import asyncio, torch, kvplug

        async def main():
            backend = await kvplug.open_backend({url!r})
            key = kvplug.CacheKey("llama", 1, 0, 42)
            tensor = torch.arange(64, dtype=torch.float32).reshape(2, 32)
            await backend.put(key, kvplug.MemoryObj.from_tensor(tensor))
            await backend.close()

        asyncio.run(main())
        """
    )

    async def main() -> None:
        reader = await kvplug.open_backend(url)
        try:
            assert await reader.get(KEY) is None
            subprocess.run([sys.executable, "-c", writer], check=True, timeout=120)
            hit = await reader.get(KEY)
            assert hit is not None
            try:
                expected = torch.arange(64, dtype=torch.float32).reshape(2, 32)
                assert hit.dtype == torch.float32
                assert torch.equal(hit.tensor, expected)
            finally:
                hit.release()
        finally:
            await reader.close()

    asyncio.run(main())


def test_list_keys_lists_only_its_own_prefix_and_skips_foreign_rows(tmp_path: Path) -> None:
    path = tmp_path / "kv.sqlite"

    async def main() -> tuple[set[CacheKey], set[CacheKey]]:
        tenant_a = await kvplug.open_backend(f"acme://{path}?key_prefix=a/")
        tenant_b = await kvplug.open_backend(f"acme://{path}", key_prefix="b/")
        try:
            await tenant_a.batched_put([KEY, KEY.with_hash(1)], [_ones(), _ones()])
            await tenant_b.put(KEY.with_hash(2), _ones())
            assert not await tenant_b.contains(KEY)
            return (
                {k async for k in tenant_a.list_keys()},
                {k async for k in tenant_b.list_keys()},
            )
        finally:
            await tenant_a.close()
            await tenant_b.close()

    with sqlite3.connect(path) as db:  # a row another tool wrote into the same table
        db.execute("CREATE TABLE kv (key TEXT PRIMARY KEY, value BLOB NOT NULL)")
        db.execute("INSERT INTO kv VALUES ('a/not-a-cache-key', x'00')")
    db.close()
    listed_a, listed_b = asyncio.run(main())
    assert listed_a == {KEY, KEY.with_hash(1)}
    assert listed_b == {KEY.with_hash(2)}


def test_a_write_lock_held_too_long_raises_backend_timeout(tmp_path: Path) -> None:
    async def main() -> None:
        backend = await kvplug.open_backend(f"acme://{tmp_path}/kv.sqlite?busy_timeout=0.1")
        blocker = sqlite3.connect(tmp_path / "kv.sqlite", isolation_level=None)
        try:
            blocker.execute("BEGIN IMMEDIATE")  # another writer holds the lock
            with pytest.raises(BackendTimeout, match="write lock"):
                await backend.put(KEY, _ones())
            assert await backend.get(KEY) is None  # reads keep working under WAL
        finally:
            blocker.close()
            await backend.close()

    asyncio.run(main())


def test_close_is_idempotent_and_later_operations_raise_backend_closed(tmp_path: Path) -> None:
    async def main() -> None:
        backend = await kvplug.open_backend(f"acme://{tmp_path}/kv.sqlite")
        await backend.close()
        await backend.close()
        with pytest.raises(kvplug.BackendClosed):
            await backend.contains(KEY)
        with pytest.raises(kvplug.BackendClosed):
            backend.list_keys()

    asyncio.run(main())


def test_batched_exists_asks_in_a_few_queries_with_duplicates_in_place(tmp_path: Path) -> None:
    """1,200 keys (three queries' worth) in one call: the stored ones, every third, answered in
    place, a key asked twice answered twice; SQLite sees one SELECT per 500 distinct keys."""
    keys = [KEY.with_hash(n) for n in range(1200)]

    async def scenario() -> tuple[list[bool], list[str]]:
        backend = await kvplug.open_backend(f"acme://{tmp_path}/kv.sqlite")
        assert isinstance(backend, AcmeBackend)
        try:
            obj = _ones()
            await backend.batched_put(keys[::3], [obj] * len(keys[::3]))
            obj.release()
            statements: list[str] = []
            db = backend._db
            assert db is not None
            db.set_trace_callback(statements.append)
            found = await backend.batched_exists([*keys, keys[0], keys[1]])
            db.set_trace_callback(None)
            return found, statements
        finally:
            await backend.close()

    found, statements = asyncio.run(scenario())
    assert found == [n % 3 == 0 for n in range(1200)] + [True, False]
    assert len([s for s in statements if s.startswith("SELECT key FROM kv WHERE key IN")]) == 3
