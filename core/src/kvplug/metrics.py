"""Kept so that imports from ``kvplug.metrics``, written before the runtime had a package of
its own, keep working: the Store's metrics export lives in :mod:`kvplug.runtime.metrics`."""

from kvplug.runtime.metrics import *  # noqa: F403
from kvplug.runtime.metrics import __all__ as __all__
