"""Fixtures over :mod:`kvplug_vllm.testing`, the harness that drives vLLM's own tiering manager
without a GPU."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

from kvplug_vllm.testing import Engine, offloading_config


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    """Engines a test starts (``engines.append(Engine(...))``), shut down after it."""
    started: list[Engine] = []
    yield started
    for engine in started:
        engine.close()


@pytest.fixture
def start(engines: list[Engine]) -> Any:
    """``start(tier_settings, **config)``: a new engine whose one secondary tier is kvplug."""

    def make(tier: dict[str, Any], **config: Any) -> Engine:
        engine = Engine(offloading_config([{"type": "kvplug", **tier}], **config))
        engines.append(engine)
        return engine

    return make
