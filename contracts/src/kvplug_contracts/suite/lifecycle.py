"""Clauses 10, 11 and 13 (deadlines and recovery, close, honest capabilities): the limits of the
suite's patience while a server is down or a close runs, which a run may shorten (the suite's
own tests do, with ``monkeypatch.setattr(lifecycle, "CLOSE_LIMIT", 1.5)``); the clauses read
them from here at each use.

The clauses' contracts live in :mod:`kvplug_contracts.suite.deadlines` (10, with
:class:`ServerControl`), :mod:`kvplug_contracts.suite.closing` (11) and
:mod:`kvplug_contracts.suite.capabilities` (13), and are importable from here as well.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvplug.lazy import lazy_exports

if TYPE_CHECKING:
    from kvplug_contracts.suite.capabilities import CapabilityContract
    from kvplug_contracts.suite.closing import CloseContract
    from kvplug_contracts.suite.deadlines import DeadlineContract, ServerControl

DEADLINE_UNDER_TEST = 2.0
"""The ``timeout`` option of the backend the deadline tests open, unless the URL or
``--kvplug-option`` sets one: a short deadline keeps an outage test to seconds."""
DEADLINE_GRACE = 2.0
"""Seconds an operation may take beyond the backend's own deadline while the server is down."""
HANG_MARGIN = 5.0
"""Seconds beyond the deadline after which the suite stops waiting: the operation hangs."""
RECOVERY_LIMIT = 10.0
"""Seconds after the server is back within which operations must succeed again."""
CLOSE_LIMIT = 5.0
"""Seconds ``close`` may take, also with operations in flight, and those operations after it."""

# Imported on first use: those modules read the limits above from this one.
__getattr__ = lazy_exports(
    __name__,
    {
        "kvplug_contracts.suite.capabilities": ("CapabilityContract",),
        "kvplug_contracts.suite.closing": ("CloseContract",),
        "kvplug_contracts.suite.deadlines": ("DeadlineContract", "ServerControl"),
    },
)


__all__ = [
    "CLOSE_LIMIT",
    "DEADLINE_GRACE",
    "DEADLINE_UNDER_TEST",
    "RECOVERY_LIMIT",
    "CapabilityContract",
    "CloseContract",
    "DeadlineContract",
    "ServerControl",
]
