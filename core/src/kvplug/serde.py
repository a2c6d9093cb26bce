"""Serializers between a :class:`MemoryObj` and the payload bytes of a frame.

A serde is chosen by name (``remote_serde: naive``). ``naive`` stores the object's bytes as they
are and is always present; compressing or quantizing serdes are plugins that return their
classes from the ``kvplug_serdes`` hook.

Example::

    >>> import torch
    >>> from kvplug.memory import MemoryObj
    >>> from kvplug.serde import get_serde
    >>> naive = get_serde("naive")
    >>> src = MemoryObj.from_tensor(torch.arange(6, dtype=torch.float16))
    >>> dst = MemoryObj.from_tensor(torch.zeros(6, dtype=torch.float16))
    >>> naive.decode(naive.encode(src), dst)
    >>> torch.equal(src.tensor, dst.tensor)
    True
"""

from __future__ import annotations

import abc
import difflib
import threading
from collections.abc import Iterable
from typing import ClassVar

from kvplug.errors import ConfigError, CorruptObject, PluginConflict
from kvplug.memory import MemoryObj


class Serde(abc.ABC):
    """Turns a memory object into payload bytes and back.

    ``decode`` must fill ``out`` completely from ``payload`` or raise
    :class:`~kvplug.errors.CorruptObject`; it never leaves a half-filled object to be served.
    """

    name: ClassVar[str]

    @abc.abstractmethod
    def encode(self, obj: MemoryObj) -> memoryview | bytes:
        """The payload for ``obj``. May be a zero-copy view valid while ``obj`` is held."""

    @abc.abstractmethod
    def decode(self, payload: memoryview, out: MemoryObj) -> None:
        """Fill ``out`` (allocated with the frame's shape, dtype and format) from ``payload``."""


class NaiveSerde(Serde):
    """The object's bytes, unchanged."""

    name = "naive"

    def encode(self, obj: MemoryObj) -> memoryview:
        return obj.memoryview()

    def decode(self, payload: memoryview, out: MemoryObj) -> None:
        if payload.nbytes != out.nbytes:
            raise CorruptObject(
                f"naive payload has {payload.nbytes} bytes but shape {out.shape} {out.dtype} "
                f"needs {out.nbytes}."
            )
        out.memoryview()[:] = payload


KVPLUG_SOURCE = "kvplug"
"""The source named for the serdes kvplug itself provides (``naive``)."""

_serdes: dict[str, type[Serde]] = {NaiveSerde.name: NaiveSerde}
_sources: dict[str, str] = {NaiveSerde.name: KVPLUG_SOURCE}
_from_plugins: set[str] = set()
_conflicts: dict[str, list[str]] = {}
_instances: dict[str, Serde] = {}
_lock = threading.Lock()


def _describe(serde: type[Serde], source: str) -> str:
    return f"{source} ({serde.__module__}.{serde.__qualname__})"


def _conflict_error(name: str, served_by: list[str]) -> PluginConflict:
    return PluginConflict(
        f"serde {name!r} is served twice: it is already registered by {served_by[0]}, and "
        f"{' and '.join(served_by[1:])} serves it too. kvplug never picks one silently: "
        "uninstall one of them, or disable its plugin with KVPLUG_DISABLE_PLUGINS=<name>; in "
        "code, register_serde(..., replace=True) overrides on purpose."
    )


def register_serde(serde: type[Serde], *, replace: bool = False, source: str | None = None) -> None:
    """Make ``serde`` available under ``serde.name``.

    ``source`` names who provides it in error messages (the class's module by default).
    Registering the same class again is a no-op. A name that another class already serves is a
    :class:`~kvplug.errors.PluginConflict` naming both, unless ``replace`` is true: kvplug
    never lets the last registration win silently.

    Example::

        >>> from kvplug.serde import NaiveSerde, register_serde
        >>> class Impostor(NaiveSerde):
        ...     pass
        >>> try:
        ...     register_serde(Impostor, source="my-app")
        ... except PluginConflict as error:
        ...     print("by kvplug (kvplug.serde.NaiveSerde)" in str(error), "my-app" in str(error))
        True True
    """
    _check_serde_class(serde)
    name = serde.name
    with _lock:
        existing = _serdes.get(name)
        if existing is serde and not replace:
            return
        if existing is not None and not replace:
            raise _conflict_error(
                name,
                [_describe(existing, _sources[name]), _describe(serde, source or serde.__module__)],
            )
        _serdes[name] = serde
        _sources[name] = source or serde.__module__
        _from_plugins.discard(name)
        _conflicts.pop(name, None)
        _instances.pop(name, None)


def _check_serde_class(serde: object) -> None:
    if not (isinstance(serde, type) and issubclass(serde, Serde)):
        raise TypeError(f"{serde!r} is not a Serde subclass; register the class itself.")
    name = getattr(serde, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(
            f"serde class {serde.__module__}.{serde.__qualname__} has no name; set its class "
            "attribute name, e.g. name = 'zstd'."
        )


def add_plugin_serdes(found: Iterable[tuple[type[Serde], str]]) -> None:
    """Register the serdes that plugins provide, each with the plugin it comes from (for
    :mod:`kvplug.registry`).

    Unlike :func:`register_serde` nothing raises here: a name served twice is remembered as a
    conflict and raised by :func:`get_serde` when that serde is used, so that one conflict
    does not break the serdes that are fine.
    """
    with _lock:
        for serde, source in found:
            name = serde.name
            existing = _serdes.get(name)
            if existing is None:
                _serdes[name] = serde
                _sources[name] = source
                _from_plugins.add(name)
            elif existing is not serde:
                served_by = _conflicts.setdefault(name, [_describe(existing, _sources[name])])
                served_by.append(_describe(serde, source))
                _instances.pop(name, None)


def forget_plugin_serdes() -> None:
    """Drop what :func:`add_plugin_serdes` registered, before plugins are discovered again."""
    with _lock:
        for name in _from_plugins:
            _serdes.pop(name, None)
            _sources.pop(name, None)
        _from_plugins.clear()
        _conflicts.clear()
        # Every instance, also of kvplug's own serdes: the next get_serde then loads the
        # plugins again and sees a conflict over any name.
        _instances.clear()


def available_serdes() -> list[str]:
    """Every serde name, from kvplug and from installed plugins."""
    from kvplug.registry import load_plugin_serdes

    load_plugin_serdes()
    return sorted(_serdes)


def get_serde(name: str) -> Serde:
    """The serde registered as ``name``.

    Unknown names raise :class:`~kvplug.errors.ConfigError` with a did-you-mean; a name that
    two plugins serve raises :class:`~kvplug.errors.PluginConflict` naming both.
    """
    instance = _instances.get(name)
    if instance is not None:
        return instance
    names = available_serdes()
    with _lock:
        if name in _conflicts:
            raise _conflict_error(name, _conflicts[name])
        serde = _serdes.get(name)
        if serde is None:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"unknown serde {name!r}.{hint} Available: {', '.join(names)}. "
                "Install the plugin that provides it, or use 'naive'."
            )
        if name not in _instances:
            _instances[name] = serde()
        return _instances[name]


__all__ = [
    "KVPLUG_SOURCE",
    "NaiveSerde",
    "Serde",
    "add_plugin_serdes",
    "available_serdes",
    "forget_plugin_serdes",
    "get_serde",
    "register_serde",
]
