"""The whole kvplug contract against the backend LMCache gets in each mode, from a typical config
of that mode naming a kvplug tiers YAML (host memory in front of a local disk), read by the
integration's own config checks (``backend_url_and_options`` of ``kvplug_lmcache.l2_adapter``
and of ``kvplug_lmcache.connector``)."""

from pathlib import Path
from typing import Any

import pytest
import yaml
from lmcache.v1.config import LMCacheEngineConfig

from kvplug_contracts import BackendContract
from kvplug_lmcache import connector, l2_adapter


@pytest.fixture
def kvplug_tiers(tmp_path: Path) -> Path:
    tiers = tmp_path / "kvplug.yaml"
    tiers.write_text(
        yaml.safe_dump({"tiers": ["cpu://?max_size=256MiB", f"file://{tmp_path}/l2?max_size=1GiB"]})
    )
    return tiers


@pytest.fixture
def adapter_params(kvplug_tiers: Path) -> dict[str, Any]:
    """``adapter_params`` of ``lmcache server --l2-adapter '{"type": "plugin", ...}'``."""
    return {"config": str(kvplug_tiers), "task_timeout": 30}


@pytest.fixture
def lmcache_config(tmp_path: Path, kvplug_tiers: Path) -> Any:
    """An in-process LMCache config file as docs/lmcache.md shows it, loaded by LMCache."""
    prefix = "remote_storage_plugin.kvplug."
    config_file = tmp_path / "lmcache.yaml"
    config_file.write_text(
        yaml.safe_dump(
            {
                "chunk_size": 256,
                "local_cpu": True,
                "max_local_cpu_size": 5,
                "remote_serde": "naive",
                "remote_storage_plugins": ["kvplug"],
                "extra_config": {
                    prefix + "module_path": "kvplug_lmcache.connector",
                    prefix + "class_name": "KvplugConnector",
                    prefix + "config": str(kvplug_tiers),
                },
            }
        )
    )
    return LMCacheEngineConfig.from_file(str(config_file))


class TestL2AdapterContract(BackendContract):
    """Every clause of the kvplug contract against what ``KvplugL2Adapter`` opens (MP mode)."""

    @pytest.fixture
    def kvplug_url(self, adapter_params: dict[str, Any]) -> str:
        return l2_adapter.backend_url_and_options(adapter_params)[0]

    @pytest.fixture
    def kvplug_options(self, adapter_params: dict[str, Any]) -> dict[str, Any]:
        return l2_adapter.backend_url_and_options(adapter_params)[1]


class TestConnectorContract(BackendContract):
    """Every clause of the kvplug contract against what ``KvplugConnector`` opens (in-process
    mode)."""

    @pytest.fixture
    def kvplug_url(self, lmcache_config: Any) -> str:
        return connector.backend_url_and_options(lmcache_config)[0]

    @pytest.fixture
    def kvplug_options(self, lmcache_config: Any) -> dict[str, Any]:
        return connector.backend_url_and_options(lmcache_config)[1]
