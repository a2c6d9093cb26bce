"""The GPUDirect Storage tier, ``gds:///dir`` and ``weka:///dir``: KV-cache chunks moved by
cuFile straight between GPU memory and files.

URL and options (query parameters or keyword options, keywords win)::

    gds:///mnt/nvme/kv?max_size=500GiB
    gds:///mnt/nvme0/kv,/mnt/nvme1/kv?shard=by_gpu      # one directory per GPU
    weka:///mnt/weka/kv                                  # a WekaFS mount, checked at open

Everything ``file://`` takes (``paths``, ``max_size``, ``eviction``, ``pin_ttl``, ``o_direct``,
``fsync``, ``workers``, ``queue_depth``, ``allow_shared_dir``, ``timeout``; see
:mod:`kvplug_disk.backend`), and:

* ``shard``: ``hash`` (default; by key digest, as ``file://``) or ``by_gpu`` (every object of
  this backend goes to directory ``device index % number of directories``, LMCache's
  ``gds_path_sharding``). Reads look in every directory, so either way all objects are found.
* ``device``: the GPU of the tier's own buffer and of ``shard=by_gpu``: ``cuda`` (the current
  device at open) or ``cuda:N``.
* ``buffer_size``: bytes of GPU memory ``get`` allocates results from when no allocator is
  given (default 1 GiB); the buffer is registered with cuFile once (LMCache's
  ``cufile_buffer_size``).
* ``gpu_checksum``: also checksum payloads that live in GPU memory (default false; see
  *Checksums* below).
* ``register_buffers``: register the memory objects come from with cuFile, once per
  allocator buffer (default true).
* ``weka://`` only: ``allow_non_weka`` (default false).

The file format, index, eviction, pins and crash safety are ``file://``'s (this class extends
:class:`~kvplug_disk.backend.DiskBackend`); what differs is declared, never overridden: the
payloads move through :class:`~kvplug_disk.fileio.CuFileIO`, and the rest is the scheme's
(:mod:`kvplug_disk.gds.scheme`). See :class:`GdsBackend`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

from kvplug.errors import BackendError
from kvplug.memory import Allocator
from kvplug.options import BackendOptions
from kvplug_disk.backend import DiskBackend
from kvplug_disk.gds.environment import GdsUnavailable
from kvplug_disk.gds.options import DEFAULT_BUFFER_SIZE, GdsOptions, WekaOptions
from kvplug_disk.gds.scheme import STAGING_POOL_SIZE, TEMP_GRACE, GdsScheme, WekaScheme
from kvplug_disk.scheme import DiskScheme


class GdsBackend(DiskBackend):
    """A persistent, shared store of memory objects in files, moved by cuFile (GPUDirect
    Storage) straight between GPU memory and the files.

    **Files** are ``file://``'s (:mod:`kvplug_disk.layout`): ``<dir>/<2 hex>/<xxh3-128 of the
    key>.kv``, a 4096-byte header block (kvplug's frame header: format, dtype, shape, payload
    length and checksum; the key; a checksum of the block) and the payload from offset 4096,
    padded to whole blocks. A put writes a temporary file and renames it into place, so no
    reader ever sees a half-written object under an object name. ``file://`` and ``gds://``
    read each other's files.

    **Data movement.** Payloads go through one :class:`~kvplug_disk.fileio.FileIO`, the real
    one being :class:`~kvplug_disk.fileio.CuFileIO` (cufile-python): ``cuFileWrite`` and
    ``cuFileRead`` at file offset 4096 straight from and into the object's own memory when it
    is GPU memory or pinned host memory in a 4096-aligned :class:`FreeListAllocator` block;
    each such allocator buffer is registered with cuFile once. By default ``get`` allocates its
    results in the tier's own GPU buffer (``buffer_size`` bytes on ``device``, registered), so
    the capability ``device_memory`` is declared. Anything else (pageable host memory, tensors
    not from an aligned allocator) is staged through a pinned, registered host pool. The
    header block is read and written with plain ``pread``/``pwrite``. cuFile does not follow
    CUDA streams, so a put or get waits for the object's GPU to finish its queued work
    (``torch.cuda.synchronize``) before cuFile touches the memory.

    **Checksums.** The frame header's payload checksum is xxh3 over host bytes.

    * Payloads in host memory (pinned objects, staged ones) are checksummed when written (the
      hash runs while cuFile writes) and verified on every read into host memory.
    * Payloads in GPU memory are written with header flag ``FLAG_NO_PAYLOAD_CHECKSUM`` and no
      checksum, unless ``gpu_checksum=true``, which copies each payload to the host to hash
      it on write and to verify it on read (slower).
    * Always checked, whatever the memory: the header block's checksum, the frame header's
      checksum, the key inside the file, the file length against the header's payload length,
      and that cuFile read exactly that many bytes. With the temporary-file-and-rename writes,
      a torn, truncated, renamed or half-written object is never served.
    * Not detected for GPU payloads without ``gpu_checksum``: payload bytes changed in place
      at the same length (media corruption, another program writing into the file, or blocks
      lost in a power failure when ``fsync`` is false).

    Damage found reads as a miss, is counted in :attr:`corrupt_objects` and the file is
    removed.

    **Sharing.** Several instances (processes, hosts on a shared mount) may use one directory:
    each rebuilds its index from the files at open, and ``get``, ``contains``, ``remove`` and
    ``pin`` of a key not in the index look for its file, so objects written by another instance
    after open are found; ``contains`` of an indexed key checks that its file is still there.
    A read whose file a writer replaced between its open and cuFile's registration (cuFile
    refuses deleted files) reads the file there now through a hard link of its own.
    Capability ``shared_across_processes`` is declared. ``max_size`` and eviction act on what
    this instance knows: give every instance on a directory the same ``max_size``. Temporary
    files of writers not running on this host are deleted at open only once they are older
    than :data:`TEMP_GRACE`.

    **Compatibility mode.** Without the nvidia-fs driver (or when ``cufile.json`` forces it)
    cuFile does POSIX I/O through host bounce buffers. :attr:`mode` (``"gds"`` or
    ``"compat"``) and :attr:`mode_reason` say which, detected once at open and logged once per
    process; ``kvplug check`` prints them.

    **Cancellation.** ``releases_on_cancel`` is declared, as for ``file://``: a put reaches
    the caller's memory only inside its lease (each ``cuFileWrite``, staging copy and checksum;
    cuFile's calls return once their bytes have moved), and ``get_into`` reads into the tier's
    own memory, then copies into the destination on the caller's event loop.

    Without a CUDA GPU or without cuFile, opening raises :class:`GdsUnavailable` (a
    :class:`~kvplug.errors.ConfigError`) naming what is missing. A disk too full at open to
    write the cuFile check's block is logged and opened anyway (that says nothing about
    cuFile).

    ``file_io=`` replaces cuFile; only the CPU tests pass one (a POSIX FileIO that moves each
    payload on its own, as cuFile does), and the rest of the scheme runs around it.
    """

    capabilities = replace(DiskBackend.capabilities, device_memory=True)
    Options: ClassVar[type[BackendOptions]] = GdsOptions
    Scheme: ClassVar[type[DiskScheme]] = GdsScheme
    options: GdsOptions
    scheme: GdsScheme

    @property
    def mode(self) -> str:
        """``"gds"``, ``"compat"`` (cuFile's compatibility mode), or the stand-in's name."""
        return self.scheme.mode

    @property
    def mode_reason(self) -> str:
        """Why :attr:`mode` is what it is."""
        return self.scheme.mode_reason

    @property
    def device_index(self) -> int | None:
        """The GPU of the tier's own buffer and of ``shard=by_gpu`` (resolved at open)."""
        return self.scheme.device_index

    @property
    def fstypes(self) -> dict[str, str]:
        """Filesystem type of each directory, from /proc/mounts."""
        return self.scheme.fstypes

    @property
    def allocator(self) -> Allocator:
        """Where ``get`` allocates: the allocator given, else the tier's own GPU buffer of
        ``buffer_size`` bytes on ``device``, created on first use."""
        if self._allocator is None:
            self._allocator = self.scheme.own_buffer()
        return self._allocator

    def describe(self) -> dict[str, str]:
        """What ``kvplug check`` prints: how payloads move and where."""
        try:
            io = self.io.name
        except BackendError:
            io = "not opened"
        return {
            "io": io,
            "mode": self.mode,
            "mode reason": self.mode_reason,
            "directories": "; ".join(
                f"{d.describe()} on {self.fstypes.get(d.path, '?')}" for d in self.directories
            ),
            "shard": self.options.shard,
            "device": f"cuda:{self.device_index}" if self.device_index is not None else "?",
        }


class WekaBackend(GdsBackend):
    """``weka:///dir``: :class:`GdsBackend` on a WekaFS mount.

    What differs from ``gds://``:

    * each directory must be on a filesystem of type ``wekafs`` (from ``/proc/mounts``, the
      longest mount point holding it); anything else is refused at open unless
      ``allow_non_weka=true`` (tests, staging machines);
    * O_DIRECT is required: WekaFS takes GPUDirect I/O on O_DIRECT files only, and buffered
      I/O there goes through the page cache, so ``o_direct=false`` or a directory refusing
      O_DIRECT is an error instead of a fallback;
    * the mode reports whether writes to WekaFS use cuFile's compatibility mode, which
      cufile.json's ``fs.weka.rdma_write_support`` (default false) decides.
    """

    Options: ClassVar[type[BackendOptions]] = WekaOptions
    Scheme: ClassVar[type[DiskScheme]] = WekaScheme
    options: WekaOptions
    scheme: WekaScheme


__all__ = [
    "DEFAULT_BUFFER_SIZE",
    "STAGING_POOL_SIZE",
    "TEMP_GRACE",
    "GdsBackend",
    "GdsOptions",
    "GdsUnavailable",
    "WekaBackend",
    "WekaOptions",
]
