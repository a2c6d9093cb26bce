"""Test and benchmark support, not for serving: a real SGLang engine (``sglang.Engine``, its
offline engine) on a CPU-only machine with kvplug as HiCache L3, in a process of its own,
driven by JSON lines, for ``integrations/sglang/tests/test_engine.py``.

``python -m kvplug_sglang.testing_engine MODEL_DIR ENGINE_JSON`` starts ``sglang.Engine`` on
``MODEL_DIR`` (see :func:`kvplug_testing.models.build_random_llama`) with the keyword arguments
``ENGINE_JSON`` (a JSON object, e.g. ``{"enable_hierarchical_cache": true, ...}``),
``device="cpu"`` and ``skip_tokenizer_init``, after :func:`install_cpu_shims`. It speaks
:mod:`kvplug_testing.engine_process`'s protocol (a ready line, or the failed start's error with
SGLang's own log on stderr; then one JSON answer a command read from stdin, ``{"error": ...,
"type": ...}`` for a failed one), with these ops:

- ``{"op": "generate", "prompt": [token ids], "max_tokens": 8}``: greedy, streamed;
  ``tokens`` (the output ids), ``ttft`` (seconds to the first streamed chunk), ``seconds``
  (the whole call), ``cached`` and ``cached_details`` (SGLang's ``cached_tokens`` and
  ``cached_tokens_details``: where the prefix came from, ``device``, ``host`` or ``storage``).
- ``{"op": "flush"}``: ``flush_cache()`` (the device and host caches; L3 keeps its pages).
- ``{"op": "exit"}``.

:class:`EngineProcess` runs one from Python.

**What SGLang 0.5.23 lacks on a CPU machine** (its ``--device cpu`` path serves a model with
the torch-native attention backend, but HiCache on it is written for accelerators).
:func:`install_cpu_shims` replaces exactly these, pinned to :data:`SHIMMED_SGLANG` and checked
at install, so that a SGLang release that fixes or moves one fails loudly here:

1. ``sgl_kernel``: the CPU build of sgl-kernel is not on the package index (``sglang-kernel``
   0.4.10 is a CUDA wheel, no sdist), and ``sglang/kernels/ops/kvcache/cache_move.py`` (line
   10), ``sglang/srt/mem_cache/memory_pool.py`` and others import names from it at module level
   when ``SGLANG_USE_CPU_ENGINE=1``. The torch-native path never calls them (its AMX kernels
   are used only when ``sgl_kernel`` has ``convert_weight_packed``); a placeholder module makes
   the imports succeed and any call fail, naming the op.
2. Pinned host memory: the HiCache host pool's buffer is registered with ``cudaHostRegister``
   (``sglang/srt/mem_cache/pool_host/common.py``, ``_cuda_host_register``, line 147:
   ``torch.cuda.cudart()`` raises "Torch not compiled with CUDA enabled"). The shim allocates it
   as plain memory.
3. Device <-> host copies: ``sglang/srt/mem_cache/pool_host/mha.py`` imports its transfer ops
   only on CUDA, HIP, XPU and NPU (line 60), so ``backup_from_device_all_layer`` raises
   ``NameError`` on CPU. The shim gives it the ``direct`` I/O backend's three ops as torch index
   copies (``--hicache-io-backend direct`` with ``layer_first`` or ``page_first_direct``).

Plus a placeholder ``torchvision`` (PyPI's does not load beside the CPU build of torch;
SGLang's model-config package imports it for vision models).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import time
import types
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from kvplug_testing import engine_process
from kvplug_testing.engine_process import Handler, module_argv, serve

SHIMMED_SGLANG = "0.5.23"
"""The SGLang release whose CPU gaps :func:`install_cpu_shims` was written for and checked
against."""
START_TIMEOUT = 420.0
"""Seconds an engine may take to start on a busy 2-core machine."""

# The engine processes run SGLang on the CPU, keep off any model hub and report nothing anywhere.
ENGINE_ENVIRONMENT = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "DO_NOT_TRACK": "1",
    "SGLANG_USE_CPU_ENGINE": "1",
}


class _PlaceholderModule(types.ModuleType):
    """A module whose every attribute is a further placeholder (``torchvision``) or an op
    that fails when called (``sgl_kernel``)."""

    def __init__(self, name: str, *, ops: bool) -> None:
        super().__init__(name)
        self._ops = ops

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if not self._ops:
            return _PlaceholderModule(f"{self.__name__}.{name}", ops=False)
        qualified = f"{self.__name__}.{name}"

        def missing(*args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError(
                f"{qualified} was called, but sgl-kernel's CPU build is not installed: kvplug's "
                "SGLang CPU test shim serves only its imports (kvplug_sglang.testing_engine)."
            )

        missing.__qualname__ = missing.__name__ = name
        return missing


class _Placeholders(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves a placeholder module for ``package`` (of ops that fail when called, where
    ``ops``), and for its submodules unless ``ops``: SGLang falls back by itself where a
    submodule of sgl_kernel does not import (``sgl_kernel.scalar_type``)."""

    def __init__(self, package: str, *, ops: bool) -> None:
        self._package = package
        self._ops = ops

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        top = fullname.partition(".")[0]
        if top != self._package or (self._ops and fullname != top):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _PlaceholderModule(spec.name, ops=self._ops)

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def serve_torchvision_placeholders_if_needed() -> None:
    """Where ``torchvision`` does not load (PyPI's, beside the CPU build of torch), serve an
    empty placeholder for it: SGLang's host pools and model configs import it at module level
    for vision models, and nothing on a text model's path calls it; any call fails loudly."""
    try:
        importlib.import_module("torchvision")
    except Exception:
        for name in [n for n in sys.modules if n.partition(".")[0] == "torchvision"]:
            del sys.modules[name]
        from transformers.utils.import_utils import is_torchvision_available

        # transformers caches this answer; let it learn the truth (absent) before the
        # placeholder exists, or it reads the placeholder's missing version and fails.
        is_torchvision_available()
        sys.meta_path.insert(0, _Placeholders("torchvision", ops=False))


def _transfer_kv_direct(
    src_layers: Sequence[Any],
    dst_layers: Sequence[Any],
    src_indices: Any,
    dst_indices: Any,
    page_size: int,
) -> None:
    """``layer_first``: token rows of each layer, device to host or back."""
    for source, destination in zip(src_layers, dst_layers, strict=True):
        destination[dst_indices] = source[src_indices]


def _transfer_kv_all_layer_direct_lf_pf(
    src_ptrs: Sequence[Any],
    dst_ptrs: Sequence[Any],
    src_indices: Any,
    dst_indices: Any,
    page_size: int,
) -> None:
    """Device layers (every K layer, then every V layer) into ``page_first_direct`` host pages
    (``[page, layer, token, head, dim]`` for K, then for V)."""
    layers = len(src_ptrs) // len(dst_ptrs)
    pages = dst_indices[::page_size] // page_size
    rows = src_indices.view(-1, page_size)
    for part, destination in enumerate(dst_ptrs):
        for layer in range(layers):
            destination[pages, layer] = src_ptrs[part * layers + layer][rows]


def _transfer_kv_per_layer_direct_pf_lf(
    src_ptrs: Sequence[Any],
    dst_ptrs: Sequence[Any],
    src_indices: Any,
    dst_indices: Any,
    layer_id: int,
    page_size: int,
) -> None:
    """One layer of ``page_first_direct`` host pages (K, V) into the device layer."""
    pages = src_indices[::page_size] // page_size
    rows = dst_indices.view(-1, page_size)
    for source, destination in zip(src_ptrs, dst_ptrs, strict=True):
        destination[rows] = source[pages, layer_id]


def _plain_host_memory(
    dims: tuple[int, ...],
    dtype: Any,
    device: str,
    pin_memory: bool,
    allocator: Any,
    registration_granularity_bytes: int | None = None,
) -> Any:
    return allocator.allocate(dims, dtype=dtype, device=device)


_CPU_TRANSFER_OPS = {
    "transfer_kv_direct": _transfer_kv_direct,
    "transfer_kv_all_layer_direct_lf_pf": _transfer_kv_all_layer_direct_lf_pf,
    "transfer_kv_per_layer_direct_pf_lf": _transfer_kv_per_layer_direct_pf_lf,
}


def install_cpu_shims() -> None:
    """Make SGLang :data:`SHIMMED_SGLANG` run HiCache on a CPU device (the three points in
    the module documentation); raise ``RuntimeError`` naming the point where this SGLang
    differs from what the shim was written for. Call before anything imports SGLang's engine,
    in every engine process (the driver does, at import)."""
    serve_torchvision_placeholders_if_needed()
    if importlib.util.find_spec("sgl_kernel") is None:
        sys.meta_path.insert(0, _Placeholders("sgl_kernel", ops=True))
    from importlib.metadata import version

    installed = version("sglang")
    if installed != SHIMMED_SGLANG:
        raise RuntimeError(
            f"kvplug's SGLang CPU test shims were written for SGLang {SHIMMED_SGLANG} and "
            f"SGLang {installed} is installed: check each point in kvplug_sglang.testing_engine's "
            "documentation against this release, then update SHIMMED_SGLANG."
        )
    from sglang.srt.mem_cache.pool_host import common, mha

    if "cpu" in common.ALLOC_MEMORY_FUNCS or (
        common.ALLOC_MEMORY_FUNCS["cpu"] is not common.alloc_with_host_register
    ):
        raise RuntimeError(
            "SGLang's host pools no longer register CPU memory with cudaHostRegister "
            "(pool_host/common.py ALLOC_MEMORY_FUNCS): drop shim 2 of kvplug_sglang.testing_engine."
        )
    common.ALLOC_MEMORY_FUNCS["cpu"] = _plain_host_memory
    present = sorted(name for name in _CPU_TRANSFER_OPS if hasattr(mha, name))
    if present:
        raise RuntimeError(
            f"SGLang's pool_host/mha.py now has {', '.join(present)} on CPU: drop shim 3 of "
            "kvplug_sglang.testing_engine."
        )
    for name, op in _CPU_TRANSFER_OPS.items():
        setattr(mha, name, op)


def kvplug_extra_config(url: str, **more: Any) -> str:
    """``--hicache-storage-backend-extra-config`` for kvplug at ``url``, as JSON."""
    return json.dumps(
        {
            "backend_name": "kvplug",
            "module_path": "kvplug_sglang",
            "class_name": "KvplugHiCacheStorage",
            "interface_v1": 1,
            "url": url,
            **more,
        }
    )


def _generate(engine: Any, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    started = time.perf_counter()
    ttft = None
    last: dict[str, Any] = {}
    stream = engine.generate(
        input_ids=prompt,
        sampling_params={"max_new_tokens": max_tokens, "temperature": 0},
        stream=True,
    )
    for chunk in stream:
        if ttft is None:
            ttft = time.perf_counter() - started
        last = chunk
    meta = last["meta_info"]
    return {
        "tokens": last["output_ids"],  # each streamed chunk carries every id so far
        "ttft": ttft,
        "seconds": time.perf_counter() - started,
        "cached": meta["cached_tokens"],
        "cached_details": meta.get("cached_tokens_details"),
    }


@contextlib.contextmanager
def _engine(model_dir: str, engine_kwargs: dict[str, Any]) -> Iterator[dict[str, Handler]]:
    import sglang

    engine = sglang.Engine(
        model_path=model_dir,
        device="cpu",
        skip_tokenizer_init=True,
        disable_cuda_graph=True,
        **engine_kwargs,
    )
    try:
        yield {
            "flush": lambda command: {"flushed": bool(engine.flush_cache().success)},
            "generate": lambda command: _generate(
                engine, command["prompt"], command.get("max_tokens", 8)
            ),
        }
    finally:
        engine.shutdown()


class EngineProcess(engine_process.EngineProcess):
    """``python -m kvplug_sglang.testing_engine`` as a child process
    (:class:`kvplug_testing.engine_process.EngineProcess`: its own session, killed on close,
    with every process SGLang starts), with :data:`ENGINE_ENVIRONMENT`; its stderr (SGLang's
    log) goes to ``log``.

    Example::

        with EngineProcess(model_dir, {"enable_hierarchical_cache": True, ...}, log) as engine:
            answer = engine.ask({"op": "generate", "prompt": [1, 2, 3], "max_tokens": 4})
    """

    def __init__(
        self, model_dir: str | os.PathLike[str], engine_kwargs: dict[str, Any], log: Path
    ) -> None:
        super().__init__(
            module_argv("kvplug_sglang.testing_engine", model_dir, json.dumps(engine_kwargs)),
            log=log,
            env=ENGINE_ENVIRONMENT,
            start_timeout=START_TIMEOUT,
        )


__all__ = [
    "ENGINE_ENVIRONMENT",
    "SHIMMED_SGLANG",
    "START_TIMEOUT",
    "EngineProcess",
    "install_cpu_shims",
    "kvplug_extra_config",
    "serve_torchvision_placeholders_if_needed",
]

if __name__ in ("__main__", "__mp_main__") and os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
    install_cpu_shims()  # in the driver and in every process SGLang spawns from it

if __name__ == "__main__":
    sys.exit(serve(lambda: _engine(sys.argv[1], json.loads(sys.argv[2]))))
