"""Light imports: kvplug's names, hooks, errors, URLs and keys load without the heavy libraries.

A plugin module is imported at discovery by every process that uses kvplug, and tools (the CLI,
config checks) name keys and URLs without touching tensors, so these imports must not pull in
torch, numpy, pydantic or prometheus_client. Each case runs in a fresh interpreter, since this
test process has them all loaded already.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "numpy", "pydantic", "prometheus_client")

LIGHT_MODULES = [
    "kvplug",
    "kvplug.hookspecs",
    "kvplug.errors",
    "kvplug.url",
    "kvplug.keys",
    "kvplug.env",
    "kvplug.backend",
]

_PROBE = """
import json, sys
heavy = {heavy!r}
before = [name for name in heavy if name in sys.modules]
import {module}
after = [name for name in heavy if name in sys.modules]
print(json.dumps({{"before": before, "after": after}}))
"""


def _modules_loaded_by(statement_module: str) -> dict[str, list[str]]:
    probe = _PROBE.format(heavy=HEAVY, module=statement_module)
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, list[str]] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize("module", LIGHT_MODULES)
def test_importing_loads_no_heavy_library(module: str) -> None:
    loaded = _modules_loaded_by(module)
    if loaded["before"]:
        pytest.skip(f"the interpreter loads {loaded['before']} at start-up (a .pth file?)")
    assert loaded["after"] == [], f"import {module} loaded {loaded['after']}"


def test_every_public_name_is_importable_from_the_light_package() -> None:
    code = (
        "import kvplug, sys\n"
        "assert 'kvplug.backend' not in sys.modules\n"
        "from kvplug import Backend, MemoryObj, open_backend\n"
        "for name in kvplug.__all__:\n"
        "    assert getattr(kvplug, name) is not None, name\n"
        "    assert name in dir(kvplug), name\n"
        "from kvplug.backend import Backend as B\n"
        "assert Backend is B\n"
        "assert kvplug.registry.open_backend is open_backend\n"
        "print(kvplug.__version__)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == __import__("kvplug").__version__


def test_a_missing_name_is_an_attribute_error() -> None:
    import kvplug

    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        kvplug.NoSuchThing  # noqa: B018
    assert not hasattr(kvplug, "no_such_submodule")


def test_the_log_filter_is_installed_by_a_bare_import() -> None:
    code = (
        "import logging, kvplug\n"
        "from kvplug.secrets import SecretFilter\n"
        "logger = logging.getLogger('kvplug')\n"
        "assert any(isinstance(f, SecretFilter) for f in logger.filters), logger.filters\n"
        "import kvplug.registry\n"
        "logger = logging.getLogger('kvplug.registry')\n"
        "assert any(isinstance(f, SecretFilter) for f in logger.filters), logger.filters\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_lmcache_dtype_names_are_built_on_first_use() -> None:
    import torch

    from kvplug.keys import _DTYPE_NAMES, LMCACHE_DTYPE_NAMES, lmcache_dtype_name

    assert LMCACHE_DTYPE_NAMES[torch.bfloat16] == "bfloat16"
    assert lmcache_dtype_name(torch.float16) == "half"
    assert set(LMCACHE_DTYPE_NAMES.values()) == _DTYPE_NAMES
    assert len(LMCACHE_DTYPE_NAMES) == len(_DTYPE_NAMES)
