"""What the engine benchmarks share: a result cell from paired passes of kvplug and a peer.

Each pass of kvplug is paired with the peer's pass of the same round; the ratio of a pair is
the peer's time / kvplug's, and the cell's ratio is the median of the pairs' (above 1.0: kvplug
is faster).
"""

from __future__ import annotations

import statistics
from typing import Any

TARGET_RATIO = 1.0


def ratio_cell(ours: list[float], theirs: list[float], nbytes: int, peer: str) -> dict[str, Any]:
    """GB/s of the median pass of each side, and the median and range of the pairs' ratios."""
    ratios = [t / o for o, t in zip(ours, theirs, strict=True)]
    return {
        "kvplug_gb_s": nbytes / statistics.median(ours) / 1e9,
        f"{peer}_gb_s": nbytes / statistics.median(theirs) / 1e9,
        "ratio": statistics.median(ratios),
        "pass_ratios": (min(ratios), max(ratios)),
    }


def cell_text(cell: dict[str, Any], peer: str) -> str:
    """``kvplug GB/s  peer GB/s  ratio (per pass low-high)``, flagged below the target."""
    low, high = cell["pass_ratios"]
    flag = "" if cell["ratio"] >= TARGET_RATIO else "  below target"
    return (
        f"{cell['kvplug_gb_s']:>7.2f} GB/s {cell[f'{peer}_gb_s']:>8.2f} GB/s   "
        f"{cell['ratio']:.2f}x (per pass {low:.2f}-{high:.2f}){flag}"
    )
