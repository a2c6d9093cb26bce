"""Kept so that imports from ``kvplug.integration``, written before the runtime had a package of
its own, keep working: what the engine integrations share lives in :mod:`kvplug.runtime.engine`."""

from kvplug.runtime.engine import *  # noqa: F403
from kvplug.runtime.engine import __all__ as __all__
