"""Refusing, when a backend class is created, one that would break the template: a class that
defines a public operation the template implements, one that defines or assigns a private name
the template uses for its own workings, and one that declares a capability without its hooks.
Each error says what to do instead.

Example::

    >>> import kvplug
    >>> try:
    ...     class Broken(kvplug.Backend):
    ...         async def get(self, key):
    ...             return None
    ... except TypeError as error:
    ...     print(str(error).split(". ")[-1])
    Implement the hook instead: _get.
"""

from __future__ import annotations

import dis
from types import CodeType
from typing import TYPE_CHECKING

from kvplug.capabilities import Capabilities

if TYPE_CHECKING:
    from kvplug.template import Backend

TEMPLATE_METHODS = frozenset(
    {
        "open",
        "close",
        "get",
        "put",
        "contains",
        "remove",
        "get_into",
        "batched_get",
        "batched_put",
        "batched_contains",
        "batched_exists",
        "batched_get_into",
        "pin",
        "unpin",
        "list_keys",
    }
)
"""The public operations the template implements; a backend implements their hooks (``_get``
for ``get``)."""

TEMPLATE_STATE = frozenset({"_closed", "_opened", "_home_loop", "_close_lock", "_counters"})
"""The instance attributes the template keeps its own state in (``_allocator`` is not one: an
``allocator`` property of a subclass may set it)."""

TEMPLATE_MODULES = frozenset(
    {"kvplug.template", "kvplug.hooks", "kvplug.bytes_backend", "kvplug.wrapper"}
)
"""The modules of the template classes (:class:`~kvplug.backend.Backend`, its hooks'
defaults, :class:`~kvplug.backend.BytesBackend`, :class:`~kvplug.backend.Wrapper`)."""


def check_backend_class(cls: type[Backend]) -> None:
    """Raise ``TypeError`` for a class ``cls`` that would break the template it derives from."""
    overridden = sorted(TEMPLATE_METHODS & cls.__dict__.keys())
    if overridden:
        raise TypeError(
            f"{cls.__qualname__} defines {', '.join(overridden)}, which kvplug.Backend "
            "implements for every backend (open check, deadline, argument checks, counters, "
            "references). Implement the hook instead: "
            f"{', '.join('_' + name for name in overridden)}."
        )
    if cls.__module__.partition(".")[0] != "kvplug":  # kvplug's own (Store) are template
        internals = template_internals(cls)
        clashes = sorted((internals & cls.__dict__.keys()) | (internals & assigned_on_self(cls)))
        if clashes:
            raise TypeError(
                f"{cls.__qualname__} defines or assigns {', '.join(clashes)}, which the "
                "kvplug template it derives from uses for its own workings; yours would "
                "replace it and break every operation. Rename yours (for example "
                f"{clashes[0][0]}{cls.__name__.lower()}{clashes[0]})."
            )
    capabilities = cls.__dict__.get("capabilities")
    if isinstance(capabilities, Capabilities):
        for name in capabilities.declared():
            missing = cls.missing_hooks(name)
            if missing:
                raise TypeError(
                    f"{cls.__qualname__} declares the {name!r} capability but does not "
                    f"implement {', '.join(missing)}. Implement them, or do not declare "
                    f"{name!r} (undeclared, the operation raises NotSupported)."
                )


def template_internals(cls: type) -> set[str]:
    """The private names the template classes ``cls`` derives from use for their own workings:
    their helpers (``_run_hook``, a byte store's ``_read``) and their state, not the hooks."""
    hooks = {"_" + name for name in TEMPLATE_METHODS}
    names = set(TEMPLATE_STATE)
    for base in cls.__mro__[1:]:
        if base.__module__ in TEMPLATE_MODULES:
            names.update(
                name
                for name in base.__dict__
                if name.startswith("_")
                and not name.startswith("__")
                and name not in hooks
                and name not in {"_GATES", "_abc_impl"}
            )
    return names


def assigned_on_self(cls: type) -> set[str]:
    """The attributes the functions ``cls`` defines assign on ``self`` (``self.x = ...``), in
    nested functions too."""
    assigned: set[str] = set()
    codes: list[CodeType] = []
    for value in cls.__dict__.values():
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        parts = (value.fget, value.fset, value.fdel) if isinstance(value, property) else (value,)
        codes.extend(code for part in parts if (code := getattr(part, "__code__", None)))
    while codes:
        code = codes.pop()
        codes.extend(const for const in code.co_consts if isinstance(const, CodeType))
        previous = None
        for instruction in dis.get_instructions(code):
            if (
                instruction.opname == "STORE_ATTR"
                and previous is not None
                and previous.opname in {"LOAD_FAST", "LOAD_DEREF"}
                and previous.argval == "self"
            ):
                assigned.add(instruction.argval)
            previous = instruction
    return assigned


__all__ = [
    "TEMPLATE_METHODS",
    "TEMPLATE_MODULES",
    "TEMPLATE_STATE",
    "assigned_on_self",
    "check_backend_class",
    "template_internals",
]
