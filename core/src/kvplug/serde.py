"""Serializers between a :class:`MemoryObj` and the payload bytes of a frame.

A serde is chosen by name (``remote_serde: naive``, ``?serde=naive``). ``naive`` stores the
object's bytes as they are and is always present; compressing, quantizing or encrypting serdes
are plugins that return their classes from the ``kvplug_serdes`` hook.

A serde may take options (its :attr:`Serde.Options` model; in a URL each is given with a
``serde_`` prefix, ``?serde=aesgcm&serde_key_file=/etc/kvplug/keys``): a backend then builds its
own instance with :func:`open_serde`. Every call names the key the payload is stored under, so a
serde can bind the payload to it (an authenticated cipher's associated data) or pick a key per
tenant (:attr:`kvplug.keys.CacheKey.tenant`).

Example::

    >>> import torch
    >>> from kvplug.keys import CacheKey
    >>> from kvplug.memory import MemoryObj
    >>> from kvplug.serde import get_serde
    >>> naive = get_serde("naive")
    >>> src = MemoryObj.from_tensor(torch.arange(6, dtype=torch.float16))
    >>> dst = MemoryObj.from_tensor(torch.zeros(6, dtype=torch.float16))
    >>> key = CacheKey("llama", 1, 0, 0x2A, "half")
    >>> naive.decode(naive.encode(src, key), dst, key)
    >>> torch.equal(src.tensor, dst.tensor)
    True
"""

from __future__ import annotations

import abc
import difflib
import threading
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from kvplug.errors import ConfigError, CorruptObject, PluginConflict, UnknownOption
from kvplug.memory import MemoryObj

if TYPE_CHECKING:
    from pydantic import BaseModel

    from kvplug.keys import CacheKey

SERDE_OPTION_PREFIX = "serde_"
"""How a backend's URL or config names an option of its serde: ``serde_key_file`` is the serde's
``key_file``."""


class Serde(abc.ABC):
    """Turns a memory object into payload bytes and back.

    ``decode`` must fill ``out`` completely from ``payload`` or raise
    :class:`~kvplug.errors.CorruptObject`; it never leaves a half-filled object to be served.
    A payload that is sound but that this instance cannot read (written with a cipher key it
    does not hold) raises :class:`~kvplug.errors.UnreadableObject`: a counted miss that stays
    stored, for the readers that can read it.

    Both calls get the :class:`~kvplug.keys.CacheKey` the payload is stored under: a serde may
    bind the payload to it, so that a value copied under another key does not decode.

    A serde with settings declares them as a pydantic model in :attr:`Options`; its
    ``__init__`` then takes the validated model. A serde without options is shared: one
    instance per name (:func:`get_serde`).

    Example, a serde that stores the bytes reversed (of no use but to show the contract)::

        >>> import torch
        >>> from kvplug.keys import CacheKey
        >>> from kvplug.memory import MemoryObj
        >>> class Reversed(Serde):
        ...     name = "reversed"
        ...     def encode(self, obj, key=None):
        ...         return bytes(obj.memoryview())[::-1]
        ...     def decode(self, payload, out, key=None):
        ...         if payload.nbytes != out.nbytes:
        ...             raise CorruptObject(f"{key}: {payload.nbytes} bytes, {out.nbytes} needed.")
        ...         out.memoryview()[:] = bytes(payload)[::-1]
        >>> key = CacheKey("llama", 1, 0, 0x2A, "half")
        >>> src = MemoryObj.from_tensor(torch.arange(4, dtype=torch.uint8))
        >>> dst = MemoryObj.from_tensor(torch.zeros(4, dtype=torch.uint8))
        >>> Reversed().decode(memoryview(Reversed().encode(src, key)), dst, key)
        >>> dst.tensor.tolist()
        [0, 1, 2, 3]
    """

    name: ClassVar[str]
    description: ClassVar[str] = ""
    """One line for ``kvplug plugins``: what the serde does to the bytes."""
    lossy: ClassVar[bool] = False
    """Whether ``decode`` gives back an approximation of what was encoded (a quantizing serde)
    rather than the same bytes. A lossy serde documents its error bound."""
    Options: ClassVar[type[BaseModel] | None] = None
    """The serde's options model, or None when it takes none."""
    authenticated: ClassVar[bool] = False
    """Whether the serde proves where its payloads come from (an authenticated cipher). A
    backend configured with such a serde reads no frame of another serde: a plain frame found
    in its store was not written by it and is damage, never data."""

    @classmethod
    def unavailable(cls) -> str | None:
        """Why this serde cannot run here (a package it needs is missing: say which, and the
        command that installs it), or None when it can. Checked when a backend opens it and
        shown by ``kvplug plugins``; the default needs nothing."""
        return None

    @abc.abstractmethod
    def encode(self, obj: MemoryObj, key: CacheKey | None = None) -> memoryview | bytes | bytearray:
        """The payload for ``obj`` stored under ``key`` (None: a frame kept outside any store).
        May be a zero-copy view valid while ``obj`` is held."""

    @abc.abstractmethod
    def decode(self, payload: memoryview, out: MemoryObj, key: CacheKey | None = None) -> None:
        """Fill ``out`` (allocated with the frame's shape, dtype and format) from ``payload``,
        which was stored under ``key``."""


class NaiveSerde(Serde):
    """The object's bytes, unchanged."""

    name = "naive"
    description = "the object's bytes, unchanged"

    def encode(self, obj: MemoryObj, key: CacheKey | None = None) -> memoryview:
        return obj.memoryview()

    def decode(self, payload: memoryview, out: MemoryObj, key: CacheKey | None = None) -> None:
        if payload.nbytes != out.nbytes:
            raise CorruptObject(
                f"naive payload has {payload.nbytes} bytes but shape {out.shape} {out.dtype} "
                f"needs {out.nbytes}."
            )
        out.memoryview()[:] = payload


FIRST_PARTY_SERDES: dict[str, str] = {
    "zstd": "'kvplug-serdes[zstd]'",
    "lz4": "'kvplug-serdes[lz4]'",
    "fp8": "kvplug-serdes",
    "k16v8": "kvplug-serdes",
    "aesgcm": "kvplug-aesgcm",
}
"""The serdes of kvplug's own plugins, with what ``pip install`` takes to get each."""

KVPLUG_SOURCE = "kvplug"
"""The source named for the serdes kvplug itself provides (``naive``)."""

_serdes: dict[str, type[Serde]] = {NaiveSerde.name: NaiveSerde}
_sources: dict[str, str] = {NaiveSerde.name: KVPLUG_SOURCE}
_from_plugins: set[str] = set()
_conflicts: dict[str, list[str]] = {}
_instances: dict[str, Serde] = {}
_plugins_added_by: object = None
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


def add_plugin_serdes(found: Iterable[tuple[type[Serde], str]], owner: object = None) -> None:
    """Register the serdes that plugins provide, each with the plugin it comes from, as found
    by ``owner`` (for :mod:`kvplug.registry`: the registry that discovered them).

    Unlike :func:`register_serde` nothing raises here: a name served twice is remembered as a
    conflict and raised by :func:`get_serde` when that serde is used, so that one conflict
    does not break the serdes that are fine.
    """
    global _plugins_added_by
    with _lock:
        _plugins_added_by = owner
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


def plugin_serdes_added_by(owner: object) -> bool:
    """Whether the plugins' serdes registered now are the ones ``owner`` found (a registry
    that was swapped out and back, as tests do, finds them again)."""
    return owner is not None and _plugins_added_by is owner


def forget_plugin_serdes() -> None:
    """Drop what :func:`add_plugin_serdes` registered, before plugins are discovered again."""
    global _plugins_added_by
    with _lock:
        _plugins_added_by = None
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
    serde = get_serde_class(name)
    with _lock:
        if name not in _instances:
            _instances[name] = _construct(serde, {})
        return _instances[name]


def _construct(serde: type[Serde], options: Mapping[str, Any]) -> Serde:
    missing = serde.unavailable()
    if missing:
        raise ConfigError(f"serde {serde.name!r} cannot run here: {missing}")
    model = serde.Options
    if model is None:
        if options:
            raise UnknownOption(
                f"serde {serde.name!r} takes no options, got "
                f"{', '.join(SERDE_OPTION_PREFIX + name for name in sorted(options))}. "
                "Leave them out, or choose the serde they belong to."
            )
        return serde()
    from pydantic import ValidationError

    from kvplug.option_parsing import describe_validation_error

    unknown = sorted(set(options) - set(model.model_fields))
    if unknown:
        valid = ", ".join(SERDE_OPTION_PREFIX + name for name in sorted(model.model_fields))
        raise UnknownOption(
            f"serde {serde.name!r} has no option "
            f"{', '.join(SERDE_OPTION_PREFIX + name for name in unknown)}. Valid: {valid}."
        )
    try:
        settings = model.model_validate(dict(options))
    except ValidationError as error:
        raise ConfigError(
            f"serde {serde.name!r} is not configured: "
            f"{describe_validation_error(error, SERDE_OPTION_PREFIX)}. "
            f"Give its options with the {SERDE_OPTION_PREFIX!r} prefix "
            f"(?serde={serde.name}&{SERDE_OPTION_PREFIX}<option>=...)."
        ) from None
    return serde(settings)  # type: ignore[call-arg]


def open_serde(name: str, options: Mapping[str, Any] | None = None) -> Serde:
    """The serde ``name`` built with ``options`` (names without the ``serde_`` prefix): a new
    instance for a backend that configures its serde, the shared one when ``options`` is
    empty. Raises :class:`~kvplug.errors.ConfigError` for an unknown name or bad options,
    naming the valid ones; values of secret-looking options never appear in it.

    Example::

        >>> open_serde("naive").name
        'naive'
        >>> try:
        ...     open_serde("naive", {"level": 3})
        ... except UnknownOption as error:
        ...     print(str(error).split(".")[0])
        serde 'naive' takes no options, got serde_level
    """
    if not options:
        return get_serde(name)
    return _construct(get_serde_class(name), options)


def serde_source(name: str) -> str:
    """Who provides the serde ``name`` (``kvplug`` for its own, else the plugin's distribution
    and version), as :func:`get_serde_class` finds it."""
    get_serde_class(name)
    with _lock:
        return _sources[name]


def get_serde_class(name: str) -> type[Serde]:
    """The class registered as ``name`` (errors as :func:`get_serde`), not instantiated."""
    names = available_serdes()
    with _lock:
        if name in _conflicts:
            raise _conflict_error(name, _conflicts[name])
        serde = _serdes.get(name)
        if serde is None:
            if name in FIRST_PARTY_SERDES:
                raise ConfigError(
                    f"serde {name!r} is not installed. It is provided by: pip install "
                    f"{FIRST_PARTY_SERDES[name]} (installed serdes: {', '.join(names)})."
                )
            close = difflib.get_close_matches(name, names, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"unknown serde {name!r}.{hint} Available: {', '.join(names)}. "
                "Install the plugin that provides it, or use 'naive'."
            )
        return serde


__all__ = [
    "FIRST_PARTY_SERDES",
    "KVPLUG_SOURCE",
    "SERDE_OPTION_PREFIX",
    "NaiveSerde",
    "Serde",
    "add_plugin_serdes",
    "available_serdes",
    "forget_plugin_serdes",
    "get_serde",
    "get_serde_class",
    "open_serde",
    "plugin_serdes_added_by",
    "register_serde",
    "serde_source",
]
