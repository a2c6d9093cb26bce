"""The whole kvplug contract against the backend SGLang's HiCache L3 storage opens from a typical
``--hicache-storage-backend-extra-config``: a kvplug tiers YAML, host memory in front of a local
disk, read by the integration's own config check (``kvplug_sglang.backend_url_and_options``)."""

from pathlib import Path
from typing import Any

import pytest
import yaml

from kvplug_contracts import BackendContract
from kvplug_sglang import backend_url_and_options


@pytest.fixture
def extra_config(tmp_path: Path) -> dict[str, Any]:
    tiers = tmp_path / "kvplug.yaml"
    tiers.write_text(
        yaml.safe_dump({"tiers": ["cpu://?max_size=256MiB", f"file://{tmp_path}/l3?max_size=1GiB"]})
    )
    return {
        "backend_name": "kvplug",
        "module_path": "kvplug_sglang",
        "class_name": "KvplugHiCacheStorage",
        "interface_v1": 1,
        "config": str(tiers),
    }


class TestSglangContract(BackendContract):
    """Every clause of the kvplug contract against what ``KvplugHiCacheStorage`` opens."""

    @pytest.fixture
    def kvplug_url(self, extra_config: dict[str, Any]) -> str:
        return backend_url_and_options(extra_config)[0]

    @pytest.fixture
    def kvplug_options(self, extra_config: dict[str, Any]) -> dict[str, Any]:
        return backend_url_and_options(extra_config)[1]
