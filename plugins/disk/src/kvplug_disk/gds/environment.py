"""What the machine says about GPUDirect Storage, read once at open: cuFile's mode and mounts,
and what to tell the user when the machine cannot run it (:class:`GdsUnavailable`).

cuFile runs in one of two ways. With the ``nvidia-fs`` kernel driver loaded and a filesystem
that supports it, reads and writes are DMA between the file and GPU memory ("gds"). Without
the driver, or when ``cufile.json`` forces it, cuFile's *compatibility mode* does POSIX reads
and writes through host bounce buffers and copies to and from the GPU ("compat"): it works
everywhere cuFile loads, only slower. cuFile itself decides, from the same inputs read here:

* the driver: ``/proc/driver/nvidia-fs`` (or ``/sys/module/nvidia_fs``) exists when loaded;
* ``cufile.json`` (``$CUFILE_ENV_PATH_JSON``, else ``/etc/cufile.json``):
  ``properties.allow_compat_mode`` (default true) and ``properties.force_compat_mode``
  (default false); for WekaFS, ``fs.weka.rdma_write_support`` (default false: writes to Weka
  go through compatibility mode even with the driver);
* the environment variable ``CUFILE_FORCE_COMPAT_MODE``.

Example::

    >>> import json, os, tempfile
    >>> with tempfile.TemporaryDirectory() as root:
    ...     config = os.path.join(root, "cufile.json")
    ...     with open(config, "w") as f:
    ...         _ = f.write('{ // comments\\n "properties": {"allow_compat_mode": true}}')
    ...     mode = detect_mode(env={"CUFILE_ENV_PATH_JSON": config}, root=root)
    >>> mode.mode, mode.reason
    ('compat', 'the nvidia-fs kernel driver is not loaded')
"""

# ruff: noqa: PTH110, PTH116, PTH118, PTH123
from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvplug.errors import ConfigError
from kvplug.url import BackendURL
from kvplug_disk.fileio.cufile import CuFileError

DEFAULT_CONFIG = "/etc/cufile.json"
_TRUE = frozenset({"1", "true", "yes", "on"})
_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


@dataclass(frozen=True)
class CuFileMode:
    """How cuFile will move data on this machine."""

    mode: str
    """``"gds"`` (nvidia-fs DMA) or ``"compat"`` (POSIX I/O inside cuFile)."""
    reason: str
    """Why, in words, for the log and ``kvplug check``."""
    usable: bool = True
    """False when cuFile can do no I/O at all (no driver and compatibility mode disallowed)."""
    config_path: str | None = None
    """The cufile.json read, when one was found."""
    weka_write_compat: bool = True
    """Whether writes to WekaFS use compatibility mode (``fs.weka.rdma_write_support``)."""


def strip_json_comments(text: str) -> str:
    """``text`` without ``//`` line comments outside strings (cufile.json carries them)."""
    out: list[str] = []
    in_string = False
    escaped = False
    index = 0
    while index < len(text):
        char = text[index]
        if in_string:
            out.append(char)
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
            out.append(char)
        elif text.startswith("//", index):
            end = text.find("\n", index)
            index = len(text) if end < 0 else end
            continue
        else:
            out.append(char)
        index += 1
    return "".join(out)


def _setting(config: Mapping[str, Any], *path: str, default: bool) -> bool:
    node: Any = config
    for name in path:
        if not isinstance(node, Mapping) or name not in node:
            return default
        node = node[name]
    if isinstance(node, bool):
        return node
    if isinstance(node, str):
        return node.strip().lower() in _TRUE
    return default


def read_cufile_config(env: Mapping[str, str]) -> tuple[str | None, dict[str, Any]]:
    """The path and content of the cufile.json cuFile will read (empty when none or bad)."""
    path = env.get("CUFILE_ENV_PATH_JSON") or DEFAULT_CONFIG
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.loads(strip_json_comments(handle.read()))
    except (OSError, ValueError):
        return None, {}
    return path, data if isinstance(data, dict) else {}


def nvidia_fs_loaded(root: str = "/") -> bool:
    """Whether the nvidia-fs kernel driver is loaded (what GDS DMA needs)."""
    return os.path.exists(os.path.join(root, "proc/driver/nvidia-fs")) or os.path.exists(
        os.path.join(root, "sys/module/nvidia_fs")
    )


def detect_mode(env: Mapping[str, str] | None = None, root: str = "/") -> CuFileMode:
    """How cuFile will run here; ``env`` and ``root`` stand in for the real ones in tests."""
    env = os.environ if env is None else env
    path, config = read_cufile_config(env)
    allow = _setting(config, "properties", "allow_compat_mode", default=True)
    forced_by_config = _setting(config, "properties", "force_compat_mode", default=False)
    forced_by_env = env.get("CUFILE_FORCE_COMPAT_MODE", "").strip().lower() in _TRUE
    weka_compat = not _setting(config, "fs", "weka", "rdma_write_support", default=False)
    if forced_by_env:
        return CuFileMode("compat", "CUFILE_FORCE_COMPAT_MODE is set", True, path, weka_compat)
    if forced_by_config:
        return CuFileMode("compat", f"{path} sets force_compat_mode", True, path, weka_compat)
    if not nvidia_fs_loaded(root):
        if not allow:
            return CuFileMode(
                "compat",
                f"the nvidia-fs kernel driver is not loaded and {path} sets "
                "allow_compat_mode to false, so cuFile can do no I/O",
                False,
                path,
                weka_compat,
            )
        return CuFileMode(
            "compat", "the nvidia-fs kernel driver is not loaded", True, path, weka_compat
        )
    return CuFileMode("gds", "the nvidia-fs kernel driver is loaded", True, path, weka_compat)


def mount_of(path: str, mounts: str = "/proc/mounts") -> tuple[str, str] | None:
    """``(mount point, filesystem type)`` of the filesystem holding ``path`` (which need not
    exist yet: its nearest existing parent counts), from ``mounts``; None if unreadable."""
    target = os.path.realpath(path)
    try:
        with open(mounts, encoding="utf-8", errors="replace") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return None
    best: tuple[str, str] | None = None
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = _OCTAL_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), fields[1])
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[0])):
            best = (point, fields[2])
    return best


class GdsUnavailable(ConfigError):
    """``gds://`` cannot run on this machine (no CUDA GPU, no cuFile, cuFile refuses I/O)."""


def unavailable(url: BackendURL, cause: str) -> GdsUnavailable:
    """The error that ``url`` cannot open for ``cause``, with what the scheme needs."""
    return GdsUnavailable(
        f"{url} cannot open: {cause.rstrip('. ')}. {url.scheme}:// needs a CUDA GPU, "
        "NVIDIA's cuFile library (libcufile) and cufile-python (pip install "
        "'kvplug-disk[gds]'); see "
        "docs/gds.md. For a disk tier on a machine without a GPU, use file:///dir instead."
    )


def udev_hint(path: str, error: CuFileError) -> str:
    """How to let cuFile use files of ``path`` when it refused one with ``error`` for want of
    a udev record; empty for other errors."""
    hint = ""
    if error.code == 5027:
        try:
            device = os.stat(path).st_dev
            record = f"/run/udev/data/b{os.major(device)}:{os.minor(device)}"
        except OSError:
            record = "/run/udev/data/b<major>:<minor>"
        hint = (
            " cuFile looks the file's block device up in the udev database; on machines "
            "without one (containers, some VMs) it refuses every file. Give it the record "
            f"(as root): mkdir -p /run/udev/data && printf 'E:ID_FS_USAGE=filesystem\\n"
            f"E:ID_FS_TYPE=ext4\\n' > {record} (with the real filesystem type); see "
            "docs/gds.md."
        )
    return hint


def libcufile_candidates() -> list[str]:
    """Versioned libcufile files in the usual places, to name in an error message."""
    patterns = [
        "/usr/local/cuda*/targets/*/lib/libcufile.so.*",
        "/usr/local/cuda*/lib64/libcufile.so.*",
        "/usr/lib/x86_64-linux-gnu/libcufile.so.*",
    ]
    try:
        import nvidia.cufile  # type: ignore[import-not-found, unused-ignore]

        patterns += [f"{p}/lib/libcufile.so.*" for p in nvidia.cufile.__path__]
    except ImportError:
        pass
    found: list[str] = []
    for pattern in patterns:
        found += sorted(glob.glob(pattern))  # noqa: PTH207 - absolute patterns
    return found[:3]


__all__ = [
    "DEFAULT_CONFIG",
    "CuFileMode",
    "GdsUnavailable",
    "detect_mode",
    "libcufile_candidates",
    "mount_of",
    "nvidia_fs_loaded",
    "read_cufile_config",
    "strip_json_comments",
    "udev_hint",
    "unavailable",
]
