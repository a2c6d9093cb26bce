"""Kept so that imports from ``kvplug.sync``, written before the runtime had a package of
its own, keep working: SyncClient lives in :mod:`kvplug.runtime.sync`."""

from kvplug.runtime.sync import *  # noqa: F403
from kvplug.runtime.sync import __all__ as __all__
