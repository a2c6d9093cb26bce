"""kvplug-contracts: the conformance suite every kvplug backend runs.

Run it with no code::

    pytest --pyargs kvplug_contracts --kvplug-url acme://host:port
    kvplug contract acme://host:port

or subclass :class:`BackendContract` (a pytest class named ``Test...``) and override a fixture,
for example the URL, or ``server_control`` to let the suite stop and restart your server::

    import pytest
    from kvplug_contracts import BackendContract

    class TestAcme(BackendContract):
        @pytest.fixture
        def kvplug_url(self):
            return "acme://127.0.0.1:7000"

Each ``*Contract`` class covers some clauses of the backend contract; ``BackendContract`` is
all of them.
"""

from __future__ import annotations

import importlib.metadata
from typing import TYPE_CHECKING, Any

from kvplug.lazy import lazy_exports

__version__ = importlib.metadata.version("kvplug-contracts")

if TYPE_CHECKING:
    from kvplug_contracts.plugin import load_known_failures
    from kvplug_contracts.suite import BackendContract, ServerControl

_SUPPORT = ("CLAUSES", "Keyspace", "check_same", "clause", "make_obj", "not_applicable", "violated")

# Imported on first use, so that loading the `kvplug contract` command imports no pytest.
_export = lazy_exports(
    __name__,
    {
        "kvplug_contracts.support": _SUPPORT,
        "kvplug_contracts.suite": ("ServerControl",),
        "kvplug_contracts.plugin": ("load_known_failures",),
    },
)


def __getattr__(name: str) -> Any:
    if name.endswith("Contract"):  # BackendContract, and each of the suite's groups of clauses
        from kvplug_contracts import suite

        return getattr(suite, name)
    return _export(name)


__all__ = ["BackendContract", "ServerControl", "__version__", "load_known_failures", *_SUPPORT]
