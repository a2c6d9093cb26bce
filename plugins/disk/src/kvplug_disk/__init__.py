"""kvplug-disk: the local-file tiers. ``file:///dir`` (or ``file:///nvme0/kv,/nvme1/kv``) moves
payloads with POSIX I/O; ``gds:///dir`` and ``weka:///dir`` move them with NVIDIA cuFile
(GPUDirect Storage, ``pip install 'kvplug-disk[gds]'``). One engine serves all three.

Public API, versioned with the distribution:

* :class:`DiskBackend` and :class:`DiskOptions` (``file://``; :mod:`kvplug_disk.backend`);
* :class:`GdsBackend`, :class:`WekaBackend`, :class:`GdsOptions`, :class:`WekaOptions` and
  :class:`GdsUnavailable` (:mod:`kvplug_disk.gds`);
* :class:`FileIO`, :class:`Payload`, :class:`PosixFileIO` and :class:`CuFileIO`, the seam
  payloads move through (:mod:`kvplug_disk.fileio`);
* :class:`WriteRefused`, the file layout (:mod:`kvplug_disk.layout`) and what the engine
  trusts on disk (:mod:`kvplug_disk.fileops`: nothing).

Every other module is internal. Names are imported on first use, so the plugin entry point
stays light and nothing here loads cuFile until a ``gds://`` or ``weka://`` URL is opened.
"""

from __future__ import annotations

import importlib.metadata
from typing import TYPE_CHECKING

from kvplug.lazy import lazy_exports

if TYPE_CHECKING:
    from kvplug_disk.backend import DiskBackend
    from kvplug_disk.fileio import CuFileIO, FileIO, Payload, PosixFileIO
    from kvplug_disk.fileops import WriteRefused
    from kvplug_disk.gds.backend import (
        GdsBackend,
        GdsOptions,
        GdsUnavailable,
        WekaBackend,
        WekaOptions,
    )
    from kvplug_disk.options import DiskOptions

__version__ = importlib.metadata.version("kvplug-disk")


__getattr__ = lazy_exports(
    __name__,
    {
        "kvplug_disk.backend": ("DiskBackend",),
        "kvplug_disk.options": ("DiskOptions",),
        "kvplug_disk.fileops": ("WriteRefused",),
        "kvplug_disk.fileio": ("FileIO", "Payload", "PosixFileIO", "CuFileIO"),
        "kvplug_disk.gds.backend": (
            "GdsBackend",
            "GdsOptions",
            "GdsUnavailable",
            "WekaBackend",
            "WekaOptions",
        ),
    },
)


__all__ = [
    "CuFileIO",
    "DiskBackend",
    "DiskOptions",
    "FileIO",
    "GdsBackend",
    "GdsOptions",
    "GdsUnavailable",
    "Payload",
    "PosixFileIO",
    "WekaBackend",
    "WekaOptions",
    "WriteRefused",
    "__version__",
]
