"""Kept so that imports from ``kvplug.gpu``, written before the runtime had a package of
its own, keep working: the paged-cache copies lives in :mod:`kvplug.runtime.gpu`."""

from kvplug.runtime.gpu import *  # noqa: F403
from kvplug.runtime.gpu import __all__ as __all__
