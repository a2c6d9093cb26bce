"""An acknowledged overwrite is never shadowed by the older value, across a real SIGKILL: a
``[cpu, file]`` Store acknowledges newer values while its write-behind still owes them to the
disk, the process is killed, and a new process reads every key back from the disk."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

CHILD = textwrap.dedent(
    """
    import asyncio, os, signal, sys, torch
    from kvplug.runtime.config import Config
    from kvplug.keys import CacheKey
    from kvplug.runtime.store import open_store

    directory, keys, versions = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    kill_self = sys.argv[4] == "1"

    async def main():
        config = Config.from_dict({"tiers": [{"url": "cpu://", "max_size": "256MiB"},
                                              f"file://{directory}"]})
        store = await open_store(config)
        for version in range(1, versions + 1):
            for n in range(keys):
                obj = store.allocate((2, 2, 128, 1024), torch.float16)
                obj.tensor.fill_(float(version))
                await store.put(CacheKey("crash-test", 1, 0, n), obj)
                obj.release()
                print(f"acked {n} {version}", flush=True)
            if version == 1:
                await store.flush()
                print("flushed", flush=True)
        if kill_self:
            os.kill(os.getpid(), signal.SIGKILL)
        await asyncio.sleep(3600)

    asyncio.run(main())
    """
)

READER = textwrap.dedent(
    """
    import asyncio, sys
    from kvplug import open_backend
    from kvplug.keys import CacheKey

    async def main():
        disk = await open_backend(f"file://{sys.argv[1]}")
        for n in range(int(sys.argv[2])):
            got = await disk.get(CacheKey("crash-test", 1, 0, n))
            if got is None:
                print(n, "miss")
            else:
                values = got.tensor.unique().tolist()
                print(n, "torn" if len(values) != 1 else int(values[0]))
                got.release()
        await disk.close()

    asyncio.run(main())
    """
)


def read_back(directory: Path, keys: int) -> dict[int, str]:
    done = subprocess.run(
        [sys.executable, "-c", READER, str(directory), str(keys)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return dict((int(n), value) for n, value in (line.split() for line in done.stdout.splitlines()))


def check_no_older_value(directory: Path, acked: dict[int, int], keys: int) -> None:
    found = read_back(directory, keys)
    stale = {
        n: (value, acked[n])
        for n, value in found.items()
        if n in acked and value != "miss" and (value == "torn" or int(value) < acked[n])
    }
    assert not stale, f"keys read older (or torn) than their acknowledged value: {stale}"


def run_child(
    directory: Path, keys: int, versions: int, *, kill_after: int | None
) -> dict[int, int]:
    """Run the writer; kill it with SIGKILL after ``kill_after`` acknowledgements of the
    overwrites (or let it kill itself right after its last one). The acknowledged versions."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            CHILD,
            str(directory),
            str(keys),
            str(versions),
            "1" if kill_after is None else "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    acked: dict[int, int] = {}
    overwrites = 0
    try:
        assert child.stdout is not None
        for line in child.stdout:
            if not line.startswith("acked"):
                continue
            _, n, version = line.split()
            acked[int(n)] = int(version)
            if int(version) > 1:
                overwrites += 1
                if kill_after is not None and overwrites >= kill_after:
                    child.send_signal(signal.SIGKILL)
                    break
        child.wait(120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(30)
        assert child.stderr is not None
        errors = child.stderr.read()
        child.stdout.close()  # type: ignore[union-attr]
        child.stderr.close()
    assert child.returncode == -signal.SIGKILL, errors
    return acked


def test_overwrites_acknowledged_just_before_a_kill_never_read_older(tmp_path: Path) -> None:
    keys = 48
    acked = run_child(tmp_path / "disk", keys, 2, kill_after=None)
    assert len(acked) == keys and set(acked.values()) == {2}
    check_no_older_value(tmp_path / "disk", acked, keys)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_kill_at_a_random_moment_of_a_stream_of_overwrites_never_reads_older(
    tmp_path: Path, seed: int
) -> None:
    keys, versions = 16, 5
    kill_after = random.Random(seed).randrange(1, keys * (versions - 1))
    acked = run_child(tmp_path / "disk", keys, versions, kill_after=kill_after)
    check_no_older_value(tmp_path / "disk", acked, keys)
