"""The whole kvplug contract against the backend vLLM's offloading connector gets from a typical
``secondary_tiers`` entry: a kvplug tiers YAML, host memory in front of a local disk, read by the
integration's own config check (``kvplug_vllm.backend_url_and_options``)."""

from pathlib import Path
from typing import Any

import pytest
import yaml

from kvplug_contracts import BackendContract
from kvplug_vllm import backend_url_and_options


@pytest.fixture
def tier_config(tmp_path: Path) -> dict[str, Any]:
    tiers = tmp_path / "kvplug.yaml"
    tiers.write_text(
        yaml.safe_dump({"tiers": ["cpu://?max_size=256MiB", f"file://{tmp_path}/kv?max_size=1GiB"]})
    )
    return {"type": "kvplug", "config": str(tiers), "locality": "LOCAL"}


class TestVllmContract(BackendContract):
    """Every clause of the kvplug contract against what ``KvplugTier`` opens."""

    @pytest.fixture
    def kvplug_url(self, tier_config: dict[str, Any]) -> str:
        return backend_url_and_options(tier_config)[0]

    @pytest.fixture
    def kvplug_options(self, tier_config: dict[str, Any]) -> dict[str, Any]:
        return backend_url_and_options(tier_config)[1]
