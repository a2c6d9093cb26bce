"""file://'s O_DIRECT probe: a directory whose probe could not run (a full disk, a quota, an I/O
error, too many open files) is not given up on. It is read and written buffered, a later put
probes again and switches it to O_DIRECT; a filesystem that refuses O_DIRECT (EINVAL) stays
buffered for good. Each case says which it is, files written before a switch read bit-exact
after it, and ``describe()`` and ``kvplug check`` show the state.

The full disk is real where this machine can mount one (a loop-mounted ext4 image, a small
tmpfs; as root); the other causes are injected into the probe's own system calls only, which
the tests also watch to see how object files are opened.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from disk_helpers import (
    fill,
    key,
    leak_checked_allocator,
    put_seeded,
    read_back,
    run,
    seeded_bytes,
    small_filesystem,
)

import kvplug
from kvplug import CacheKey, CapacityExceeded, FreeListAllocator
from kvplug.runtime.cli import main as kvplug_cli
from kvplug.stats import summarize
from kvplug_disk import directories, reads
from kvplug_disk.backend import DiskBackend
from kvplug_disk.directories import DirectIO, Directory
from kvplug_disk.fileops import open_object_sized as real_open_object
from kvplug_disk.layout import TEMP_NAME, digest

KiB = 1024
MiB = 1024 * KiB
LOGGER = "kvplug.disk"
PROBE_PREFIX = ".kvplug-probe."
TRANSIENT = [
    (errno.ENOSPC, "the disk is full"),
    (errno.EDQUOT, "over its disk quota"),
    (errno.EIO, "I/O error"),
    (errno.EROFS, "read-only"),
    (errno.EMFILE, "too many open files"),
]

allocator = pytest.fixture(leak_checked_allocator, name="allocator")


class ProbeWatch:
    """Watches, through ``os.open``, ``os.pwritev``, ``os.preadv`` and the backend's
    ``open_object_sized``, how many O_DIRECT probes run and with which flags object files are
    opened; while :attr:`fault` is set (``(step, errno)``, step ``open``, ``write`` or
    ``read``), the probe's own call of that step fails with that error. Every other call runs
    as it is."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.fault: tuple[str, int] | None = None
        self.probes = 0
        self.written: dict[str, list[int]] = {}
        """Object digest -> flags of each temporary file opened to write it."""
        self.read: dict[str, list[int]] = {}
        """Object digest -> flags of each open to read it."""
        self._probe_fds: set[int] = set()
        real_open, real_close = os.open, os.close
        real_pwritev, real_preadv = os.pwritev, os.preadv

        def failing(step: str, path: Any = None) -> None:
            if self.fault is not None and self.fault[0] == step:
                code = self.fault[1]
                raise OSError(code, os.strerror(code), path)

        def spy_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
            name = Path(os.fsdecode(path)).name
            if name.startswith(PROBE_PREFIX):
                self.probes += 1
                failing("open", path)
                fd = real_open(path, flags, *args, **kwargs)
                self._probe_fds.add(fd)
                return fd
            if TEMP_NAME.fullmatch(name):
                self.written.setdefault(name[1:33], []).append(flags)
            return real_open(path, flags, *args, **kwargs)

        def spy_close(fd: int) -> None:
            self._probe_fds.discard(fd)
            real_close(fd)

        def spy_pwritev(fd: int, buffers: Any, offset: int, *args: Any) -> int:
            if fd in self._probe_fds:
                failing("write")
            return real_pwritev(fd, buffers, offset, *args)

        def spy_preadv(fd: int, buffers: Any, offset: int, *args: Any) -> int:
            if fd in self._probe_fds:
                failing("read")
            return real_preadv(fd, buffers, offset, *args)

        def spy_open_object(path: str, flags: int = 0) -> tuple[int, int]:
            self.read.setdefault(Path(path).name[:32], []).append(flags)
            return real_open_object(path, flags)

        monkeypatch.setattr(os, "open", spy_open)
        monkeypatch.setattr(os, "close", spy_close)
        monkeypatch.setattr(os, "pwritev", spy_pwritev)
        monkeypatch.setattr(os, "preadv", spy_preadv)
        monkeypatch.setattr(reads, "open_object_sized", spy_open_object)

    def write_was_direct(self, k: CacheKey) -> bool:
        """Whether the last write of ``k`` opened its temporary file with O_DIRECT."""
        return bool(self.written[digest(k.to_string())][-1] & os.O_DIRECT)

    def read_was_direct(self, k: CacheKey) -> bool:
        """Whether the last read of ``k`` opened its file with O_DIRECT."""
        return bool(self.read[digest(k.to_string())][-1] & os.O_DIRECT)


def mode(directory: Directory) -> tuple[bool, DirectIO]:
    """Whether ``directory`` uses O_DIRECT now, and why."""
    return directory.o_direct, directory.direct_io


async def open_disk(url: str, allocator: FreeListAllocator, **options: Any) -> DiskBackend:
    backend = await kvplug.open_backend(url, allocator=allocator, **options)
    assert isinstance(backend, DiskBackend)
    return backend


async def assert_bit_exact(backend: DiskBackend, stored: dict[CacheKey, tuple[int, int]]) -> None:
    for k, (nbytes, seed) in stored.items():
        back = await read_back(backend, k)
        assert back is not None, f"{k} missed"
        assert torch.equal(back, seeded_bytes(nbytes, seed)), f"{k} read other bytes"


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING
    ]


# -- a real full disk --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["ext4", "tmpfs"])
def test_a_full_disk_at_open_is_probed_again_and_switches_to_o_direct_once_space_is_freed(
    tmp_path: Path,
    allocator: FreeListAllocator,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    kind: str,
) -> None:
    """A filesystem with 0 bytes free, for real: open warns that the probe could not run
    because the disk is full (not that the filesystem lacks O_DIRECT), the directory is read
    and written buffered; once space is freed a put within the retry interval still writes
    buffered, the next put after it probes, succeeds and writes with O_DIRECT, and the object
    written buffered before the switch reads bit-exact with O_DIRECT, also after a reopen."""
    with small_filesystem(kind, tmp_path / "mnt") as mount:
        root = mount / "kv"
        root.mkdir(mode=0o700)  # a full ext4 has no block left for a new directory
        filler = fill(mount)
        caplog.set_level(logging.INFO, logger=LOGGER)
        watch = ProbeWatch(monkeypatch)
        buffered, direct = key(1), key(2)
        stored = {buffered: (300_000, 1), direct: (200_000, 2)}

        async def scenario() -> None:
            disk = await open_disk(f"file://{root}", allocator)
            (directory,) = disk.directories
            try:
                (warning,) = warnings_of(caplog)
                text = warning.replace(str(root), "<dir>")
                assert "O_DIRECT" in text and "ENOSPC" in text and "the disk is full" in text
                assert "says nothing about O_DIRECT support" in text and "Free space" in text
                assert "ext4" not in text and "xfs" not in text and "refuses" not in text
                assert mode(directory) == (False, DirectIO.RETRYING)
                assert "ENOSPC" in disk.describe()["directories"]
                with pytest.raises(CapacityExceeded, match="free"):
                    await put_seeded(disk, allocator, key(9), 100_000, seed=9)

                filler.unlink()
                os.sync()
                monkeypatch.setattr(directories, "O_DIRECT_RETRY", 3600.0)
                await put_seeded(disk, allocator, buffered, *stored[buffered])
                assert not watch.write_was_direct(buffered)
                assert mode(directory) == (False, DirectIO.RETRYING)
                monkeypatch.setattr(directories, "O_DIRECT_RETRY", 0.0)
                await put_seeded(disk, allocator, direct, *stored[direct])
                assert mode(directory) == (True, DirectIO.ON) and watch.write_was_direct(direct)
                assert directory.o_direct_problem is None
                assert disk.describe()["directories"] == f"{root} (O_DIRECT)"
                assert any("O_DIRECT probe in" in r.getMessage() for r in caplog.records)
                assert len(warnings_of(caplog)) == 1
                await assert_bit_exact(disk, stored)
                assert watch.read_was_direct(buffered) and watch.read_was_direct(direct)
            finally:
                await disk.close()
            again = await open_disk(f"file://{root}", allocator)
            try:
                assert mode(again.directories[0]) == (True, DirectIO.ON)
                await assert_bit_exact(again, stored)
            finally:
                await again.close()

        run(scenario())


# -- causes injected into the probe ------------------------------------------------------------


@pytest.mark.parametrize("step", ["open", "write"])
@pytest.mark.parametrize(
    ("code", "cause"), TRANSIENT, ids=[errno.errorcode[c] for c, _ in TRANSIENT]
)
def test_a_probe_that_cannot_run_names_its_cause_and_is_retried_at_most_once_per_interval(
    tmp_path: Path,
    allocator: FreeListAllocator,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    step: str,
    code: int,
    cause: str,
) -> None:
    """A probe whose open or write fails with an error that says nothing about O_DIRECT
    support leaves the directory buffered with one warning naming the cause and its fix;
    puts probe again only once the retry interval has passed, a failing retry warns no more,
    and the first probe that succeeds switches the directory to O_DIRECT for good."""
    watch = ProbeWatch(monkeypatch)
    watch.fault = (step, code)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    stored: dict[CacheKey, tuple[int, int]] = {}

    async def put(disk: DiskBackend, n: int) -> None:
        stored[key(n)] = (50_000 + n, n)
        await put_seeded(disk, allocator, key(n), *stored[key(n)])

    async def scenario() -> None:
        disk = await open_disk(f"file://{tmp_path}", allocator)
        (directory,) = disk.directories
        try:
            (warning,) = warnings_of(caplog)
            name = errno.errorcode[code]
            assert name in warning and cause in warning and str(tmp_path) in warning
            assert "says nothing about O_DIRECT support" in warning
            assert "ext4" not in warning and "refuses" not in warning
            assert watch.probes == 1 and mode(directory) == (False, DirectIO.RETRYING)
            assert name in (directory.o_direct_problem or "")

            monkeypatch.setattr(directories, "O_DIRECT_RETRY", 3600.0)
            for n in range(3):
                await put(disk, n)
                assert not watch.write_was_direct(key(n))
            assert watch.probes == 1

            monkeypatch.setattr(directories, "O_DIRECT_RETRY", 0.0)
            for n in range(3, 5):
                await put(disk, n)
                assert not watch.write_was_direct(key(n))
            assert watch.probes == 3 and mode(directory) == (False, DirectIO.RETRYING)
            assert len(warnings_of(caplog)) == 1

            watch.fault = None
            for n in range(5, 8):
                await put(disk, n)
                assert watch.write_was_direct(key(n))
            assert watch.probes == 4 and mode(directory) == (True, DirectIO.ON)
            assert len(warnings_of(caplog)) == 1
            await assert_bit_exact(disk, stored)
            assert all(watch.read_was_direct(k) for k in stored)
        finally:
            await disk.close()

    run(scenario())


@pytest.mark.parametrize("when", ["at open", "on a retry"])
@pytest.mark.parametrize("step", ["open", "write", "read"])
def test_a_filesystem_refusing_o_direct_stays_buffered_for_good_and_says_so(
    tmp_path: Path,
    allocator: FreeListAllocator,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    step: str,
    when: str,
) -> None:
    """EINVAL from the probe's O_DIRECT open, aligned write or aligned read (tmpfs on older
    kernels, some network filesystems), at open or on a retry after a full disk: the
    directory is buffered for good, with one warning saying the filesystem refuses O_DIRECT
    and what to do; puts never probe again, and what they write reads bit-exact."""
    watch = ProbeWatch(monkeypatch)
    watch.fault = (step, errno.EINVAL) if when == "at open" else ("write", errno.ENOSPC)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    stored = {key(n): (40_000 + n, n) for n in range(4)}

    async def scenario() -> None:
        disk = await open_disk(f"file://{tmp_path}", allocator)
        (directory,) = disk.directories
        try:
            monkeypatch.setattr(directories, "O_DIRECT_RETRY", 0.0)
            if when == "on a retry":
                watch.fault = (step, errno.EINVAL)
                await put_seeded(disk, allocator, key(99), 1000, seed=99)
                stored[key(99)] = (1000, 99)
            warning = warnings_of(caplog)[-1]
            assert "refuses O_DIRECT" in warning and "EINVAL" in warning
            assert str(tmp_path) in warning and "ext4, xfs" in warning
            assert "o_direct=false" in warning and "buffered" in warning
            assert len(warnings_of(caplog)) == (1 if when == "at open" else 2)
            probes = watch.probes
            assert mode(directory) == (False, DirectIO.REFUSED)
            assert "refuses O_DIRECT" in disk.describe()["directories"]

            watch.fault = None  # a refusal is not retried even when a probe would now pass
            for k, (nbytes, seed) in stored.items():
                await put_seeded(disk, allocator, k, nbytes, seed)
                assert not watch.write_was_direct(k)
            assert watch.probes == probes and mode(directory) == (False, DirectIO.REFUSED)
            await assert_bit_exact(disk, stored)
            assert not any(watch.read_was_direct(k) for k in stored)
        finally:
            await disk.close()

    run(scenario())


def test_puts_and_gets_across_the_switch_to_o_direct_stay_bit_exact(
    tmp_path: Path, allocator: FreeListAllocator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many puts, overwrites and gets at once on the file I/O threads while the directory
    switches from buffered to O_DIRECT: exactly one probe runs, every read returns the bytes
    of the last completed put, nothing reads as corrupt, and after a reopen every object
    reads bit-exact (contract clause 14)."""
    watch = ProbeWatch(monkeypatch)
    watch.fault = ("write", errno.ENOSPC)
    monkeypatch.setattr(directories, "O_DIRECT_RETRY", 3600.0)
    old = {key(n): (20_000 + 4096 * n, n) for n in range(16)}
    new = {key(100 + n): (30_000 + 4096 * n, 100 + n) for n in range(16)}
    replaced = {key(n): (25_000 + 4096 * n, 200 + n) for n in range(0, 16, 2)}

    async def scenario() -> None:
        disk = await open_disk(f"file://{tmp_path}", allocator, workers=8, queue_depth=64)
        (directory,) = disk.directories
        try:
            await asyncio.gather(*(put_seeded(disk, allocator, k, *v) for k, v in old.items()))
            assert not directory.o_direct and watch.probes == 1
            watch.fault = None
            monkeypatch.setattr(directories, "O_DIRECT_RETRY", 0.0)
            stored = {**old}

            async def check(k: CacheKey) -> None:
                back = await read_back(disk, k)
                assert back is not None and torch.equal(back, seeded_bytes(*stored[k]))

            await asyncio.gather(
                *(put_seeded(disk, allocator, k, *v) for k, v in new.items()),
                *(check(k) for k in old if k not in replaced),
            )
            assert watch.probes == 2 and mode(directory) == (True, DirectIO.ON)
            assert sum(watch.write_was_direct(k) for k in new) >= 1
            stored.update(new)
            await asyncio.gather(
                *(put_seeded(disk, allocator, k, *v) for k, v in replaced.items()),
                *(check(k) for k in new),
            )
            stored.update(replaced)
            assert all(watch.write_was_direct(k) for k in replaced)
            await assert_bit_exact(disk, stored)
            assert disk.corrupt_objects == 0 and summarize(disk.operation_stats()).misses == 0
        finally:
            await disk.close()
        again = await open_disk(f"file://{tmp_path}", allocator)
        try:
            assert again.rebuild_stats["objects"] == len(stored)
            await assert_bit_exact(again, stored)
        finally:
            await again.close()
        assert stored == {**old, **new, **replaced}

    run(scenario())


# -- describe() and kvplug check ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("fault", "query", "shown"),
    [
        (None, "", "(O_DIRECT)"),
        (("write", errno.ENOSPC), "", "(buffered for now: the O_DIRECT probe could not run"),
        (("open", errno.EINVAL), "", "(buffered: the filesystem refuses O_DIRECT: opening"),
        (None, "?o_direct=false", "(buffered, o_direct=false)"),
    ],
    ids=["o_direct", "full", "refused", "off"],
)
def test_kvplug_check_shows_how_each_directory_moves_its_files(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fault: tuple[str, int] | None,
    query: str,
    shown: str,
) -> None:
    """``kvplug check file:///a,/b`` round-trips objects and prints each directory with its
    O_DIRECT state and, where O_DIRECT is not used, why."""
    watch = ProbeWatch(monkeypatch)
    watch.fault = fault
    first, second = tmp_path / "a", tmp_path / "b"
    result = CliRunner().invoke(
        kvplug_cli,
        ["check", f"file://{first},{second}{query}", "--shape", "2,4,16,8", "--rounds", "2"],
    )
    assert result.exit_code == 0, result.output
    output = "".join(result.output.split())  # however the console wrapped its lines
    for directory in (first, second):
        assert "".join(f"{directory} {shown}".split()) in output, result.output
    if fault is not None:
        assert errno.errorcode[fault[1]] in output
