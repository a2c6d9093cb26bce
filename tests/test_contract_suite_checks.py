"""Self-tests of the contract suite's checks that need more than "the clause catches its broken
backend": that the hostile-name check keeps a traversing backend's files inside the suite's
sandbox, and that ``--kvplug-large`` passes a correct backend (issue 15, items 6 and 11).

The runs use ``run_suite`` of ``test_contract_suite.py``: the suite in-process, with the backends
of ``contract_backends.py`` registered.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_contract_suite import RunSuite, run_suite

pytest_plugins = ("pytester",)

__all__ = ["run_suite"]  # the fixture, used by name below

LARGE_RUN_MEMORY = 12 << 30
"""Memory the --kvplug-large run needs free: the object, get's result and a stored copy."""


def _available_memory() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _key_files(top: Path) -> list[Path]:
    """Files and directories under ``top`` named like a key string (``model@1@0@...``)."""
    return [path for path in top.rglob("*") if "@" in path.name]


def test_a_backend_writing_files_named_by_the_key_is_caught_and_contained(
    run_suite: RunSuite, pytester: pytest.Pytester
) -> None:
    given = pytester.path / "given-root"
    given.mkdir()
    run = run_suite(f"writes-files-named-by-the-key://{given}", "-k", "hostile_model_names")
    assert run.result.ret == pytest.ExitCode.TESTS_FAILED, run.output
    assert "clause 12 (" in run.output, run.output
    assert "outside its root" in run.output, run.output
    # The suite opened the backend on its own sandbox, not on the URL's directory...
    assert _key_files(given) == [], run.output
    # ...where the traversing names did leave the root, but never the sandbox.
    sandboxes = list((pytester.path.parent / "basetemp").glob("kvplug-sandbox[0-9]*"))
    assert len(sandboxes) == 1, sandboxes
    (sandbox,) = sandboxes
    roots = list(sandbox.rglob("root"))
    written = _key_files(sandbox)
    assert any(roots[0] not in path.parents for path in written), written
    escaped = [
        path
        for path in _key_files(pytester.path.parent)
        if sandbox not in path.parents and path != sandbox
    ]
    assert escaped == [], escaped
    assert not any("@" in entry.name for entry in Path("/").iterdir())


@pytest.mark.slow
@pytest.mark.skipif(
    _available_memory() < LARGE_RUN_MEMORY,
    reason=f"the --kvplug-large run needs {LARGE_RUN_MEMORY >> 30} GiB of free memory",
)
def test_kvplug_large_round_trips_an_object_over_two_gib_through_cpu(run_suite: RunSuite) -> None:
    run = run_suite("cpu://", "--kvplug-large", "-k", "round_trip_beyond_two_gib")
    assert run.result.ret == pytest.ExitCode.OK, run.output
    assert run.rows[2]["passed"] == 1, run.output
    assert run.rows[2]["n/a"] == 0, run.output
