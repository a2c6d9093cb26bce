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
from typing import ClassVar

from kvplug.errors import ConfigError, CorruptObject
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


_serdes: dict[str, type[Serde]] = {NaiveSerde.name: NaiveSerde}
_instances: dict[str, Serde] = {}
_lock = threading.Lock()


def register_serde(serde: type[Serde], *, replace: bool = False) -> None:
    """Make ``serde`` available under ``serde.name``."""
    with _lock:
        existing = _serdes.get(serde.name)
        if existing is not None and existing is not serde and not replace:
            raise ConfigError(
                f"serde {serde.name!r} is already registered by {existing.__module__}; "
                "pass replace=True to override it."
            )
        _serdes[serde.name] = serde
        _instances.pop(serde.name, None)


def available_serdes() -> list[str]:
    from kvplug.registry import load_plugin_serdes

    load_plugin_serdes()
    return sorted(_serdes)


def get_serde(name: str) -> Serde:
    """The serde registered as ``name``; unknown names raise with a did-you-mean."""
    if name not in _serdes:
        names = available_serdes()
        if name not in _serdes:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"unknown serde {name!r}.{hint} Available: {', '.join(names)}. "
                "Install the plugin that provides it, or use 'naive'."
            )
    with _lock:
        if name not in _instances:
            _instances[name] = _serdes[name]()
        return _instances[name]


__all__ = ["NaiveSerde", "Serde", "available_serdes", "get_serde", "register_serde"]
