"""The contract suite against whole tiers configs, opened as a Store (``store:///path``): host
memory in front of a local disk, and host memory in front of a real redis-server. Also the
``kvplug contract --config FILE`` command a user runs for the same check."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from kvplug_contracts import BackendContract
from kvplug_testing import RedisServer

KVPLUG = str(Path(sys.executable).with_name("kvplug"))


def write_config(directory: Path, tiers: list[str]) -> Path:
    path = directory / "kvplug.yaml"
    path.write_text(yaml.safe_dump({"tiers": tiers}))
    return path


@pytest.fixture(scope="module")
def cpu_file_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("store-cpu-file")
    return write_config(
        directory, ["cpu://?max_size=256MiB", f"file://{directory}/disk?max_size=1GiB"]
    )


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def cpu_redis_config(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Path:
    directory = tmp_path_factory.mktemp("store-cpu-redis")
    return write_config(directory, ["cpu://?max_size=256MiB", redis_server.url])


class TestStoreOverCpuAndFileConformance(BackendContract):
    @pytest.fixture
    def kvplug_url(self, cpu_file_config: Path) -> str:
        return f"store://{cpu_file_config}"


@pytest.mark.redis
class TestStoreOverCpuAndRedisConformance(BackendContract):
    @pytest.fixture
    def kvplug_url(self, cpu_redis_config: Path) -> str:
        return f"store://{cpu_redis_config}"

    @pytest.fixture
    def server_control(self, redis_server: RedisServer) -> RedisServer:
        return redis_server


def test_kvplug_contract_with_a_config_file_checks_the_whole_store(cpu_file_config: Path) -> None:
    done = subprocess.run(
        [KVPLUG, "contract", "--config", str(cpu_file_config)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert f"store://{cpu_file_config}" in output
    assert "cpu://: backend 'cpu'" in output and "file://: backend 'disk'" in output
    assert ": PASS (clauses 6, 9, 10 waived);" in output and " failed" not in output
    assert "waived: a Store fills as its tiers do" in output, output


def test_kvplug_contract_needs_a_url_or_a_config_but_not_both(cpu_file_config: Path) -> None:
    for args in ([], ["cpu://", "--config", str(cpu_file_config)]):
        done = subprocess.run(
            [KVPLUG, "contract", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2, done.stdout + done.stderr
        assert "give a backend URL or --config FILE" in done.stderr
