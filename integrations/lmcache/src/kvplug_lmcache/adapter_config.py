"""The ``adapter_params`` of :class:`~kvplug_lmcache.l2_adapter.KvplugL2Adapter`: each key,
its default and its check (:class:`KvplugL2AdapterConfig`), and the backend they name
(:func:`backend_url_and_options`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase

from kvplug.errors import ConfigError
from kvplug.runtime.engine import check_keys, check_target, flag, positive_seconds
from kvplug.runtime.store import store_url
from kvplug.secrets import mask_url
from kvplug.units import parse_size

DEFAULT_TASK_TIMEOUT = 60.0
"""Seconds one store, lookup or load task may take before it is reported failed."""
DEFAULT_LOCK_TTL = 300.0
"""Seconds a lock lasts when LMCache never gives it back."""
_PARAMS = {
    "url": "a kvplug URL, e.g. file:///var/cache/kv or redis://host:6379",
    "config": "the path of a kvplug tiers YAML (instead of url)",
    "options": "kvplug backend options (or Store options with config), a mapping",
    "capacity": "bytes the adapter reports as its capacity (int or '100GiB'); default: the "
    "backend's max_size when it has one, else 0 (unknown)",
    "task_timeout": f"seconds a store, lookup or load may take (default {DEFAULT_TASK_TIMEOUT})",
    "lock_ttl": f"seconds a lock lasts unless unlocked earlier (default {DEFAULT_LOCK_TTL})",
    "check_on_start": "fail at start when the backend is unreachable (default true)",
    "pin_locked": "pin locked keys on backends that can pin (default true)",
}


class KvplugL2AdapterConfig(L2AdapterConfigBase):  # type: ignore[misc]  # lmcache is untyped
    """The ``adapter_params`` of :class:`KvplugL2Adapter`, checked when LMCache builds it.

    Fields:
        url: any kvplug URL (``cpu://?max_size=8GiB``, ``file:///var/cache/kv``,
            ``redis://host:6379``, ``store:///etc/kvplug.yaml``, ...).
        config: the path of a kvplug tiers YAML; give exactly one of ``url`` and ``config``.
        options: kvplug backend options (Store options with ``config``), e.g.
            ``{"timeout": 5}``.
        capacity: bytes reported as the adapter's capacity (an int or ``"100GiB"``); with a
            capacity LMCache's aggregate L2 eviction can run (``"eviction"`` in the adapter
            JSON). Default: the backend's ``max_size`` when it has one (cpu, file, a Store of
            such tiers), else 0, which LMCache reads as unknown.
        task_timeout: seconds one store, lookup or load may take before it is reported as
            failed (default 60).
        lock_ttl: seconds a lookup's lock lasts unless it is unlocked earlier (default 300);
            a bound for locks whose lookup result LMCache never collected.
        check_on_start: when true (the default), a backend that does not answer at start
            fails the adapter (and ``lmcache server``) with kvplug's message; when false the
            adapter starts anyway and its loads miss until the backend answers.
        pin_locked: pin locked keys on backends that can pin (default true).

    Example::

        >>> config = KvplugL2AdapterConfig.from_dict(
        ...     {"url": "cpu://?max_size=64MiB", "capacity": "64MiB"}
        ... )
        >>> config.url, config.capacity, config.task_timeout
        ('cpu://?max_size=64MiB', 67108864, 60.0)
        >>> try:
        ...     KvplugL2AdapterConfig.from_dict({"urll": "cpu://"})
        ... except ConfigError as error:
        ...     print(str(error).split(" kvplug's keys")[0])
        KvplugL2Adapter: unknown key(s) 'urll' (did you mean 'url'?) in adapter_params.
    """

    def __init__(
        self,
        url: str | None = None,
        config: str | None = None,
        options: Mapping[str, Any] | None = None,
        capacity: int | None = None,
        task_timeout: float = DEFAULT_TASK_TIMEOUT,
        lock_ttl: float = DEFAULT_LOCK_TTL,
        check_on_start: bool = True,
        pin_locked: bool = True,
    ) -> None:
        self.url = url
        self.config = config
        self.options: dict[str, Any] = dict(options or {})
        self.capacity = capacity
        self.task_timeout = task_timeout
        self.lock_ttl = lock_ttl
        self.check_on_start = check_on_start
        self.pin_locked = pin_locked

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KvplugL2AdapterConfig:
        """Check ``adapter_params``; raises :class:`~kvplug.errors.ConfigError` naming the
        field, what is wrong and what to write instead."""
        if not isinstance(d, Mapping):
            raise ConfigError(
                f"KvplugL2Adapter adapter_params must be a JSON object, got {type(d).__name__}."
            )
        check_keys(d, _PARAMS, what="KvplugL2Adapter", where="adapter_params")
        url, config, options = d.get("url"), d.get("config"), d.get("options")
        check_target(url, config, options, what="KvplugL2Adapter adapter_params")
        capacity = d.get("capacity")
        if capacity is not None:
            capacity = parse_size(capacity, what="KvplugL2Adapter adapter_params.capacity")
        what = "KvplugL2Adapter adapter_params"
        seconds = {
            name: positive_seconds(d.get(name, default), name=name, what=what)
            for name, default in (
                ("task_timeout", DEFAULT_TASK_TIMEOUT),
                ("lock_ttl", DEFAULT_LOCK_TTL),
            )
        }
        flags = {
            name: flag(d.get(name, True), name=name, what=what)
            for name in ("check_on_start", "pin_locked")
        }
        return cls(
            url=url,
            config=config,
            options=options,
            capacity=capacity,
            task_timeout=seconds["task_timeout"],
            lock_ttl=seconds["lock_ttl"],
            **flags,
        )

    @classmethod
    def help(cls) -> str:
        fields = "\n".join(f"- {name}: {meaning}" for name, meaning in _PARAMS.items())
        return (
            "kvplug L2 adapter (type 'plugin', module_path 'kvplug_lmcache.l2_adapter', "
            f"class_name 'KvplugL2Adapter'); adapter_params:\n{fields}\n"
            'Example: {"type": "plugin", "module_path": "kvplug_lmcache.l2_adapter", '
            '"class_name": "KvplugL2Adapter", "adapter_params": {"url": "file:///var/cache/kv"}}'
        )

    def target(self) -> str:
        """What the adapter opens, safe to print (passwords masked)."""
        if self.url is not None:
            return mask_url(self.url)
        return f"the tiers of {self.config}"

    def __repr__(self) -> str:
        return f"KvplugL2AdapterConfig({self.target()})"


def backend_url_and_options(adapter_params: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """The kvplug URL and options of the backend :class:`KvplugL2Adapter` opens for
    ``adapter_params`` (of LMCache's ``--l2-adapter`` JSON), checked by
    :meth:`KvplugL2AdapterConfig.from_dict` as at the server's start: ``url`` as given, or for
    ``config`` the ``store://`` URL of that tiers YAML (the same Store over the same tiers), with
    ``options``. ``kvplug.open_backend(url, **options)`` opens that backend, as the contract
    suite does in ``integrations/lmcache/tests/test_lmcache_contract.py``.

    Example::

        >>> backend_url_and_options({"url": "redis://cache-1:6379", "options": {"timeout": 5}})
        ('redis://cache-1:6379', {'timeout': 5})
        >>> backend_url_and_options({"config": "/etc/kvplug.yaml"})
        ('store:///etc/kvplug.yaml', {})
    """
    config = KvplugL2AdapterConfig.from_dict(dict(adapter_params))
    url = config.url
    if config.config is not None:
        url = store_url(config.config)
    return str(url), dict(config.options)
