"""Builds and loads kvplug's CUDA copy kernel (the sources in ``csrc/``) on first use.

Nothing is compiled at import, so this module imports on machines without CUDA. The first
:func:`load_kernel` in a process compiles the sources with
:func:`torch.utils.cpp_extension.load` (``-O3``, for the GPUs torch sees) and imports the
result; later calls return the same module. The build lands in torch's extension directory
(``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``) under a name that holds a
hash of the sources and of the torch and CUDA versions, so other processes reuse it and edited
sources build anew. A first build takes about 25 seconds.

The sources are looked up in the installed package (``kvplug/csrc``, where a wheel puts them)
and then in the repository's ``csrc/`` (an editable install).

The module's one function is::

    transfer(chunk, plane_pointers, slot_mapping, slot_stride_bytes, vec_bytes, to_chunk)

which moves every plane and layer of one chunk in one launch on the current CUDA stream (see
``csrc/kvplug_copy.h``); :func:`kvplug.runtime.gpu.gather` and :func:`kvplug.runtime.gpu.scatter`
call it.

Example::

    >>> from kvplug.runtime.gpu.kernel import kernel_sources
    >>> sorted(path.name for path in kernel_sources().iterdir() if path.suffix in {".cu", ".h"})
    ['kvplug_copy.cu', 'kvplug_copy.h']
"""

from __future__ import annotations

import hashlib
import threading
import warnings
from pathlib import Path
from types import ModuleType

from kvplug.errors import KvplugError

SOURCE_FILES = ("kvplug_copy.h", "kvplug_copy.cu", "binding.cpp")
"""Every file of ``csrc/`` the kernel is built from (all of them go into the build's hash)."""
_COMPILED = ("binding.cpp", "kvplug_copy.cu")
_OUTPUT_TAIL_LINES = 40
_OUTPUT_TAIL_CHARS = 8000


class KernelBuildError(KvplugError):
    """kvplug's CUDA copy kernel could not be built or loaded.

    The message names the cause (no CUDA build of torch, no CUDA toolkit, a compiler error with
    the tail of the compiler's output) and the fix. ``impl="torch"`` needs no kernel.
    """


_lock = threading.Lock()
_loaded: dict[Path, ModuleType | str] = {}
_default_module: ModuleType | None = None


def kernel_sources() -> Path:
    """The directory holding the kernel's sources: the package's ``csrc`` or the repository's.

    Raises :class:`KernelBuildError` when neither exists (an installation without them).
    """
    package = Path(__file__).resolve().parents[2]  # .../kvplug (this file: kvplug/runtime/gpu/)
    candidates = [package / "csrc"]
    if len(package.parents) > 2:
        candidates.append(package.parents[2] / "csrc")  # <repo>/core/src/kvplug -> <repo>/csrc
    for candidate in candidates:
        if all((candidate / name).is_file() for name in SOURCE_FILES):
            return candidate
    looked = ", ".join(str(c) for c in candidates)
    raise KernelBuildError(
        f"kvplug's CUDA kernel sources ({', '.join(SOURCE_FILES)}) are not installed: looked in "
        f"{looked}. Reinstall kvplug from its wheel or repository, or use impl='torch'."
    )


def load_kernel(sources: Path | None = None) -> ModuleType:
    """The compiled copy kernel, built on the first call in this process (thread-safe).

    ``sources`` overrides the directory of the sources (tests use it); by default
    :func:`kernel_sources`. A failure is remembered: later calls in this process raise the
    same :class:`KernelBuildError` at once instead of compiling again. Once the default kernel
    has loaded, a call costs a global lookup (gather and scatter call it on every copy).
    """
    global _default_module
    if sources is None and _default_module is not None:
        return _default_module
    directory = (sources if sources is not None else kernel_sources()).resolve()
    with _lock:
        loaded = _loaded.get(directory)
        if loaded is None:
            try:
                loaded = _build(directory)
            except KernelBuildError as error:
                loaded = str(error)
            _loaded[directory] = loaded
    if isinstance(loaded, str):
        raise KernelBuildError(loaded)
    if sources is None:
        _default_module = loaded
    return loaded


def build_name(directory: Path) -> str:
    """The extension's module name: ``kvplug_copy_`` and a hash of sources and versions."""
    import torch

    digest = hashlib.sha256()
    digest.update(f"torch {torch.__version__} cuda {torch.version.cuda}\n".encode())
    for name in SOURCE_FILES:
        digest.update(name.encode() + b"\0")
        digest.update((directory / name).read_bytes())
        digest.update(b"\0")
    return f"kvplug_copy_{digest.hexdigest()[:16]}"


def _fix(cuda_version: str | None) -> str:
    toolkit = f"CUDA {cuda_version}" if cuda_version else "the CUDA version of your torch build"
    return (
        f"Fix: install the CUDA toolkit (nvcc) matching torch's {toolkit} and point CUDA_HOME "
        "at it (ninja and a C++ compiler are needed too), or use impl='torch', which gives the "
        "same bytes without the kernel."
    )


def _tail(text: str) -> str:
    lines = text.strip().splitlines()[-_OUTPUT_TAIL_LINES:]
    return "\n".join(lines)[-_OUTPUT_TAIL_CHARS:]


def _build(directory: Path) -> ModuleType:
    import torch

    missing = [name for name in SOURCE_FILES if not (directory / name).is_file()]
    if missing:
        raise KernelBuildError(
            f"kvplug's CUDA kernel sources are incomplete in {directory}: missing "
            f"{', '.join(missing)}. Reinstall kvplug, or use impl='torch'."
        )
    cuda_version = torch.version.cuda
    if cuda_version is None:
        raise KernelBuildError(
            f"kvplug's CUDA copy kernel cannot be built: torch {torch.__version__} is a build "
            "without CUDA. Install a CUDA build of torch, or use impl='torch'."
        )
    try:
        from torch.utils import cpp_extension
    except Exception as error:  # setuptools or another build dependency is missing
        raise KernelBuildError(
            f"kvplug's CUDA copy kernel cannot be built: torch.utils.cpp_extension does not "
            f"import ({type(error).__name__}: {error}). Install setuptools. {_fix(cuda_version)}"
        ) from error
    if cpp_extension.CUDA_HOME is None:
        raise KernelBuildError(
            "kvplug's CUDA copy kernel cannot be built: no CUDA toolkit found (CUDA_HOME is "
            f"unset and no nvcc on PATH). {_fix(cuda_version)}"
        )
    name = build_name(directory)
    try:
        with warnings.catch_warnings():
            # Building for the GPUs present is what kvplug wants; TORCH_CUDA_ARCH_LIST still
            # overrides it for a build meant for other machines.
            warnings.filterwarnings("ignore", message="TORCH_CUDA_ARCH_LIST is not set")
            module = cpp_extension.load(
                name=name,
                sources=[str(directory / source) for source in _COMPILED],
                extra_include_paths=[str(directory)],
                extra_cflags=["-O3"],
                extra_cuda_cflags=["-O3", "-lineinfo"],
                verbose=False,
            )
    except Exception as error:  # compiler errors come as RuntimeError, a bad .so as ImportError
        raise KernelBuildError(
            f"kvplug's CUDA copy kernel failed to build from {directory} with nvcc from "
            f"{cpp_extension.CUDA_HOME} ({type(error).__name__}). Compiler output (last lines):"
            f"\n{_tail(str(error))}\n{_fix(cuda_version)}"
        ) from error
    if not isinstance(module, ModuleType) or not hasattr(module, "transfer"):
        raise KernelBuildError(
            f"kvplug's CUDA copy kernel {name} loaded but has no transfer function; remove its "
            f"build directory under torch's extension root and retry. {_fix(cuda_version)}"
        )
    return module


__all__ = ["SOURCE_FILES", "KernelBuildError", "build_name", "kernel_sources", "load_kernel"]
