"""Kept so that imports from ``kvplug.config``, written before the runtime had a package of
its own, keep working: the configuration lives in :mod:`kvplug.runtime.config`."""

from kvplug.runtime.config import *  # noqa: F403
from kvplug.runtime.config import __all__ as __all__
