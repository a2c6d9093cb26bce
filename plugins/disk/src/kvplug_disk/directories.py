"""The tier's directories (internal): which ones, their security, their O_DIRECT support."""

# File descriptors and str paths on the I/O path, as in kvplug_disk.backend.
# ruff: noqa: PTH103, PTH116, PTH117, PTH118

from __future__ import annotations

import mmap
import os
import stat
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvplug.errors import ConfigError, InvalidBackendURL
from kvplug.url import BackendURL
from kvplug_disk.fileops import O_DIRECT, reason, unlink_quietly
from kvplug_disk.layout import BLOCK, probe_name

OPEN_FLAGS = os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
"""Flags of every object file the engine opens (never through a symbolic link)."""


@dataclass
class Directory:
    """One directory of the tier, as found at open."""

    path: str
    o_direct: bool
    """Whether files here are read and written with O_DIRECT."""
    o_direct_problem: str | None
    """Why O_DIRECT is not used here (``None`` when it is)."""
    subdirs: set[str] = field(default_factory=set, repr=False)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


def _directory_paths(url: BackendURL, extra: Sequence[str]) -> tuple[str, ...]:
    raw = (url.path.split(",") if url.path else []) + list(extra)
    if not raw:
        raise InvalidBackendURL(
            f"{url} names no directory. Write an absolute path after three slashes, "
            f"{url.scheme}:///var/cache/kvplug, several separated by commas, "
            f"{url.scheme}:///nvme0/kv,/nvme1/kv, or give the option paths."
        )
    paths: list[str] = []
    for path in raw:
        if not path or not os.path.isabs(path):
            raise InvalidBackendURL(
                f"{url}: directory {path!r} is not an absolute path. Write absolute paths, "
                f"separated by commas: {url.scheme}:///nvme0/kv,/nvme1/kv"
            )
        normal = os.path.normpath(path)
        if normal not in paths:
            paths.append(normal)
    return tuple(paths)


def _check_not_shared(path: str, url: BackendURL) -> None:
    """Refuse a directory that another user owns or can write to."""
    info = os.stat(path)
    problems = []
    uid = os.geteuid()
    if info.st_uid != uid:
        problems.append(f"it is owned by uid {info.st_uid}, not by this process's uid {uid}")
    writers = [
        who
        for bit, who in ((stat.S_IWGRP, "its group"), (stat.S_IWOTH, "every user"))
        if info.st_mode & bit
    ]
    if writers:
        problems.append(
            f"{' and '.join(writers)} can write to it (mode {stat.S_IMODE(info.st_mode):o})"
        )
    if problems:
        raise ConfigError(
            f"{url}: refusing the cache directory {path}: {'; '.join(problems)}, so another "
            "user could plant, change or delete cached KV data there. Run `chmod 700 "
            f"{path}` (and chown it to this user), use a directory of your own, or pass "
            "allow_shared_dir=true if sharing it is intended."
        )


def _prepare_directory(path: str, url: BackendURL, allow_shared: bool) -> None:
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except FileExistsError:
        raise ConfigError(
            f"{url}: {path} exists and is not a directory. Name a directory for the cache."
        ) from None
    except OSError as error:
        raise ConfigError(
            f"{url}: cannot create the cache directory {path}: {reason(error)}. Create it "
            "(mode 700) or choose a directory this user can write to."
        ) from None
    if not allow_shared:
        _check_not_shared(path, url)
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{url}: the cache directory {path} is not writable by this user. Fix its "
            "permissions or choose another directory."
        )


def _probe_o_direct(path: str, writer: str) -> str | None:
    """None when an aligned block can be written and read back with O_DIRECT in ``path``,
    else the reason it cannot."""
    if not O_DIRECT:
        return "this platform has no O_DIRECT"
    name = os.path.join(path, probe_name(writer))
    block = mmap.mmap(-1, BLOCK)
    back = mmap.mmap(-1, BLOCK)
    block[:] = (b"kvplug O_DIRECT probe " * (BLOCK // 16))[:BLOCK]
    try:
        try:
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | O_DIRECT | OPEN_FLAGS, 0o600)
        except OSError as error:
            unlink_quietly(name)
            return f"opening a file with O_DIRECT failed: {reason(error)}"
        try:
            if os.pwritev(fd, [block], 0) != BLOCK or os.preadv(fd, [back], 0) != BLOCK:
                return "an aligned O_DIRECT write and read transferred fewer bytes than asked"
            if back[:] != block[:]:
                return "an aligned O_DIRECT read did not return the block just written"
        except OSError as error:
            return f"an aligned O_DIRECT write and read failed: {reason(error)}"
        finally:
            os.close(fd)
            unlink_quietly(name)
    finally:
        block.close()
        back.close()
    return None


__all__ = ["OPEN_FLAGS", "Directory"]
