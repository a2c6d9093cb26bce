"""cuFile behind the :class:`~kvplug_disk.fileio.FileIO` seam: what ``gds://`` and ``weka://``
move payloads with.

:class:`CuFileIO` works over cufile-python (``pip install 'kvplug-disk[gds]'``), which calls
NVIDIA's ``libcufile.so`` through ctypes. Keeping cuFile behind this small class leaves the
rest of the engine (file format, index, sharding, error handling) testable on machines without
a GPU, against a POSIX FileIO that takes the same per-payload path (the tests' stand-in).

Buffers are flat ``uint8`` tensors. A buffer inside a region registered with
:meth:`FileIO.register` is passed to cuFile as that region's base pointer plus an offset, as
cuFile requires for registered memory; any other buffer as its own pointer (cuFile then uses
its internal bounce buffers for GPU memory).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import re
from typing import Any, ClassVar

import torch

from kvplug.errors import ConfigError
from kvplug_disk.fileio.base import FileIO, _Region

_CUFILE_CODE = re.compile(r"err=(-?\d+)")
CUFILE_ERRORS: dict[int, str] = {
    5001: "DRIVER_NOT_INITIALIZED",
    5002: "DRIVER_INVALID_PROPS",
    5003: "DRIVER_UNSUPPORTED_LIMIT",
    5004: "DRIVER_VERSION_MISMATCH",
    5005: "DRIVER_VERSION_READ_ERROR",
    5006: "DRIVER_CLOSING",
    5007: "PLATFORM_NOT_SUPPORTED",
    5008: "IO_NOT_SUPPORTED",
    5009: "DEVICE_NOT_SUPPORTED",
    5010: "NVFS_DRIVER_ERROR",
    5011: "CUDA_DRIVER_ERROR",
    5012: "CUDA_POINTER_INVALID",
    5013: "CUDA_MEMORY_TYPE_INVALID",
    5014: "CUDA_POINTER_RANGE_ERROR",
    5015: "CUDA_CONTEXT_MISMATCH",
    5016: "INVALID_MAPPING_SIZE",
    5017: "INVALID_MAPPING_RANGE",
    5018: "INVALID_FILE_TYPE",
    5019: "INVALID_FILE_OPEN_FLAG",
    5020: "DIO_NOT_SET",
    5022: "INVALID_VALUE",
    5023: "MEMORY_ALREADY_REGISTERED",
    5024: "MEMORY_NOT_REGISTERED",
    5025: "PERMISSION_DENIED",
    5026: "DRIVER_ALREADY_OPEN",
    5027: "HANDLE_NOT_REGISTERED",
    5028: "HANDLE_ALREADY_REGISTERED",
    5029: "DEVICE_NOT_FOUND",
    5030: "INTERNAL_ERROR",
    5031: "GETNEWFD_FAILED",
    5033: "NVFS_SETUP_ERROR",
    5034: "IO_DISABLED",
}
"""cuFile's status codes (``CU_FILE_*`` of cufile.h) by number, for error messages."""


class CuFileError(OSError):
    """A cuFile call failed. An OSError, so file-write failures are handled as for any other
    I/O error (nothing stored, no partial file left)."""

    def __init__(self, call: str, code: int | None, detail: str = "") -> None:
        name = CUFILE_ERRORS.get(code, "") if code is not None else ""
        shown = f"cuFile error {code}{f' ({name})' if name else ''}" if code else detail
        super().__init__(errno.EIO, f"{call} failed: {shown}")
        self.call = call
        self.code = code


def _signed(count: int) -> int:
    """cufile-python declares cuFileRead/Write as returning size_t; cuFile returns ssize_t
    (negative on error)."""
    return count - (1 << 64) if count >= 1 << 63 else count


def _code_of(error: BaseException) -> int | None:
    match = _CUFILE_CODE.search(str(error))
    return int(match.group(1)) if match else None


class CuFileIO(FileIO):
    """cuFile through cufile-python: GPU memory and pinned host memory to and from files.

    Creating one loads ``libcufile.so`` and opens the cuFile driver once per process (it stays
    open until the process ends, shared by every backend). Raises :class:`ConfigError` naming
    what is missing. Buffer registrations are process-wide, as cuFile's are, and counted per
    instance: a closing backend drops only its own.
    """

    name = "cufile"
    refuses_nofollow: ClassVar[bool] = True
    library: ClassVar[str] = "cuFile"
    library_errors: ClassVar[tuple[type[OSError], ...]] = (CuFileError,)
    _shared_table: ClassVar[dict[int, _Region] | None] = {}

    def __init__(self) -> None:
        super().__init__()
        try:
            from cufile import CuFileDriver, bindings
        except ImportError as error:
            raise ConfigError(
                "cufile-python is not installed, or imports a module it lacks "
                f"({error}). Install it: pip install 'kvplug-disk[gds]' (or "
                "pip install cufile-python)."
            ) from None
        except OSError as error:
            raise ConfigError(
                f"cufile-python could not load libcufile.so ({error}). Install NVIDIA's "
                "cuFile (the CUDA toolkit's libcufile, or pip install nvidia-cufile) and "
                "make 'libcufile.so' loadable: cufile-python asks for that exact name, so "
                "put a folder holding a link libcufile.so -> libcufile.so.<version> on "
                "LD_LIBRARY_PATH."
            ) from None
        try:
            CuFileDriver()
        except RuntimeError as error:
            raise ConfigError(
                f"the cuFile driver did not open ({error}). Check the GPU driver, "
                "/etc/cufile.json (allow_compat_mode) and cuFile's log (cufile.log)."
            ) from None
        self._bindings: Any = bindings

    def accepts(self, buffer: torch.Tensor) -> bool:
        return bool(buffer.is_cuda or buffer.is_pinned())

    def open(self, fd: int) -> Any:
        try:
            return self._bindings.cuFileHandleRegister(fd)
        except RuntimeError as error:
            raise CuFileError("cuFileHandleRegister", _code_of(error), str(error)) from None

    def close(self, handle: Any) -> None:
        self._bindings.cuFileHandleDeregister(handle)

    def _register_region(self, pointer: int, size: int) -> None:
        try:
            self._bindings.cuFileBufRegister(ctypes.c_void_p(pointer), size, 0)
        except RuntimeError as error:
            raise CuFileError("cuFileBufRegister", _code_of(error), str(error)) from None

    def _deregister_region(self, pointer: int) -> None:
        with contextlib.suppress(RuntimeError):  # nothing left to undo
            self._bindings.cuFileBufDeregister(ctypes.c_void_p(pointer))

    def _read(self, handle: Any, base: int, size: int, file_offset: int, offset: int) -> int:
        count = _signed(
            self._bindings.cuFileRead(handle, ctypes.c_void_p(base), size, file_offset, offset)
        )
        if count < 0:
            raise CuFileError("cuFileRead", -count if count < -1 else None, "errno set")
        return count

    def _write(self, handle: Any, base: int, size: int, file_offset: int, offset: int) -> int:
        count = _signed(
            self._bindings.cuFileWrite(handle, ctypes.c_void_p(base), size, file_offset, offset)
        )
        if count < 0:
            raise CuFileError("cuFileWrite", -count if count < -1 else None, "errno set")
        return count

    def driver_nvfs_version(self) -> tuple[int, int] | None:
        """The nvidia-fs driver version cuFile reports (``(0, 0)`` without the driver), from
        ``cuFileDriverGetProperties``; None when the call is unavailable or fails."""
        try:
            function = self._bindings.libcufile.cuFileDriverGetProperties
        except AttributeError:
            return None
        # CUfileDrvProps_t begins with nvfs.major_version and nvfs.minor_version (two unsigned
        # ints); the rest is not read, so a generous buffer covers every cuFile version.
        props = ctypes.create_string_buffer(1024)
        function.restype = self._bindings.CUfileError
        function.argtypes = [ctypes.c_void_p]
        status = function(ctypes.addressof(props))
        if status.err != 0:
            return None
        major, minor = (ctypes.c_uint * 2).from_buffer(props)
        return int(major), int(minor)


__all__ = ["CUFILE_ERRORS", "CuFileError", "CuFileIO"]
