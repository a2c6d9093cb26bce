"""Names a package exports but imports on first use (PEP 562), so that importing it stays light.

A plugin's package is imported to read its entry point; its backend (and the client library
under it) only when a URL of its scheme is opened. Each package names where its exports live:

    >>> import sys, types
    >>> package = types.ModuleType("demo_plugin")
    >>> sys.modules["demo_plugin"] = package
    >>> package.__getattr__ = lazy_exports("demo_plugin", {"json": ("dumps", "loads")})
    >>> package.dumps([1])
    '[1]'
    >>> "loads" in vars(package), "dumps" in vars(package)
    (False, True)
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def lazy_exports(module: str, homes: Mapping[str, Sequence[str]]) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``module`` that imports each name of ``homes`` (home
    module -> names) from its home on first use and keeps it in ``module``, so later lookups
    cost nothing; any other name raises ``AttributeError`` as a module does."""
    home_of = {name: home for home, names in homes.items() for name in names}

    def attribute(name: str) -> Any:
        home = home_of.get(name)
        if home is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        setattr(sys.modules[module], name, value)
        return value

    return attribute


__all__ = ["lazy_exports"]
