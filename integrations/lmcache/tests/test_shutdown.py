"""KvplugL2Adapter over a real redis-server leaves nothing behind when it ends: a process that
exits with adapters open (one with stores in flight), and one that closes adapters with stores
in flight while LMCache's controllers go on calling, print none of asyncio's warnings about
work left on a loop that went away ("Task was destroyed but it is pending!", "coroutine
ignored GeneratorExit", ...) and leave no thread running.
Each runs in a subprocess under ``-X dev`` (asyncio's debug mode, ResourceWarnings shown), the
adapter built from its plugin JSON as ``lmcache server`` builds it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lmcache", reason="these tests need LMCache (run them in an LMCache venv)")

from kvplug_testing import RedisServer

LOOP_WARNINGS = (
    "Task was destroyed",
    "ignored GeneratorExit",
    "was never awaited",
    "Exception ignored",
    "unclosed",
)
"""What asyncio and the interpreter print for work or connections left behind."""

PRELUDE = """
import sys, threading, time, warnings
sys.path.insert(0, {tests!r})
import torch
from lmcache_support import Driver, make_adapter, key, l1_object
warnings.simplefilter("always")
target = sys.argv[1]
params = (
    {{"url": target, "options": {{"timeout": 5}}}}
    if target.startswith("redis")
    else {{"config": target, "options": {{"timeout": 5}}}}
)
chunks = [l1_object(torch.randn(1 << 20).to(torch.float16)) for _ in range(8)]
"""

EXITS_OPEN = """
adapters = [make_adapter(params) for _ in range(3)]
for n, adapter in enumerate(adapters):
    assert Driver(adapter).store([key("exits-open", n)], [chunks[n]])
for n, chunk in enumerate(chunks):  # 2 MiB each: some are still being sent at exit
    adapters[-1].submit_store_task([key("exits-open", 10 + n)], [chunk])
print("exiting with the adapters open", flush=True)
"""

CLOSES_IN_FLIGHT = """
before = set(threading.enumerate())
for round_ in range(6):
    adapter = make_adapter(params)
    done = threading.Event()

    def controller() -> None:  # LMCache's controllers and its HTTP status, calling on
        n = 0
        while not done.is_set():
            try:
                adapter.submit_lookup_and_lock_task([key("closes", n)], {{}})
                adapter.submit_unlock([key("closes", n)])
                adapter.report_status()
            except Exception:
                pass
            n += 1

    callers = [threading.Thread(target=controller) for _ in range(2)]
    for caller in callers:
        caller.start()
    for n, chunk in enumerate(chunks):
        adapter.submit_store_task([key("closes", 100 * round_ + n)], [chunk])
    time.sleep(0.01 * round_)  # close at another point of the stores each round
    adapter.close()
    done.set()
    for caller in callers:
        caller.join(30)
    assert adapter.report_status()["closed"]
left = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
print("closed; threads left:", left, flush=True)
"""


@pytest.fixture(params=["redis", "tiers"])
def target(request: pytest.FixtureRequest, redis_server: RedisServer, tmp_path: Path) -> str:
    """A redis:// URL, or a tiers YAML of a cpu tier writing behind to that redis."""
    if request.param == "redis":
        return redis_server.url
    tiers = tmp_path / "kvplug.yaml"
    tiers.write_text(f"tiers: ['cpu://?max_size=64MiB', '{redis_server.url}']\n")
    return str(tiers)


def run_script(body: str, target: str, tmp_path: Path) -> str:
    script = tmp_path / "script.py"
    script.write_text(PRELUDE.format(tests=str(Path(__file__).parent)) + body)
    result = subprocess.run(
        [sys.executable, "-X", "dev", str(script), target],
        env={**os.environ, "PYTHONWARNINGS": "always"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    return output


def test_a_process_that_exits_with_adapters_open_prints_no_warning(
    target: str, tmp_path: Path
) -> None:
    output = run_script(EXITS_OPEN, target, tmp_path)
    assert "exiting with the adapters open" in output, output
    found = [warning for warning in LOOP_WARNINGS if warning in output]
    assert not found, output


def test_closing_with_stores_in_flight_prints_no_warning(target: str, tmp_path: Path) -> None:
    output = run_script(CLOSES_IN_FLIGHT, target, tmp_path)
    assert "closed; threads left: []" in output, output
    found = [warning for warning in LOOP_WARNINGS if warning in output]
    assert not found, output
