"""kvplug-disk: the local-disk tier, ``file:///dir`` or ``file:///nvme0/kv,/nvme1/kv``.

See :class:`kvplug_disk.backend.DiskBackend`, :mod:`kvplug_disk.layout` (the file format) and
:mod:`kvplug_disk.fileops` (what it trusts on disk: nothing).
The backend is imported on first use, so the plugin entry point stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvplug_disk.backend import DiskBackend, DiskOptions
    from kvplug_disk.fileops import WriteRefused

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in ("DiskBackend", "DiskOptions", "WriteRefused"):
        from kvplug_disk import backend

        return getattr(backend, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["DiskBackend", "DiskOptions", "WriteRefused", "__version__"]
