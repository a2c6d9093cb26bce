"""Plugin discovery and backend construction.

Plugins are found through the ``kvplug`` entry-point group and managed by a pluggy
``PluginManager("kvplug")``. Built-in backends register exactly as a third party does.

Environment:

* ``KVPLUG_DISABLE_PLUGINS=name,name``: skip these entry points (by entry-point or
  distribution name).
* ``KVPLUG_DISABLE_PLUGIN_AUTOLOAD=1``: load no entry point at all; only backends added with
  :func:`register_backend` are available.

Example::

    >>> import asyncio, kvplug
    >>> "cpu" in kvplug.available_schemes()
    True
    >>> async def main():
    ...     backend = await kvplug.open_backend("cpu://?max_size=64MiB")
    ...     await backend.close()
    ...     return backend.closed
    >>> asyncio.run(main())
    True
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import logging
import os
import threading
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, cast

import pluggy

from kvplug import hookspecs
from kvplug.backend import Backend
from kvplug.errors import PluginConflict, PluginLoadError, UnknownScheme
from kvplug.hookspecs import PROJECT, BackendSpec
from kvplug.memory import Allocator
from kvplug.url import BackendURL, split_chain

logger = logging.getLogger("kvplug.registry")

ENTRY_POINT_GROUP = "kvplug"
RUNTIME_DISTRIBUTION = "<registered at runtime>"

# Where each first-party scheme lives, for the install hint of a scheme nobody serves.
FIRST_PARTY_SCHEMES: dict[str, str] = {
    "store": "kvplug",
    "cpu": "kvplug-cpu",
    "blackhole": "kvplug-blackhole",
    "audit": "kvplug-audit",
    "file": "kvplug-disk",
    "gds": "kvplug-gds",
    "weka": "kvplug-gds",
    "redis": "kvplug-redis",
    "rediss": "kvplug-redis",
    "unix": "kvplug-redis",
    "redis+sentinel": "kvplug-redis",
    "redis-sentinel": "kvplug-redis",
    "rediss+sentinel": "kvplug-redis",
    "redis+cluster": "kvplug-redis",
    "valkey": "kvplug-valkey",
    "valkeys": "kvplug-valkey",
    "valkey+sentinel": "kvplug-valkey",
    "valkeys+sentinel": "kvplug-valkey",
    "valkey+cluster": "kvplug-valkey",
    "mooncakestore": "kvplug-mooncake",
    "infinistore": "kvplug-infinistore",
    "lm": "kvplug-lm",
}


class PluginWarning(UserWarning):
    """A plugin could not be loaded; its schemes fail when opened."""


@dataclass
class PluginInfo:
    """One discovered plugin: where it came from, what it serves, and what went wrong."""

    name: str
    distribution: str
    version: str
    specs: list[BackendSpec] = field(default_factory=list)
    error: str | None = None


@dataclass(frozen=True)
class _Served:
    spec: BackendSpec
    plugin: PluginInfo


class Registry:
    """Discovered plugins and the scheme table. Use the module-level functions."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._loaded = False
        self.manager = pluggy.PluginManager(PROJECT)
        self.manager.add_hookspecs(hookspecs)
        self.plugins: list[PluginInfo] = []
        self._schemes: dict[str, list[_Served]] = {}
        self._runtime = PluginInfo("runtime", RUNTIME_DISTRIBUTION, "")

    def _disabled(self) -> set[str]:
        raw = os.environ.get("KVPLUG_DISABLE_PLUGINS", "")
        return {name.strip() for name in raw.split(",") if name.strip()}

    def ensure_loaded(self) -> None:
        with self._lock:
            if not self._loaded:
                self._loaded = True
                if not os.environ.get("KVPLUG_DISABLE_PLUGIN_AUTOLOAD"):
                    self._load_entry_points()

    def _load_entry_points(self) -> None:
        disabled = self._disabled()
        for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist = entry_point.dist
            dist_name = dist.metadata["Name"] if dist is not None else "<unknown>"
            version = dist.version if dist is not None else ""
            if entry_point.name in disabled or dist_name in disabled:
                continue
            info = PluginInfo(entry_point.name, dist_name, version)
            self.plugins.append(info)
            try:
                module = entry_point.load()
                self.manager.register(module, name=f"{dist_name}:{entry_point.name}")
                specs = self._call_backends_hook(module)
            except Exception as error:
                info.error = f"{type(error).__name__}: {error}"
                warnings.warn(
                    f"kvplug plugin {entry_point.name!r} from {dist_name} {version} failed to "
                    f"load ({info.error}); its schemes are unavailable. Reinstall it: "
                    f"pip install --force-reinstall {dist_name}",
                    PluginWarning,
                    stacklevel=3,
                )
                continue
            for spec in specs:
                self._add(spec, info)

    def _call_backends_hook(self, module: ModuleType) -> list[BackendSpec]:
        specs: list[BackendSpec] = []
        for impl in self.manager.hook.kvplug_backends.get_hookimpls():
            if impl.plugin is module:
                specs.extend(cast(Iterable[BackendSpec], impl.function() or []))
        for spec in specs:
            if not isinstance(spec, BackendSpec):
                raise TypeError(f"kvplug_backends returned {spec!r}, not a BackendSpec")
        return specs

    def _add(self, spec: BackendSpec, info: PluginInfo, replace: bool = False) -> None:
        info.specs.append(spec)
        for scheme in spec.schemes:
            served = self._schemes.setdefault(scheme, [])
            if replace:
                served.clear()
            served.append(_Served(spec, info))

    def register(self, spec: BackendSpec, replace: bool) -> None:
        with self._lock:
            self.ensure_loaded()
            if not replace:
                for scheme in spec.schemes:
                    for served in self._schemes.get(scheme, []):
                        raise PluginConflict(
                            f"scheme {scheme!r} is already served by {served.spec.name!r} from "
                            f"{served.plugin.distribution}; pass replace=True to override it."
                        )
            if self._runtime not in self.plugins:
                self.plugins.append(self._runtime)
            self._add(spec, self._runtime, replace=replace)

    def schemes(self) -> list[str]:
        self.ensure_loaded()
        return sorted(self._schemes)

    def resolve(self, scheme: str) -> BackendSpec:
        """The spec serving ``scheme``; raises with a fix when none or several do."""
        self.ensure_loaded()
        served = self._schemes.get(scheme, [])
        if len(served) > 1:
            names = " and ".join(
                f"{s.spec.name!r} from {s.plugin.distribution} {s.plugin.version}".rstrip()
                for s in served
            )
            raise PluginConflict(
                f"scheme {scheme!r} is served by two plugins, {names}. kvplug never picks one "
                "silently: uninstall one, or disable it with KVPLUG_DISABLE_PLUGINS=<name>."
            )
        if served:
            return served[0].spec
        message = f"no installed kvplug plugin serves the scheme {scheme!r}."
        close = difflib.get_close_matches(scheme, self.schemes(), n=1)
        if close:
            message += f" Did you mean {close[0]!r}?"
        broken = [p for p in self.plugins if p.error]
        if broken:
            message += (
                " Plugins that failed to load: "
                + "; ".join(f"{p.name} ({p.distribution}): {p.error}" for p in broken)
                + "."
            )
        if scheme in FIRST_PARTY_SCHEMES:
            message += f" It is provided by: pip install {FIRST_PARTY_SCHEMES[scheme]}"
        message += f" Installed schemes: {', '.join(self.schemes()) or 'none'}."
        raise UnknownScheme(message)

    def factory(self, spec: BackendSpec) -> type[Backend]:
        module_name, _, attribute = spec.factory.partition(":")
        dist = next((p.distribution for p in self.plugins if spec in p.specs), RUNTIME_DISTRIBUTION)
        try:
            module = importlib.import_module(module_name)
            factory = getattr(module, attribute)
        except Exception as error:
            raise PluginLoadError(
                f"backend {spec.name!r} from {dist} cannot be loaded: importing "
                f"{spec.factory} failed with {type(error).__name__}: {error}. Install what it "
                f"needs or reinstall it: pip install --force-reinstall {dist}"
            ) from error
        if not (isinstance(factory, type) and issubclass(factory, Backend)):
            raise PluginLoadError(
                f"backend {spec.name!r} from {dist}: {spec.factory} is not a kvplug Backend "
                "subclass; fix the plugin's BackendSpec.factory."
            )
        return factory

    def serdes(self) -> Iterable[Any]:
        self.ensure_loaded()
        for result in self.manager.hook.kvplug_serdes():
            yield from result or []


_registry = Registry()
_serdes_loaded = False


def registry() -> Registry:
    """The process-wide registry."""
    return _registry


def reset_registry() -> None:
    """Forget every discovered plugin, so the next call discovers them again (for tests)."""
    global _registry, _serdes_loaded
    _registry = Registry()
    _serdes_loaded = False


def register_backend(spec: BackendSpec, *, replace: bool = False) -> None:
    """Serve ``spec``'s schemes from this process without an entry point."""
    _registry.register(spec, replace)


def available_schemes() -> list[str]:
    """Every scheme an installed plugin serves."""
    return _registry.schemes()


def plugins() -> list[PluginInfo]:
    """Every discovered plugin, including those that failed to load."""
    _registry.ensure_loaded()
    return list(_registry.plugins)


def load_plugin_serdes() -> None:
    """Register the serdes that plugins provide through ``kvplug_serdes``."""
    global _serdes_loaded
    if _serdes_loaded:
        return
    _serdes_loaded = True
    from kvplug.serde import register_serde

    for serde in _registry.serdes():
        register_serde(serde, replace=True)


def backend_class(url: str | BackendURL) -> type[Backend]:
    """The class that serves ``url``'s scheme (its factory is imported now)."""
    parsed = BackendURL.parse(url)
    return _registry.factory(_registry.resolve(parsed.scheme))


def create_backend(
    url: str | BackendURL, *, allocator: Allocator | None = None, **options: Any
) -> Backend:
    """Construct the backend for ``url`` without connecting (see :func:`open_backend`).

    ``url`` may be a chain ``wrapper::...::inner``; ``options`` go to the innermost backend,
    and each wrapper takes its options from its own URL query.
    """
    parts = [url] if isinstance(url, BackendURL) else split_chain(url)
    *wrappers, inner_text = parts
    inner_url = BackendURL.parse(inner_text)
    inner_spec = _registry.resolve(inner_url.scheme)
    if inner_spec.kind == "wrapper":
        raise UnknownScheme(
            f"{inner_url.scheme}:// is a wrapper and needs a backend to wrap; write "
            f"{inner_url.scheme}::<backend-url>, e.g. {inner_url.scheme}::cpu://"
        )
    backend = _registry.factory(inner_spec)(inner_url, allocator=allocator, **options)
    for wrapper_text in reversed(wrappers):
        text = str(wrapper_text)
        wrapper_url = BackendURL.parse(text if "://" in text else f"{text}://")
        spec = _registry.resolve(wrapper_url.scheme)
        if spec.kind != "wrapper":
            raise UnknownScheme(
                f"{wrapper_url.scheme}:// is a backend, not a wrapper, so it cannot stand "
                f"before '::'. Only wrappers compose: {', '.join(_wrapper_schemes())}."
            )
        backend = _registry.factory(spec)(wrapper_url, allocator=allocator, inner=backend)
    return backend


def _wrapper_schemes() -> Sequence[str]:
    return sorted(
        scheme
        for scheme in _registry.schemes()
        if any(s.spec.kind == "wrapper" for s in _registry._schemes[scheme])
    )


async def open_backend(
    url: str | BackendURL, *, allocator: Allocator | None = None, **options: Any
) -> Backend:
    """Construct and open the backend that ``url``'s scheme selects.

    ``allocator`` is where objects returned by ``get`` live (the process-wide host allocator by
    default). Options override the URL's query parameters.
    """
    backend = create_backend(url, allocator=allocator, **options)
    try:
        await backend.open()
    except BaseException:
        # What open() made before it failed (connections, threads, files) is released here:
        # the caller never gets the backend, so nobody else could close it.
        try:
            await backend.close()
        except Exception as close_error:
            logger.warning(
                "closing %s after its open() failed also failed: %s: %s",
                backend.url,
                type(close_error).__name__,
                close_error,
            )
        raise
    return backend


__all__ = [
    "FIRST_PARTY_SCHEMES",
    "PluginInfo",
    "PluginWarning",
    "Registry",
    "available_schemes",
    "backend_class",
    "create_backend",
    "load_plugin_serdes",
    "open_backend",
    "plugins",
    "register_backend",
    "registry",
    "reset_registry",
]
