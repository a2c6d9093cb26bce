"""GPUDirect Storage for the disk engine: ``gds:///dir`` and ``weka:///dir``.

:class:`~kvplug_disk.gds.backend.GdsBackend` is :class:`~kvplug_disk.backend.DiskBackend` with
payloads moved by :class:`~kvplug_disk.fileio.CuFileIO` and its scheme,
:class:`~kvplug_disk.gds.scheme.GdsScheme`: what only GPUDirect needs, the environment check
(:mod:`kvplug_disk.gds.environment`), buffer registration, pinned staging, the tier's own GPU
buffer, ``shard=by_gpu`` and WekaFS mount checks (options: :mod:`kvplug_disk.gds.options`).
Importing this package loads neither cufile-python nor libcufile; opening a backend does.
"""

from __future__ import annotations
