"""Kept so that imports from ``kvplug.store``, written before the runtime had a package of
its own, keep working: the Store lives in :mod:`kvplug.runtime.store`."""

from kvplug.runtime.store import *  # noqa: F403
from kvplug.runtime.store import __all__ as __all__
