"""The plugin hooks of kvplug (pluggy project name ``kvplug``).

A plugin is a module named by an entry point in the ``kvplug`` group of its distribution::

    # pyproject.toml of the distribution "kvplug-acme"
    [project.entry-points.kvplug]
    acme = "kvplug_acme.plugin"

    # kvplug_acme/plugin.py
    from kvplug import BackendSpec, hookimpl

    @hookimpl
    def kvplug_backends():
        return [
            BackendSpec(
                name="acme",
                schemes=("acme", "acme+tls"),
                factory="kvplug_acme.backend:AcmeBackend",
                description="ACME object store",
            )
        ]

Keep the plugin module light: it is imported at discovery, while the factory module (and the
client library it needs) is imported only when one of its schemes is opened.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import pluggy

if TYPE_CHECKING:
    from kvplug.serde import Serde

PROJECT = "kvplug"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@dataclass(frozen=True)
class BackendSpec:
    """What a plugin serves: a backend (or wrapper) and the URL schemes that select it.

    ``factory`` is ``"module:Class"``; the class subclasses :class:`kvplug.backend.Backend`.
    A ``wrapper`` is constructed with its own URL and ``inner=<the wrapped backend>`` and is
    written before the inner URL with ``::`` (``audit::redis://host:6379``).
    """

    name: str
    schemes: tuple[str, ...]
    factory: str
    description: str = ""
    kind: Literal["backend", "wrapper"] = "backend"

    def __post_init__(self) -> None:
        schemes: object = self.schemes
        if isinstance(schemes, str):
            object.__setattr__(self, "schemes", (schemes,))
        if ":" not in self.factory:
            raise ValueError(
                f"BackendSpec {self.name!r}: factory {self.factory!r} must be 'module:Class'."
            )
        if self.kind not in ("backend", "wrapper"):
            raise ValueError(f"BackendSpec {self.name!r}: kind must be 'backend' or 'wrapper'.")


@hookspec
def kvplug_backends() -> Sequence[BackendSpec]:  # type: ignore[empty-body]
    """Return the backends (and wrappers) this plugin serves.

    Every implementation is collected; a scheme served by two plugins is a
    :class:`~kvplug.errors.PluginConflict` naming both distributions when that scheme is
    opened (never "last installed wins").
    """


@hookspec
def kvplug_serdes() -> Sequence[type[Serde]]:  # type: ignore[empty-body]
    """Return :class:`~kvplug.serde.Serde` classes to register by their ``name``."""


__all__ = ["BackendSpec", "hookimpl", "hookspec", "kvplug_backends", "kvplug_serdes"]
