"""file:// and gds:// under failure, checked on real files, mounts and processes: anything that
is not a regular file where an object or a subdirectory should be (directories, symbolic links,
FIFOs, sockets, device nodes), directories that refuse writes (a read-only mount, an immutable
directory, permission bits for a user other than root), files that cannot be deleted, and
temporary files of writers that died, whose pid a live process now has.

gds:// runs here with ``gds_standin.PosixStandIn`` moving the payloads (no GPU): the file
layout, index, eviction, temporary files and error handling are the one engine file:// uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from disk_helpers import (
    SCHEMES,
    key,
    leak_checked_allocator,
    object_files,
    open_tier,
    put_seeded,
    read_back,
    run,
    seeded_bytes,
)

import kvplug
from kvplug import CacheKey, CapacityExceeded, FreeListAllocator
from kvplug.errors import BackendError, BackendUnavailable, KvplugError
from kvplug.runtime.store import Store
from kvplug_disk.backend import DiskBackend, WriteRefused
from kvplug_disk.fileops import classify_os_error, open_object_sized
from kvplug_disk.gds import backend as gds_module
from kvplug_disk.layout import (
    BLOCK,
    TEMP_NAME,
    WRITER_LOCK_NAME,
    file_length,
    object_name,
)

KiB = 1024
MiB = 1024 * KiB
IS_ROOT = os.geteuid() == 0
DEADLINE = 120.0
CHILD_ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(
        p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")) if p
    ),
}
"""For child processes: gds:// ones import the stand-in from this folder."""
"""Seconds a subprocess may take before the test calls it hung (never reached when it works)."""


def subdir_of(k: CacheKey) -> str:
    return object_name(k.to_string())[0]


def temp_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if TEMP_NAME.fullmatch(p.name))


def writer_locks(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if WRITER_LOCK_NAME.fullmatch(p.name))


allocator = pytest.fixture(leak_checked_allocator, name="allocator")


def keys_outside(subdir: str, count: int, start: int = 1000) -> list[CacheKey]:
    """``count`` keys whose files live in another subdirectory than ``subdir``."""
    found: list[CacheKey] = []
    n = start
    while len(found) < count:
        if subdir_of(key(n)) != subdir:
            found.append(key(n))
        n += 1
    return found


# -- foreign file types ------------------------------------------------------------------------


def _bind_socket(path: Path) -> socket.socket:
    """A listening UNIX socket at ``path`` (bound in a short directory, then moved: a socket
    path may be at most 107 bytes)."""
    short = Path(tempfile.mkdtemp(prefix="kvs"))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(short / "s"))
    (short / "s").rename(path)
    short.rmdir()
    return sock


class Foreign:
    """Puts something that is not a regular file at a path, and undoes what could hang."""

    KINDS = (
        "directory",
        "directory with files",
        "symlink to a copy",
        "dangling symlink",
        "fifo",
        "socket",
        "character device",
    )

    def __init__(self, kind: str, path: Path) -> None:
        self.kind = kind
        self.path = path
        self.outside = path.parent.parent.parent / f"outside-{os.getpid()}"
        self._socket: socket.socket | None = None

    def plant(self) -> None:
        original = self.path.read_bytes() if self.path.is_file() else b"x" * BLOCK
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        if self.kind == "directory":
            self.path.mkdir()
        elif self.kind == "directory with files":
            self.path.mkdir()
            (self.path / "notes.txt").write_bytes(b"not kvplug's")
        elif self.kind == "symlink to a copy":
            self.outside.write_bytes(original)  # a valid object file, outside the tier
            self.path.symlink_to(self.outside)
        elif self.kind == "dangling symlink":
            self.path.symlink_to(self.outside.with_name("nowhere"))
        elif self.kind == "fifo":
            os.mkfifo(self.path, 0o600)
        elif self.kind == "socket":
            self._socket = _bind_socket(self.path)
        elif self.kind == "character device":
            if not IS_ROOT:
                pytest.skip("making a device node needs root")
            try:
                os.mknod(self.path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's
            except PermissionError as error:
                pytest.skip(f"this machine refuses mknod ({error}); no device node to test")
        else:  # pragma: no cover
            raise AssertionError(self.kind)

    def unblock(self) -> None:
        """Release a thread that the unfixed code parked in open() on the FIFO."""
        if self.kind == "fifo":
            with contextlib.suppress(OSError):
                os.close(os.open(self.path, os.O_WRONLY | os.O_NONBLOCK))
        if self._socket is not None:
            self._socket.close()


@pytest.mark.parametrize("kind", Foreign.KINDS)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_one_key_whose_file_is_not_a_regular_file_is_a_miss_and_the_tier_keeps_serving(
    tmp_path: Path, allocator: FreeListAllocator, scheme: str, kind: str
) -> None:
    """Through a Store: the key reads as a counted miss and leaves the index, every other key
    keeps being served, the tier stays healthy, and a put of the key stores it again."""
    root = tmp_path / "kv"
    good = [key(i) for i in range(8)]
    victim = key(100)

    async def scenario() -> None:
        tier = await open_tier(scheme, root, allocator, timeout=20)
        store = Store(tiers=[tier], allocator=allocator)
        foreign: Foreign | None = None
        try:
            for i, k in enumerate([*good, victim]):
                await put_seeded(store, allocator, k, 9000, seed=i)
            await store.flush()
            path = Path(tier.stored_files(victim)[0])
            foreign = Foreign(kind, path)
            foreign.plant()
            for _ in range(3):
                assert await read_back(store, victim) is None
                for i, k in enumerate(good):
                    back = await read_back(store, k)
                    assert back is not None, f"good key {i} was not served"
                    assert torch.equal(back, seeded_bytes(9000, i))
            assert not await tier.contains(victim)
            assert await store.lookup([*good, victim]) == len(good)
            health = store.health()[0]
            assert health.healthy and health.last_error is None, health.last_error
            stats = tier.stats()
            assert stats["foreign_files"] == 1 and stats["keys"] == len(good)
            if kind == "symlink to a copy":
                before = foreign.outside.read_bytes()
            await put_seeded(store, allocator, victim, 5000, seed=77)
            assert store.health()[0].healthy, store.health()[0].last_error
            back = await read_back(store, victim)
            assert back is not None and torch.equal(back, seeded_bytes(5000, 77))
            assert stat.S_ISREG(path.lstat().st_mode)
            if kind == "symlink to a copy":
                assert foreign.outside.read_bytes() == before  # never written through
            if kind == "directory with files":  # moved aside, never deleted
                kept = [p for p in root.rglob("notes.txt")]
                assert len(kept) == 1 and kept[0].read_bytes() == b"not kvplug's"
        finally:
            if foreign is not None:
                foreign.unblock()
            await store.close()

    run(scenario())


FIFO_GETS = """
import asyncio, os, sys, torch, kvplug
from kvplug import CacheKey, FreeListAllocator, MemoryFormat

async def main(scheme, root):
    allocator = FreeListAllocator(16 << 20, pin=False)
    options = {"workers": 2, "timeout": 5}
    if scheme == "gds":
        from gds_standin import PosixStandIn
        options["file_io"] = PosixStandIn()
    tier = await kvplug.open_backend(f"{scheme}://{root}", allocator=allocator, **options)
    keys = [CacheKey("fifo", 1, 0, n) for n in range(8)]
    for n, key in enumerate(keys):
        obj = allocator.allocate((5000,), torch.uint8, MemoryFormat.BINARY_BUFFER)
        obj.raw.fill_(n)
        await tier.put(key, obj)
        obj.release()
    for key in keys[:5]:  # more FIFOs than workers
        path = tier.stored_files(key)[0]
        os.unlink(path)
        os.mkfifo(path, 0o600)
    for key in keys[:5]:
        assert await tier.get(key) is None
    for n, key in enumerate(keys[5:], 5):
        hit = await tier.get(key)
        assert hit is not None and int(hit.raw[0]) == n
        hit.release()
    print(tier.stats()["foreign_files"], flush=True)
    await tier.close()

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


@pytest.mark.parametrize("scheme", SCHEMES)
def test_fifos_in_place_of_objects_never_park_a_worker_and_the_process_exits(
    tmp_path: Path, scheme: str
) -> None:
    """More FIFOs than workers: every get returns (a miss), good keys are served, and the
    process exits, in a process of its own so that a parked worker shows as a hang."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", FIFO_GETS, scheme, str(tmp_path / "kv")],
            env=CHILD_ENV,
            capture_output=True,
            text=True,
            timeout=DEADLINE,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the process did not exit within {DEADLINE} s: a worker is parked")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "5"


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_index_rebuild_passes_over_foreign_file_types_under_every_name(
    tmp_path: Path, allocator: FreeListAllocator, scheme: str
) -> None:
    """FIFOs, sockets, symbolic links and directories named like objects, temporary files,
    writer locks and subdirectories: open counts them as foreign, never blocks on one and
    leaves them alone; keys whose subdirectory name is taken are stored in a real one."""
    root = tmp_path / "kv"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    fifo_dir, link_dir, file_dir = [n for n in ("ab", "cd", "ef", "a1") if n != subdir_of(key(1))][
        :3
    ]
    taken = [
        next(key(n) for n in range(100_000) if subdir_of(key(n)) == name)
        for name in (fifo_dir, link_dir, file_dir)
    ]

    async def fill() -> None:
        tier = await open_tier(scheme, root, allocator)
        await put_seeded(tier, allocator, key(1), 9000, seed=1)
        await tier.close()

    run(fill())
    sub = root / subdir_of(key(1))
    fifo_object = sub / ("0" * 32 + ".kv")
    os.mkfifo(fifo_object)
    (sub / ("1" * 32 + ".kv")).mkdir()
    (sub / ("2" * 32 + ".kv")).symlink_to(elsewhere)
    fifo_temp = sub / f".{'3' * 32}.{os.getpid()}.{'4' * 16}.tmp"
    os.mkfifo(fifo_temp)
    (sub / f".{'5' * 32}.{os.getpid()}.{'6' * 16}.tmp").mkdir()
    fifo_lock = root / f".kvplug-writer.{os.getpid()}.{'7' * 16}.lock"
    os.mkfifo(fifo_lock)
    os.mkfifo(root / fifo_dir)  # where a subdirectory should be
    (root / link_dir).symlink_to(elsewhere)  # a link to a directory outside the tier
    (root / file_dir).write_bytes(b"a file, not a directory")
    sock = _bind_socket(root / "README")
    planted = [fifo_object, fifo_temp, fifo_lock]

    async def reopen() -> None:
        tier = await open_tier(scheme, root, allocator)
        try:
            assert tier.rebuild_stats["objects"] == 1
            assert tier.rebuild_stats["foreign"] >= 9
            back = await read_back(tier, key(1))
            assert back is not None and torch.equal(back, seeded_bytes(9000, 1))
            for n, k in enumerate(taken):
                await put_seeded(tier, allocator, k, 3000, seed=50 + n)
            for n, k in enumerate(taken):
                back = await read_back(tier, k)
                assert back is not None and torch.equal(back, seeded_bytes(3000, 50 + n))
        finally:
            await tier.close()

    try:
        run(asyncio.wait_for(reopen(), DEADLINE))
    finally:
        for path in planted:
            with contextlib.suppress(OSError):
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        sock.close()
    assert list(elsewhere.iterdir()) == []  # nothing was written through the link
    names = (fifo_dir, link_dir, file_dir)
    for name in names:
        assert (root / name).is_dir() and not (root / name).is_symlink()
    assert all(stat.S_ISFIFO(p.lstat().st_mode) for p in planted)  # left alone
    moved = sorted(p.name for p in root.iterdir() if p.name[:2] in names)
    assert len(moved) == 6, moved  # the three intruders, moved aside next to the real ones


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_subdirectory_replaced_by_a_file_after_open_is_made_again_by_the_next_put(
    tmp_path: Path, allocator: FreeListAllocator, scheme: str
) -> None:
    """The tier knows the subdirectory from its own puts; something else takes its place: its
    keys read as misses, other keys are served, and a put makes the subdirectory again (the
    intruder moved aside)."""
    root = tmp_path / "kv"
    k = key(1)
    other = keys_outside(subdir_of(k), 1)[0]

    async def scenario() -> None:
        tier = await open_tier(scheme, root, allocator)
        try:
            await put_seeded(tier, allocator, k, 9000, seed=1)
            await put_seeded(tier, allocator, other, 9000, seed=2)
            sub = root / subdir_of(k)
            sub.rename(tmp_path / "away")
            sub.write_bytes(b"in the way")
            assert await read_back(tier, k) is None
            back = await read_back(tier, other)
            assert back is not None and torch.equal(back, seeded_bytes(9000, 2))
            await put_seeded(tier, allocator, k, 9000, seed=3)
            back = await read_back(tier, k)
            assert back is not None and torch.equal(back, seeded_bytes(9000, 3))
            assert sub.is_dir()
            (moved,) = [p for p in root.iterdir() if p.name.startswith(sub.name + ".moved")]
            assert moved.read_bytes() == b"in the way"
        finally:
            await tier.close()

    run(scenario())


# -- directories that refuse writes ------------------------------------------------------------


@contextlib.contextmanager
def tmpfs(where: Path) -> Iterator[Callable[[bool], None]]:
    """A small tmpfs mounted at ``where``; yields ``read_only(flag)`` to remount it."""
    if not IS_ROOT or shutil.which("mount") is None:
        pytest.skip("mounting a read-only filesystem needs root and mount(8)")
    where.mkdir(mode=0o700)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m,mode=700", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")

    def read_only(flag: bool) -> None:
        subprocess.run(
            ["mount", "-o", f"remount,{'ro' if flag else 'rw'}", str(where)],
            check=True,
            capture_output=True,
        )

    try:
        yield read_only
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False, capture_output=True)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_put_on_a_read_only_filesystem_is_a_refused_write_and_the_tier_keeps_serving(
    tmp_path: Path, allocator: FreeListAllocator, scheme: str
) -> None:
    """EROFS, for real: a put into a new subdirectory or an existing one raises WriteRefused
    naming the directory, the cause and the fix; a single-tier Store refuses the put (counted
    as dropped for being full) and keeps serving reads from the tier; once the filesystem is
    writable again puts work."""
    stored = key(1)
    new_subdir, same_subdir = keys_outside(subdir_of(stored), 1)[0], None
    for n in range(2, 100_000):
        if subdir_of(key(n)) == subdir_of(stored):
            same_subdir = key(n)
            break
    assert same_subdir is not None

    with tmpfs(tmp_path / "mnt") as read_only:
        root = tmp_path / "mnt" / "kv"

        async def scenario() -> None:
            tier = await open_tier(scheme, root, allocator)
            store = Store(tiers=[tier], allocator=allocator)
            try:
                await put_seeded(store, allocator, stored, 9000, seed=1)
                read_only(True)
                for k in (new_subdir, same_subdir):
                    with pytest.raises(WriteRefused) as refused:
                        await put_seeded(tier, allocator, k, 9000, seed=2)
                    message = str(refused.value)
                    assert str(root) in message and "EROFS" in message
                    assert "read-only" in message and "mount" in message
                    assert isinstance(refused.value, KvplugError)
                    assert not isinstance(refused.value, BackendUnavailable)
                with pytest.raises(CapacityExceeded, match="EROFS"):
                    await put_seeded(store, allocator, new_subdir, 9000, seed=2)
                dropped = store.stats()["tiers"][store.tier_names[0]]["dropped_by_reason"]
                assert dropped["full"] == 1
                assert store.health()[0].healthy, store.health()[0].last_error
                back = await read_back(store, stored)
                assert back is not None and torch.equal(back, seeded_bytes(9000, 1))
                assert temp_files(root) == []
                with pytest.raises(WriteRefused, match="EROFS"):
                    await tier.remove(stored)
                assert await tier.contains(stored)
                read_only(False)
                await put_seeded(store, allocator, new_subdir, 9000, seed=3)
                back = await read_back(store, new_subdir)
                assert back is not None and torch.equal(back, seeded_bytes(9000, 3))
            finally:
                read_only(False)
                await store.close()

        run(scenario())


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_really_full_filesystem_drops_puts_and_the_tier_keeps_serving(
    tmp_path: Path, allocator: FreeListAllocator, scheme: str
) -> None:
    """A 16 MiB tmpfs under a tier whose max_size is far larger: puts past the disk's room
    raise CapacityExceeded (the free-space check or ENOSPC itself), leave no temporary file,
    and a single-tier Store refuses them (counted as dropped for being full) while every stored
    key is still served."""
    with tmpfs(tmp_path / "mnt"):
        root = tmp_path / "mnt" / "kv"

        async def scenario() -> None:
            tier = await open_tier(scheme, root, allocator, max_size="1GiB")
            store = Store(tiers=[tier], allocator=allocator)
            try:
                stored: list[int] = []
                for n in range(24):
                    try:
                        await put_seeded(tier, allocator, key(n), 1 * MiB, seed=n)
                        stored.append(n)
                    except CapacityExceeded as error:
                        assert str(root) in str(error) and "free" in str(error).lower()
                        break
                else:
                    pytest.fail("24 MiB fit on a 16 MiB filesystem")
                assert stored and temp_files(root) == []
                name = store.tier_names[0]
                with pytest.raises(CapacityExceeded, match="free"):
                    await put_seeded(store, allocator, key(99), 1 * MiB, seed=99)
                assert store.stats()["tiers"][name]["dropped_by_reason"]["full"] == 1
                assert store.health()[0].healthy
                for n in stored:
                    back = await read_back(store, key(n))
                    assert back is not None and torch.equal(back, seeded_bytes(1 * MiB, n))
            finally:
                await store.close()

        run(scenario())


AS_ANOTHER_USER = """
import asyncio, json, os, sys, torch, kvplug
from kvplug import CacheKey, FreeListAllocator, MemoryFormat
from kvplug.errors import KvplugError
from kvplug_disk.layout import object_name

def failure(error):
    return [type(error).__name__, [c.__name__ for c in type(error).__mro__], str(error)]

async def main(scheme, root):
    allocator = FreeListAllocator(16 << 20, pin=False)
    options = {}
    if scheme == "gds":
        from gds_standin import PosixStandIn
        options["file_io"] = PosixStandIn()
    tier = await kvplug.open_backend(f"{scheme}://{root}", allocator=allocator, **options)
    keys = [CacheKey("perm", 1, 0, n) for n in range(64)]
    first = keys[0]
    subdir = lambda k: object_name(k.to_string())[0]
    other = next(k for k in keys if subdir(k) != subdir(first))
    obj = allocator.allocate((5000,), torch.uint8, MemoryFormat.BINARY_BUFFER)
    obj.raw.fill_(7)
    await tier.put(first, obj)
    sub = os.path.dirname(tier.stored_files(first)[0])
    os.chmod(root, 0o500)  # no new subdirectories
    os.chmod(sub, 0o500)   # no new files and no deletions in the first key's subdirectory
    report = {}
    for name, key in (("new_subdir", other), ("same_subdir", first)):
        try:
            await tier.put(key, obj)
            report[name] = "stored"
        except KvplugError as error:
            report[name] = failure(error)
    try:
        report["remove"] = await tier.remove(first)
    except KvplugError as error:
        report["remove"] = failure(error)
    report["contains_after"] = await tier.contains(first)
    hit = await tier.get(first)
    report["readable_after"] = hit is not None and int(hit.raw[0]) == 7
    if hit is not None:
        hit.release()
    os.chmod(root, 0o700)
    os.chmod(sub, 0o700)
    await tier.put(other, obj)
    report["after_fix"] = await tier.contains(other)
    report["removed_after_fix"] = await tier.remove(first)
    obj.release()
    await tier.close()
    print(json.dumps(report))

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


@pytest.mark.parametrize("scheme", SCHEMES)
def test_eacces_from_permission_bits_is_a_refused_write_for_put_and_remove(
    tmp_path: Path, scheme: str
) -> None:
    """EACCES, for real, as a user that permission bits bind (root ignores them): a process of
    user nobody owns the cache, then takes write permission away from it."""
    if not IS_ROOT or shutil.which("setpriv") is None:
        pytest.skip("running a process as another user needs root and setpriv(1)")
    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable]
    base = Path(tempfile.mkdtemp(prefix="kvplug-eacces-"))
    try:
        base.chmod(0o755)
        root = base / "kv"
        root.mkdir(mode=0o700)
        os.chown(root, 65534, 65534)
        probe = subprocess.run(
            [*as_nobody, "-c", "import kvplug_disk, kvplug_disk.gds"],
            capture_output=True,
            text=True,
            timeout=DEADLINE,
            cwd=base,
        )
        if probe.returncode:
            pytest.skip(f"python does not start as user nobody here: {probe.stderr[-300:]}")
        done = subprocess.run(
            [*as_nobody, "-c", AS_ANOTHER_USER, scheme, str(root)],
            env=CHILD_ENV,
            capture_output=True,
            text=True,
            timeout=DEADLINE,
            cwd=base,
        )
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        for name in ("new_subdir", "same_subdir", "remove"):
            kind, classes, message = report[name]
            assert kind == "WriteRefused", report[name]
            assert "CapacityExceeded" in classes and "BackendUnavailable" not in classes
            assert "EACCES" in message and str(root) in message, message
            assert "permission" in message.lower(), message
        assert report["contains_after"] is True and report["readable_after"] is True
        assert report["after_fix"] is True and report["removed_after_fix"] is True
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize(
    ("code", "expected", "words"),
    [
        (errno.ENOSPC, CapacityExceeded, "full"),
        (errno.EDQUOT, CapacityExceeded, "quota"),
        (errno.EFBIG, CapacityExceeded, "too large"),
        (errno.EROFS, WriteRefused, "read-only"),
        (errno.EACCES, WriteRefused, "permission"),
        (errno.EPERM, WriteRefused, "immutable"),
        (errno.EIO, BackendError, "I/O error"),
        (errno.EMFILE, BackendUnavailable, "open files"),
        (errno.ENOMEM, BackendUnavailable, "memory"),
        (errno.ENAMETOOLONG, BackendError, "ENAMETOOLONG"),
    ],
)
def test_every_os_error_on_the_write_path_is_a_kvplug_error_with_cause_and_fix(
    code: int, expected: type[BackendError], words: str
) -> None:
    error = classify_os_error(
        OSError(code, os.strerror(code)),
        "writing an object file of 8192 bytes",
        "/cache/kv/ab",
        "Nothing was stored.",
    )
    assert type(error) is expected
    message = str(error)
    assert errno.errorcode[code] in message and "/cache/kv/ab" in message
    assert words.lower() in message.lower(), message


@pytest.mark.parametrize("scheme", SCHEMES)
def test_an_io_error_from_the_disk_is_a_backend_error_and_leaves_nothing_behind(
    tmp_path: Path, allocator: FreeListAllocator, scheme: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EIO cannot be produced on a healthy disk, so the write call is made to fail."""

    async def scenario() -> None:
        tier = await open_tier(scheme, tmp_path / "kv", allocator)
        try:
            await put_seeded(tier, allocator, key(1), 9000, seed=1)

            def failing(fd: int, buffers: Any, offset: int) -> int:
                raise OSError(errno.EIO, os.strerror(errno.EIO))

            with monkeypatch.context() as patch:
                patch.setattr(os, "pwritev", failing)
                with pytest.raises(BackendError, match="EIO") as raised:
                    await put_seeded(tier, allocator, key(2), 9000, seed=2)
            assert not isinstance(raised.value, CapacityExceeded | BackendUnavailable)
            assert "dmesg" in str(raised.value)
            assert temp_files(tmp_path / "kv") == []
            assert not await tier.contains(key(2))
            await put_seeded(tier, allocator, key(2), 9000, seed=2)
            assert await tier.contains(key(2))
        finally:
            await tier.close()

    run(scenario())


# -- files that cannot be deleted --------------------------------------------------------------


@contextlib.contextmanager
def immutable(directory: Path) -> Iterator[None]:
    """``chattr +i`` on ``directory``: nothing in it can be created, renamed or deleted, not
    even by root (which ignores permission bits)."""
    if shutil.which("chattr") is None:
        pytest.skip("chattr(1) is not installed")
    made = subprocess.run(["chattr", "+i", str(directory)], capture_output=True, text=True)
    if made.returncode:
        pytest.skip(f"cannot make a directory immutable here: {made.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(directory)], check=True, capture_output=True)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_remove_of_a_file_that_cannot_be_deleted_raises_and_the_key_stays(
    tmp_path: Path, allocator: FreeListAllocator, scheme: str
) -> None:
    root = tmp_path / "kv"
    k = key(1)

    async def scenario() -> None:
        tier = await open_tier(scheme, root, allocator)
        try:
            await put_seeded(tier, allocator, k, 9000, seed=1)
            held = tier.bytes_held
            path = Path(tier.stored_files(k)[0])
            with immutable(path.parent):
                with pytest.raises(WriteRefused) as refused:
                    await tier.remove(k)
                message = str(refused.value)
                assert str(path) in message and "EPERM" in message, message
                assert await tier.contains(k) and tier.bytes_held == held
                back = await read_back(tier, k)
                assert back is not None and torch.equal(back, seeded_bytes(9000, 1))
            await tier.close()
            again = await open_tier(scheme, root, allocator)
            assert await again.contains(k)  # it was never reported gone
            assert await again.remove(k) is True
            assert not path.exists() and not await again.contains(k)
            assert await again.remove(k) is False
            await again.close()
            third = await open_tier(scheme, root, allocator)
            assert not await third.contains(k)
            await third.close()
        finally:
            await tier.close()

    run(scenario())


@pytest.mark.parametrize("scheme", SCHEMES)
def test_remove_tells_an_object_gone_from_one_removed(
    tmp_path: Path, allocator: FreeListAllocator, scheme: str
) -> None:
    """True only when this remove deleted the object: a file already gone, or a directory in
    its place, is False (and the directory stays)."""

    async def scenario() -> None:
        tier = await open_tier(scheme, tmp_path / "kv", allocator)
        try:
            for i in range(3):
                await put_seeded(tier, allocator, key(i), 5000, seed=i)
            gone = Path(tier.stored_files(key(0))[0])
            gone.unlink()
            assert await tier.remove(key(0)) is False
            replaced = Path(tier.stored_files(key(1))[0])
            replaced.unlink()
            replaced.mkdir()
            assert await tier.remove(key(1)) is False
            assert replaced.is_dir() and not await tier.contains(key(1))
            assert await tier.remove(key(2)) is True
            assert tier.bytes_held == 0 and tier.stats()["keys"] == 0
        finally:
            await tier.close()

    run(scenario())


@pytest.mark.parametrize("scheme", SCHEMES)
def test_eviction_that_cannot_delete_keeps_counting_the_bytes_and_reports_once(
    tmp_path: Path,
    allocator: FreeListAllocator,
    scheme: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The bytes of files eviction could not delete still count against max_size, so the
    files on disk never exceed it; the key stays readable; one warning, and a counter."""
    root = tmp_path / "kv"
    one = file_length(64 * KiB)
    stuck = key(1)
    others = keys_outside(subdir_of(stuck), 12)
    caplog.set_level(logging.WARNING)

    async def scenario() -> None:
        tier = await open_tier(scheme, root, allocator, max_size=4 * one, eviction="lru")
        try:
            await put_seeded(tier, allocator, stuck, 64 * KiB, seed=1)
            with immutable(root / subdir_of(stuck)):
                for n, k in enumerate(others):
                    await put_seeded(tier, allocator, k, 64 * KiB, seed=10 + n)
                    on_disk = sum(p.stat().st_size for p in object_files(root))
                    assert on_disk <= tier.max_size, f"{on_disk} bytes on disk after {n + 1}"
                    assert tier.bytes_held == on_disk
                assert await tier.contains(stuck)
                back = await read_back(tier, stuck)
                assert back is not None and torch.equal(back, seeded_bytes(64 * KiB, 1))
                assert tier.stats()["eviction_failures"] >= 1
            # Deletable again: later evictions take it (after the retry pause) or a remove does.
            assert await tier.remove(stuck) is True
            assert tier.bytes_held == sum(p.stat().st_size for p in object_files(root))
        finally:
            await tier.close()

    run(scenario())
    warnings = [r for r in caplog.records if "could not delete" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "max_size" in warnings[0].getMessage() and "EPERM" in warnings[0].getMessage()


# -- temporary files of writers that died ------------------------------------------------------

BIG_WRITER = """
import asyncio, sys, torch, kvplug
from kvplug import CacheKey, FreeListAllocator, MemoryFormat

async def main(scheme, root):
    allocator = FreeListAllocator(128 << 20, pin=False)
    options = {}
    if scheme == "gds":
        from gds_standin import PosixStandIn
        options["file_io"] = PosixStandIn()
    tier = await kvplug.open_backend(f"{scheme}://{root}", allocator=allocator, **options)
    obj = allocator.allocate((32 << 20,), torch.uint8, MemoryFormat.BINARY_BUFFER)
    obj.raw.fill_(3)
    print("ready", flush=True)
    n = 0
    while True:
        await tier.put(CacheKey("writer", 1, 0, n % 2), obj)
        n += 1

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def writer_caught_mid_write(scheme: str, root: Path) -> subprocess.Popen[str]:
    """A process writing 32 MiB objects in a loop, stopped (SIGSTOP) while a temporary file
    of its is on disk; the caller kills it."""
    for _ in range(5):
        writer = subprocess.Popen(
            [sys.executable, "-c", BIG_WRITER, scheme, str(root)],
            env=CHILD_ENV,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert writer.stdout is not None
        assert writer.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + DEADLINE
        while time.monotonic() < deadline:
            if object_temps(root):
                writer.send_signal(signal.SIGSTOP)
                os.waitpid(writer.pid, os.WUNTRACED)  # returns once it has really stopped
                if object_temps(root):
                    return writer
                writer.send_signal(signal.SIGCONT)
            time.sleep(0.001)
        writer.kill()
        writer.wait()
    pytest.fail("the writer never left a temporary file on disk")


def object_temps(root: Path) -> list[Path]:
    """Temporary files of object writes holding more than a header block's worth."""
    found = []
    for path in temp_files(root):
        with contextlib.suppress(FileNotFoundError):
            if not path.name.startswith(".kvplug-probe") and path.stat().st_size > BLOCK:
                found.append(path)
    return found


def stop(writer: subprocess.Popen[str]) -> None:
    writer.kill()
    writer.wait()
    if writer.stdout is not None:
        writer.stdout.close()


def as_if_pid(path: Path, pid: int) -> Path:
    """Rename a temporary file or writer lock of another process as if ``pid`` had made it."""
    fields = path.name.split(".")
    for index, text in enumerate(fields):
        if text.isdigit():
            fields[index] = str(pid)
            break
    renamed = path.with_name(".".join(fields))
    path.rename(renamed)
    return renamed


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_temp_file_of_a_dead_writer_is_removed_even_when_a_live_process_has_its_pid(
    tmp_path: Path, allocator: FreeListAllocator, scheme: str
) -> None:
    """Containers restart the engine as pid 1 every time: the pid in a temporary file's name
    says nothing. A writer killed mid-write leaves a temporary file; renamed to carry this
    test's own (live) pid, it is still removed at open, and so is the dead writer's lock."""
    root = tmp_path / "kv"
    writer = writer_caught_mid_write(scheme, root)
    stop(writer)
    leftovers = [as_if_pid(p, os.getpid()) for p in temp_files(root)]
    locks = [as_if_pid(p, os.getpid()) for p in writer_locks(root)]
    assert leftovers
    if scheme == "gds":  # on a shared mount, only stale temporary files are removed
        old = time.time() - gds_module.TEMP_GRACE - 60
        for path in leftovers:
            os.utime(path, (old, old))

    async def reopen() -> None:
        tier = await open_tier(scheme, root, allocator)
        try:
            assert tier.rebuild_stats["temp_removed"] == len(leftovers)
            assert tier.rebuild_stats["temp_in_use"] == 0
            assert tier.stats()["temp_bytes"] == 0
            assert all(not p.exists() for p in leftovers)
            assert all(not p.exists() for p in locks)
            assert len(writer_locks(root)) == 1  # this backend's own
        finally:
            await tier.close()

    run(reopen())
    assert writer_locks(root) == []  # released at close


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_temp_file_of_a_live_writer_is_kept_and_counted_against_max_size(
    tmp_path: Path, allocator: FreeListAllocator, scheme: str
) -> None:
    """A writer in another process, stopped mid-write, keeps its temporary file: it is left
    alone and its bytes count against max_size; once the writer is dead, the next put that
    needs room removes it."""
    root = tmp_path / "kv"
    writer = writer_caught_mid_write(scheme, root)
    try:
        (held,) = object_temps(root)
        size = held.stat().st_size
        if scheme == "gds":  # old enough to be removed once its writer is gone
            old = time.time() - gds_module.TEMP_GRACE - 60
            os.utime(held, (old, old))
        one = file_length(1 * MiB)
        room = size + 3 * one

        async def scenario() -> None:
            tier = await open_tier(scheme, root, allocator, max_size=room + one // 2)
            try:
                assert tier.rebuild_stats["temp_in_use"] == 1
                assert tier.stats()["temp_bytes"] == size
                for n in range(6):
                    await put_seeded(tier, allocator, key(n), 1 * MiB, seed=n)
                    assert tier.bytes_held + tier.stats()["temp_bytes"] <= tier.max_size
                assert held.exists() and tier.stats()["keys"] == 3
                stop(writer)
                for n in range(6, 9):
                    await put_seeded(tier, allocator, key(n), 1 * MiB, seed=n)
                assert not held.exists() and tier.stats()["temp_bytes"] == 0
                assert tier.stats()["keys"] > 3
            finally:
                await tier.close()

        run(scenario())
    finally:
        stop(writer)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_temp_file_of_a_live_backend_in_this_process_is_kept(
    tmp_path: Path, allocator: FreeListAllocator, scheme: str
) -> None:
    """Liveness is the writer's lock, not its pid: a temporary file named for a backend still
    open in this very process is kept by a second backend's open."""
    root = tmp_path / "kv"

    async def scenario() -> None:
        first = await open_tier(scheme, root, allocator)
        try:
            (lock,) = writer_locks(root)
            match = WRITER_LOCK_NAME.fullmatch(lock.name)
            assert match is not None
            stem = "ab" * 16
            (root / "ab").mkdir(mode=0o700, exist_ok=True)
            in_flight = root / "ab" / f".{stem}.{match.group(1)}.{match.group(2)}.0a0b0c0d.tmp"
            in_flight.write_bytes(b"x" * BLOCK)
            second = await open_tier(scheme, root, allocator)
            assert second.rebuild_stats["temp_in_use"] == 1 and in_flight.exists()
            assert second.stats()["temp_bytes"] == BLOCK
            await second.close()
            in_flight.unlink()
        finally:
            await first.close()

    run(scenario())


def test_writer_lock_and_temp_names_are_tied_by_pid_and_writer() -> None:
    from kvplug_disk.layout import probe_name, temp_name, writer_lock_name

    writer = "0123456789abcdef"
    lock = WRITER_LOCK_NAME.fullmatch(writer_lock_name(writer))
    temp = TEMP_NAME.fullmatch(temp_name("f" * 32, writer))
    probe = TEMP_NAME.fullmatch(probe_name(writer))
    assert lock is not None and temp is not None and probe is not None
    assert lock.groups() == temp.groups() == probe.groups() == (str(os.getpid()), writer)
    assert temp_name("f" * 32, writer) != temp_name("f" * 32, writer)
    legacy = TEMP_NAME.fullmatch(f".{'f' * 32}.42.{'9' * 16}.tmp")
    assert legacy is not None and legacy.groups() == ("42", "9" * 16)
    assert not re.fullmatch(r"[0-9a-f]{2}", "ab.moved-aside")


def _cufile_problem() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU and cuFile (run on the GPU machine: docs/gpu.md)"
    try:
        from kvplug_disk.fileio.cufile import CuFileIO

        CuFileIO()
    except Exception as error:
        return f"cuFile is not usable here: {error}"
    return None


@pytest.mark.skipif(_cufile_problem() is not None, reason=_cufile_problem() or "")
def test_with_real_cufile_foreign_file_types_are_misses_and_puts_replace_them(
    tmp_path: Path,
) -> None:
    """gds:// with cuFile and GPU memory: the descriptor cuFile gets is reopened from one that
    open_object checked, so the same foreign things read as misses there too."""
    root = tmp_path / "kv"
    keys = [key(n, "gpu") for n in range(10)]
    shape = (2, 4, 256, 128)

    async def scenario() -> None:
        tier = await kvplug.open_backend(f"gds://{root}", timeout=60)
        assert isinstance(tier, DiskBackend)
        planted: list[Foreign] = []
        try:
            for n, k in enumerate(keys):
                obj = tier.allocator.allocate(shape, torch.float16)
                assert obj is not None and obj.tensor.is_cuda
                obj.tensor.fill_(n)
                await tier.put(k, obj)
                obj.release()
            kinds = [kind for kind in Foreign.KINDS if kind != "character device"]
            for kind, k in zip(kinds, keys, strict=False):
                planted.append(Foreign(kind, Path(tier.stored_files(k)[0])))
                planted[-1].plant()
            for k in keys[: len(kinds)]:
                assert await tier.get(k) is None and not await tier.contains(k)
            for n, k in enumerate(keys[len(kinds) :], len(kinds)):
                hit = await tier.get(k)
                assert hit is not None and hit.tensor.float().mean().item() == n
                hit.release()
            assert tier.stats()["foreign_files"] == len(kinds)
            for n, k in enumerate(keys[: len(kinds)]):
                obj = tier.allocator.allocate(shape, torch.float16)
                assert obj is not None
                obj.tensor.fill_(100 + n)
                await tier.put(k, obj)
                obj.release()
                hit = await tier.get(k)
                assert hit is not None and hit.tensor.float().mean().item() == 100 + n
                hit.release()
        finally:
            for foreign in planted:
                foreign.unblock()
            await tier.close()

    run(scenario())


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "o_direct"])
def test_an_object_file_opens_blocking_with_the_flags_asked_and_its_size(
    tmp_path: Path, direct: bool
) -> None:
    """The descriptor reads block (no O_NONBLOCK left from the open that cannot hang on a
    FIFO, which a FileIO such as io_uring's would turn into EAGAIN), carries O_DIRECT exactly
    when asked, and comes with the file's size."""
    path = tmp_path / "object.kv"
    path.write_bytes(bytes(3 * 4096))
    wanted = getattr(os, "O_DIRECT", 0) if direct else 0
    try:
        fd, size = open_object_sized(str(path), wanted)
    except OSError as error:  # a file system without O_DIRECT (tmpfs)
        pytest.skip(f"{tmp_path} refuses O_DIRECT: {error}")
    try:
        status = fcntl.fcntl(fd, fcntl.F_GETFL)
        assert not status & os.O_NONBLOCK
        assert bool(status & getattr(os, "O_DIRECT", 0)) == bool(wanted)
        assert size == 3 * 4096
    finally:
        os.close(fd)
