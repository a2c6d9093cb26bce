"""kvplug's runtime: what an engine or an operator runs on top of the vendor SDK.

The SDK (``kvplug.backend``, ``memory``, ``keys``, ``frame``, ``serde``, ``registry``,
``errors``, ``options``, ``url`` and their helpers) is all a backend author needs; nothing in it
imports this package. The runtime builds on it:

* :mod:`kvplug.runtime.store`: the tiered :class:`~kvplug.runtime.store.Store` (itself a backend);
* :mod:`kvplug.runtime.config`: the configuration (tiers, ``remote_url``, LMCache's keys);
* :mod:`kvplug.runtime.sync`: :class:`~kvplug.runtime.sync.SyncClient`, the backend from threads;
* :mod:`kvplug.runtime.engine`: what the engine integrations share (bounded jobs, health);
* :mod:`kvplug.runtime.gpu`: copies between an engine's paged KV cache and kvplug chunks;
* :mod:`kvplug.runtime.metrics`: the Store's Prometheus export;
* :mod:`kvplug.runtime.cli`, :mod:`~kvplug.runtime.command`, :mod:`~kvplug.runtime.bench`:
  the ``kvplug`` command and its benchmark;
* :mod:`kvplug.runtime.plugin`: the ``store://`` scheme, so a config opens like any backend.

The older import paths (``kvplug.store``, ``kvplug.sync``, ``kvplug.config``, ``kvplug.gpu``,
``kvplug.metrics``, ``kvplug.integration``) keep working and name the same objects.
"""
