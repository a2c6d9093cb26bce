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
client library it needs) is imported only when one of its schemes is opened. This module itself
imports neither torch nor numpy.

Every function a plugin marks with :data:`hookimpl` must be one of the hooks below
(:data:`HOOK_NAMES`) and take no argument its hook does not declare; kvplug checks that when it
registers the plugin, so a misspelled hook (``kvplug_backend``) is reported instead of silently
never called.

Example::

    >>> from kvplug.hookspecs import BackendSpec, InvalidBackendSpec
    >>> BackendSpec("acme", ("acme", "acme+tls"), "kvplug_acme.backend:AcmeBackend").schemes
    ('acme', 'acme+tls')
    >>> try:
    ...     BackendSpec("acme", ("acme_store",), "kvplug_acme.backend:AcmeBackend")
    ... except InvalidBackendSpec as error:
    ...     print(str(error).split(":")[0])
    BackendSpec 'acme' declares the scheme 'acme_store', which is not a URL scheme
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import pluggy

from kvplug.errors import PluginLoadError

# One scheme grammar for the URL parser and for what a plugin may declare, so that every
# declared scheme can be written in a URL.
from kvplug.url import _SCHEME as _SCHEME_GRAMMAR

if TYPE_CHECKING:
    from kvplug.serde import Serde

PROJECT = "kvplug"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class InvalidBackendSpec(PluginLoadError, ValueError):
    """A :class:`BackendSpec` is malformed: a bad scheme, factory or kind. A bug in its plugin."""


def _scheme_problem(scheme: object) -> str | None:
    """Why ``scheme`` cannot be declared, with the fix; ``None`` when it is a valid scheme."""
    if not isinstance(scheme, str):
        return f"a scheme must be a string, not {type(scheme).__name__}"
    if _SCHEME_GRAMMAR.fullmatch(scheme):
        return None
    if not scheme:
        return "an empty scheme selects nothing. Remove it or name it, e.g. 'acme'"
    bare = scheme.removesuffix("://").removesuffix(":")
    if bare != scheme:
        return f"a scheme is declared without '://' or ':'. Write {bare!r}"
    if _SCHEME_GRAMMAR.fullmatch(scheme.lower()):
        return f"kvplug matches schemes in lower case. Write {scheme.lower()!r}"
    suggestion = _suggest_scheme(scheme)
    return (
        "a scheme (RFC 3986) starts with a letter and goes on with letters, digits, '+', '-' "
        "or '.'" + (f". Write e.g. {suggestion!r}" if suggestion else ". Rename it")
    )


def _suggest_scheme(scheme: str) -> str | None:
    fixed = "".join(c if c.isascii() and (c.isalnum() or c in "+-.") else "-" for c in scheme)
    fixed = fixed.lower().lstrip("0123456789+-.")
    return fixed if _SCHEME_GRAMMAR.fullmatch(fixed) else None


@dataclass(frozen=True)
class BackendSpec:
    """What a plugin serves: a backend (or wrapper) and the URL schemes that select it.

    ``schemes`` are URL schemes as kvplug parses them (RFC 3986, in lower case: a letter, then
    letters, digits, ``+``, ``-`` or ``.``), declared without ``://``; a single string is one
    scheme. ``factory`` is ``"module:Class"``; the class subclasses
    :class:`kvplug.backend.Backend`. A ``wrapper`` is constructed with its own URL and
    ``inner=<the wrapped backend>`` and is written before the inner URL with ``::``
    (``audit::redis://host:6379``).

    Raises :class:`InvalidBackendSpec` (a :class:`ValueError`) naming the spec and the fix when
    a field is malformed, so a plugin with a bad spec fails at discovery, not at first use.
    """

    name: str
    schemes: tuple[str, ...]
    factory: str
    description: str = ""
    kind: Literal["backend", "wrapper"] = "backend"

    def __post_init__(self) -> None:
        schemes: object = self.schemes
        if isinstance(schemes, str):
            schemes = (schemes,)
        elif isinstance(schemes, list):
            schemes = tuple(schemes)
        if not isinstance(schemes, tuple) or not schemes:
            raise InvalidBackendSpec(
                f"BackendSpec {self.name!r}: schemes must be a non-empty tuple of scheme names, "
                f"got {self.schemes!r}. Declare e.g. schemes=('acme',)."
            )
        object.__setattr__(self, "schemes", schemes)
        for scheme in schemes:
            problem = _scheme_problem(scheme)
            if problem is not None:
                raise InvalidBackendSpec(
                    f"BackendSpec {self.name!r} declares the scheme {scheme!r}, which is not a "
                    f"URL scheme: {problem}."
                )
        if len(set(schemes)) != len(schemes):
            raise InvalidBackendSpec(
                f"BackendSpec {self.name!r} declares a scheme twice in {schemes!r}. "
                "Declare each scheme once."
            )
        if not isinstance(self.factory, str) or ":" not in self.factory:
            raise InvalidBackendSpec(
                f"BackendSpec {self.name!r}: factory {self.factory!r} must be 'module:Class'."
            )
        if self.kind not in ("backend", "wrapper"):
            raise InvalidBackendSpec(
                f"BackendSpec {self.name!r}: kind must be 'backend' or 'wrapper', got "
                f"{self.kind!r}."
            )


@hookspec
def kvplug_backends() -> Sequence[BackendSpec]:  # type: ignore[empty-body]
    """Return the backends (and wrappers) this plugin serves.

    Every implementation is collected; a scheme served by two plugins is a
    :class:`~kvplug.errors.PluginConflict` naming both distributions when that scheme is
    opened (never "last installed wins").
    """


@hookspec
def kvplug_serdes() -> Sequence[type[Serde]]:  # type: ignore[empty-body]
    """Return :class:`~kvplug.serde.Serde` classes to register by their ``name``.

    A serde name served by two plugins (or by a plugin and kvplug) is a
    :class:`~kvplug.errors.PluginConflict` naming both when that serde is used.
    """


HOOK_NAMES: tuple[str, ...] = ("kvplug_backends", "kvplug_serdes")
"""The hooks a plugin may implement."""


__all__ = [
    "HOOK_NAMES",
    "BackendSpec",
    "InvalidBackendSpec",
    "hookimpl",
    "hookspec",
    "kvplug_backends",
    "kvplug_serdes",
]
