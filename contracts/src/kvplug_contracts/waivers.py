"""What the suite waives and how it makes a store small, from what a backend declares: the
``contract_waivers`` of the classes behind a URL (with ``--kvplug-waive``), and the one option
of a backend named as a size limit (for clauses 8 and 9 without ``contract_small_options``)."""

from __future__ import annotations

import contextlib
import re
from typing import Any

import pytest

import kvplug
from kvplug import Backend
from kvplug.registry import registry
from kvplug.runtime.store import Store
from kvplug.url import BackendURL, split_chain
from kvplug_contracts.support import CLAUSES

WAIVERS_ATTRIBUTE = "contract_waivers"


def configured_waivers(config: pytest.Config, url: str | None) -> dict[int, str]:
    """The clauses waived for this run, with their reasons: the ``contract_waivers`` of the
    classes of ``url``'s chain (for a ``store://`` URL, those every tier waives), then
    ``--kvplug-waive CLAUSE=REASON``."""
    waived: dict[int, str] = {}
    if url:
        # A URL that does not resolve reports its own error where it is opened.
        with contextlib.suppress(kvplug.KvplugError):
            waived.update(_declared_waivers(url))
    for pair in config.getoption("--kvplug-waive"):
        number, _, reason = pair.partition("=")
        if not number.strip().isdigit() or int(number) not in CLAUSES or not reason.strip():
            raise pytest.UsageError(
                f"--kvplug-waive {pair!r} is not CLAUSE=REASON with a clause of 1 to "
                f"{max(CLAUSES)} and a reason; write e.g. --kvplug-waive '10=in-process, no "
                "server to pause'"
            )
        waived[int(number)] = reason.strip()
    return waived


def _declared_waivers(url: str) -> dict[int, str]:
    waived: dict[int, str] = {}
    for part in split_chain(url):
        parsed = BackendURL.parse(part if "://" in part else f"{part}://")
        spec = registry().resolve(parsed.scheme)
        if spec.kind != "backend":
            continue
        factory = registry().factory(spec)
        if issubclass(factory, Store):
            tiers = [_declared_waivers(tier.url) for tier in Store.config_of(parsed).tiers]
            common = set.intersection(*(set(tier) for tier in tiers)) if tiers else set()
            waived.update({n: tiers[0][n] for n in sorted(common)})
        waived.update(getattr(factory, WAIVERS_ATTRIBUTE, {}))
    return waived


_SIZE_LIMIT = re.compile(
    r"^(max_?(size|bytes|memory|capacity)|capacity|(size|memory|capacity|bytes)_limit)$"
)
SMALL_SIZE = 4 << 20


def size_limit_option(backend_class: type[Backend]) -> dict[str, Any] | None:
    """``{name: 4 MiB}`` for the one option of ``backend_class.Options`` named as a size limit
    (``max_size``, ``capacity``, ``max_bytes``, ``max_memory``, ``size_limit``, ...), as an
    int, or as ``"4MiB"`` where the option is not an int; None when there is no such option,
    or more than one."""
    fields = backend_class.Options.model_fields
    named = [name for name in fields if _SIZE_LIMIT.match(name)]
    if len(named) != 1:
        return None
    name = named[0]
    return {name: SMALL_SIZE if fields[name].annotation is int else "4MiB"}


__all__ = ["SMALL_SIZE", "WAIVERS_ATTRIBUTE", "configured_waivers", "size_limit_option"]
