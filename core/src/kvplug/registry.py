"""Plugin discovery and backend construction.

Plugins are found through the ``kvplug`` entry-point group and managed by a pluggy
``PluginManager("kvplug")``. Built-in backends register exactly as a third party does.

Environment:

* ``KVPLUG_DISABLE_PLUGINS=name,name``: skip these entry points (by entry-point or
  distribution name).
* ``KVPLUG_DISABLE_PLUGIN_AUTOLOAD=1``: load no entry point at all; only backends added with
  :func:`register_backend` or :func:`register_plugin` are available.
* ``KVPLUG_<PLUGIN>_*``: each plugin's own settings, read with :func:`kvplug.env.plugin_env`.

Every plugin is checked when it is registered: each function it marks ``@hookimpl`` must be a
kvplug hook (pluggy's ``check_pending``) taking only the hook's arguments, and every scheme it
declares must be a URL scheme. A plugin that fails a check, or fails to import, is a
:class:`PluginWarning` at discovery and serves nothing; opening one of its schemes then fails
with an error that names it.

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
from typing import Any, cast

import pluggy

from kvplug import hookspecs
from kvplug.backend import Backend
from kvplug.env import ENTRY_POINT_GROUP, plugin_env
from kvplug.errors import PluginConflict, PluginLoadError, UnknownScheme
from kvplug.hookspecs import HOOK_NAMES, PROJECT, BackendSpec, InvalidBackendSpec
from kvplug.memory import Allocator
from kvplug.secrets import install_log_filter
from kvplug.serde import Serde, add_plugin_serdes, forget_plugin_serdes, plugin_serdes_added_by
from kvplug.url import BackendURL, split_chain

logger = logging.getLogger("kvplug.registry")
# ``import kvplug`` no longer imports this module, so its logger gets the secret filter here.
install_log_filter()

RUNTIME_DISTRIBUTION = "<registered at runtime>"
# The plugin that holds every spec given to register_backend.
_RUNTIME_BACKENDS = "runtime"

# Where each first-party scheme lives, for the install hint of a scheme nobody serves.
FIRST_PARTY_SCHEMES: dict[str, str] = {
    "store": "kvplug",
    "cpu": "kvplug-cpu",
    "blackhole": "kvplug-blackhole",
    "audit": "kvplug-audit",
    "file": "kvplug-disk",
    "gds": "'kvplug-disk[gds]'",
    "weka": "'kvplug-disk[gds]'",
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


class _Rejected(Exception):
    """A plugin that cannot be used: what is wrong with it (``cause``) and who fixes what."""

    def __init__(self, cause: str, fix: str) -> None:
        super().__init__(cause)
        # Messages go on after the cause ("...; its schemes are unavailable").
        self.cause = cause.rstrip(". ")
        self.fix = fix


@dataclass
class PluginInfo:
    """One discovered plugin: where it came from, what it serves, and what went wrong."""

    name: str
    distribution: str
    version: str
    specs: list[BackendSpec] = field(default_factory=list)
    error: str | None = None
    serdes: list[str] = field(default_factory=list)
    """The names of the serdes it provides (known once serdes are loaded:
    :func:`load_plugin_serdes`)."""


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
        self._runtime = PluginInfo(_RUNTIME_BACKENDS, RUNTIME_DISTRIBUTION, "")
        # pluggy's name of each plugin -> what kvplug knows about it.
        self._infos: dict[str, PluginInfo] = {}
        self.serdes_loaded = False

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
            except Exception as error:
                self._reject(
                    info,
                    _Rejected(
                        f"failed to load ({type(error).__name__}: {error})",
                        f"Reinstall it: pip install --force-reinstall {dist_name}",
                    ),
                )
                continue
            try:
                specs = self._register(module, f"{dist_name}:{entry_point.name}", info)
            except _Rejected as rejected:
                self._reject(info, rejected)
                continue
            for spec in specs:
                self._add(spec, info)

    def _reject(self, info: PluginInfo, rejected: _Rejected) -> None:
        info.error = rejected.cause
        warnings.warn(
            f"kvplug plugin {info.name!r} from {_source(info)} {rejected.cause}; its schemes "
            f"are unavailable. {rejected.fix}",
            PluginWarning,
            stacklevel=4,
        )

    def _register(self, plugin: object, plugin_name: str, info: PluginInfo) -> list[BackendSpec]:
        """Register ``plugin`` with pluggy, check its hooks, and return the specs it serves.

        Raises :class:`_Rejected` with nothing of the plugin left registered.
        """
        if self.manager.is_registered(plugin) or self.manager.has_plugin(plugin_name):
            raise _Rejected(
                "is registered already",
                "Register each plugin once; its schemes are served by the first registration.",
            )
        bug_fix = (
            f"This is a bug in {info.distribution}: upgrade it, or disable it with "
            f"KVPLUG_DISABLE_PLUGINS={info.name}."
            if info.distribution != RUNTIME_DISTRIBUTION
            else "Fix the plugin object and register it again."
        )
        try:
            self.manager.register(plugin, name=plugin_name)
            self._check_pending(plugin)
        except pluggy.PluginValidationError as error:
            self.manager.unregister(name=plugin_name)
            problems = self._hook_problems(plugin) or [str(error)]
            raise _Rejected(
                f"has {'an invalid hook' if len(problems) == 1 else 'invalid hooks'}: "
                + "; ".join(problems),
                bug_fix,
            ) from error
        self._infos[plugin_name] = info
        try:
            return self._call_backends_hook(plugin)
        except Exception as error:
            self.manager.unregister(name=plugin_name)
            del self._infos[plugin_name]
            if isinstance(error, InvalidBackendSpec):
                cause = f"returned an invalid BackendSpec from kvplug_backends: {error}"
            else:
                cause = f"failed in kvplug_backends ({type(error).__name__}: {error})"
            raise _Rejected(cause, bug_fix) from error

    def _check_pending(self, plugin: object) -> None:
        """pluggy's check that every hook implementation has a spec, for ``plugin``.

        A plugin given to ``manager.register`` directly, past kvplug, can fail it too: it is
        unregistered with a warning, so that it cannot make every later plugin fail.
        """
        while True:
            try:
                self.manager.check_pending()
                return
            except pluggy.PluginValidationError as error:
                if error.plugin is plugin:
                    raise
                name = self.manager.get_name(error.plugin) or repr(error.plugin)
                self.manager.unregister(error.plugin)
                warnings.warn(
                    f"pluggy plugin {name!r}, registered with kvplug's PluginManager directly, "
                    f"has an invalid hook: {'; '.join(self._hook_problems(error.plugin))}; it "
                    "was unregistered. Register plugins with kvplug.register_plugin.",
                    PluginWarning,
                    stacklevel=6,
                )

    def _hook_problems(self, plugin: object) -> list[str]:
        """What is wrong with each kvplug hook implementation of ``plugin``, with the fix."""
        problems = []
        for attribute in dir(plugin):
            options = self.manager.parse_hookimpl_opts(plugin, attribute)
            if options is None:
                continue
            hook_name = options.get("specname") or attribute
            caller = getattr(self.manager.hook, hook_name, None)
            spec = caller.spec if caller is not None else None
            if spec is None:
                if options.get("optionalhook"):
                    continue
                close = difflib.get_close_matches(hook_name, HOOK_NAMES, n=1)
                problems.append(
                    f"{hook_name!r} is marked @hookimpl but is not a kvplug hook, so kvplug would "
                    "never call it. "
                    + (f"Rename it to {close[0]!r}" if close else "Rename it")
                    + f" (kvplug's hooks: {', '.join(HOOK_NAMES)}) or remove its @hookimpl"
                )
                continue
            impl = pluggy.HookImpl(plugin, "", getattr(plugin, attribute), options)
            extra = [name for name in impl.argnames if name not in spec.argnames]
            if extra:
                expected = ", ".join(spec.argnames)
                passes = f"it passes only {expected}" if expected else "it passes none"
                problems.append(
                    f"{hook_name}() takes the argument(s) {', '.join(extra)}, which the hook "
                    f"does not pass ({passes}). Declare it as def {hook_name}({expected})"
                )
        return problems

    def _call_backends_hook(self, plugin: object) -> list[BackendSpec]:
        specs: list[BackendSpec] = []
        for impl in self.manager.hook.kvplug_backends.get_hookimpls():
            if impl.plugin is plugin:
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

    def register_plugin(self, plugin: object, name: str) -> list[BackendSpec]:
        with self._lock:
            self.ensure_loaded()
            info = PluginInfo(name, RUNTIME_DISTRIBUTION, "")
            try:
                specs = self._register(plugin, name, info)
            except _Rejected as rejected:
                raise PluginLoadError(
                    f"kvplug plugin {name!r} (registered at runtime) {rejected.cause}. "
                    f"{rejected.fix}"
                ) from rejected.__cause__
            for spec in specs:
                for scheme in spec.schemes:
                    for served in self._schemes.get(scheme, []):
                        self.manager.unregister(name=name)
                        del self._infos[name]
                        raise PluginConflict(
                            f"plugin {name!r} serves the scheme {scheme!r}, which "
                            f"{served.spec.name!r} from {_source(served.plugin)} serves already; "
                            "nothing of the plugin was registered. Pick another scheme, or "
                            "register_backend(spec, replace=True) to override it on purpose."
                        )
            self.plugins.append(info)
            for spec in specs:
                self._add(spec, info)
            if self.serdes_loaded:
                self.serdes_loaded = False
                self.load_serdes()
            return specs

    def schemes(self) -> list[str]:
        self.ensure_loaded()
        return sorted(self._schemes)

    def resolve(self, scheme: str) -> BackendSpec:
        """The spec serving ``scheme``; raises with a fix when none or several do."""
        self.ensure_loaded()
        served = self._schemes.get(scheme, [])
        if len(served) > 1:
            names = " and ".join(f"{s.spec.name!r} from {_source(s.plugin)}" for s in served)
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

    def load_serdes(self) -> None:
        """Register the plugins' serdes with :mod:`kvplug.serde`, once per discovery."""
        with self._lock:
            if self.serdes_loaded and plugin_serdes_added_by(self):
                return
            self.serdes_loaded = True
            forget_plugin_serdes()
            add_plugin_serdes(self.serdes(), owner=self)

    def serdes(self) -> list[tuple[type[Serde], str]]:
        """Every serde class that plugins provide, with the plugin each comes from.

        A plugin whose ``kvplug_serdes`` fails or returns something other than a named
        :class:`~kvplug.serde.Serde` subclass is a :class:`PluginWarning`, and its serdes are
        left out.
        """
        self.ensure_loaded()
        found: list[tuple[type[Serde], str]] = []
        for impl in self.manager.hook.kvplug_serdes.get_hookimpls():
            info = self._infos.get(impl.plugin_name)
            source = _source(info) if info is not None else f"plugin {impl.plugin_name!r}"
            serdes: list[type[Serde]] = []
            try:
                for serde in cast(Iterable[object], impl.function() or []):
                    if not (
                        isinstance(serde, type)
                        and issubclass(serde, Serde)
                        and isinstance(getattr(serde, "name", None), str)
                        and serde.name
                    ):
                        raise TypeError(f"{serde!r} is not a Serde subclass with a name")
                    serdes.append(serde)
            except Exception as error:
                disable = f" (KVPLUG_DISABLE_PLUGINS={info.name})" if info is not None else ""
                warnings.warn(
                    f"kvplug_serdes of {source} failed ({type(error).__name__}: {error}); its "
                    f"serdes are unavailable. Upgrade the plugin or disable it{disable}.",
                    PluginWarning,
                    stacklevel=5,
                )
                continue
            found.extend((serde, source) for serde in serdes)
            if info is not None:
                info.serdes = sorted(serde.name for serde in serdes)
        return found


def _source(info: PluginInfo) -> str:
    """Where a plugin comes from, for messages: its distribution and version, or its name for
    one registered at runtime with :func:`register_plugin`."""
    if info.distribution == RUNTIME_DISTRIBUTION and info.name != _RUNTIME_BACKENDS:
        return f"plugin {info.name!r} {RUNTIME_DISTRIBUTION}"
    return f"{info.distribution} {info.version}".rstrip()


_registry = Registry()


def registry() -> Registry:
    """The process-wide registry."""
    return _registry


def reset_registry() -> None:
    """Forget every discovered plugin, so the next call discovers them again (for tests)."""
    global _registry
    _registry = Registry()
    forget_plugin_serdes()


def register_backend(spec: BackendSpec, *, replace: bool = False) -> None:
    """Serve ``spec``'s schemes from this process without an entry point."""
    _registry.register(spec, replace)


def register_plugin(plugin: object, *, name: str | None = None) -> list[BackendSpec]:
    """Register a plugin object (a module or any object with ``@hookimpl`` functions) from this
    process, as if an entry point named it, and return the specs it serves.

    It is checked as a discovered plugin is, but here a problem raises at once:
    :class:`~kvplug.errors.PluginLoadError` for a function marked ``@hookimpl`` that is not a
    kvplug hook (a misspelling such as ``kvplug_backend``), one that takes arguments its hook
    does not pass, an invalid :class:`BackendSpec` or a failing hook;
    :class:`~kvplug.errors.PluginConflict` for a scheme another plugin serves. Nothing of a
    rejected plugin stays registered. ``name`` defaults to the object's ``__name__``.

    Example::

        >>> import kvplug
        >>> class Acme:
        ...     @kvplug.hookimpl
        ...     def kvplug_backend(self):  # misspelled: kvplug_backends
        ...         return []
        >>> try:
        ...     kvplug.register_plugin(Acme(), name="acme-doc")
        ... except kvplug.PluginLoadError as error:
        ...     print("Rename it to 'kvplug_backends'" in str(error))
        True
    """
    plugin_name = name or getattr(plugin, "__name__", None) or type(plugin).__name__
    return _registry.register_plugin(plugin, plugin_name)


def available_schemes() -> list[str]:
    """Every scheme an installed plugin serves."""
    return _registry.schemes()


def plugins() -> list[PluginInfo]:
    """Every discovered plugin, including those that failed to load."""
    _registry.ensure_loaded()
    return list(_registry.plugins)


def load_plugin_serdes() -> None:
    """Register the serdes that plugins provide through ``kvplug_serdes`` (once per discovery).

    A serde name served twice is not resolved here: :func:`kvplug.serde.get_serde` raises
    :class:`~kvplug.errors.PluginConflict` naming both sources when that name is used.
    """
    _registry.load_serdes()


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
    "plugin_env",
    "plugins",
    "register_backend",
    "register_plugin",
    "registry",
    "reset_registry",
]
