"""The contract suite's own tests: pytester runs ``pytest --pyargs kvplug_contracts`` (the
contract of docs/concepts.md, "Backends") against the correct reference backend of
``contract_backends.py``, which must keep every clause, and against each broken backend there,
which must fail the clause it was built to violate, with a message that shows what was seen.

Every run is in-process, inside pytester's directory, where a conftest registers the backends at
runtime; the registry is reset after each test so nothing leaks into other tests.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import pytest

import kvplug_contracts.suite
import kvplug_contracts.test_conformance
from kvplug.registry import reset_registry
from kvplug_contracts.support import MAX_ABANDONED_LOOPS
from kvplug_testing import RedisServer

pytest_plugins = ("pytester",)

# Imported here once, so that the in-process runs below find the suite's modules loaded instead
# of importing (and assertion-rewriting) them again each time: that is most of a run's cost.
SUITE_MODULES = (kvplug_contracts.suite, kvplug_contracts.test_conformance)

MODULE = "kvplug_selftest_backends"
BACKENDS_SOURCE = (Path(__file__).parent / "contract_backends.py").read_text()
URL_ENV = "KVPLUG_CONTRACT_URL"
ALL_CLAUSES = frozenset(range(1, 17))

CONFTEST = f'''
import pytest
from hypothesis import Phase, settings

import {MODULE} as backends

backends.register_all("{MODULE}")

# The suite's patience while a server is down or a close hangs, shortened: the backends here
# answer in microseconds, so a broken one is told from a correct one just as well.
SHORTER_LIMITS = {{
    "DEADLINE_UNDER_TEST": 0.25,
    "HANG_MARGIN": 1.5,
    "RECOVERY_LIMIT": 2.0,
    "CLOSE_LIMIT": 1.5,
}}


def pytest_addoption(parser):
    parser.addoption("--only-clauses", default="", help="comma-separated clause numbers")


def pytest_collection_modifyitems(config, items):
    wanted = {{int(n) for n in config.getoption("--only-clauses").split(",") if n}}
    if not wanted:
        return
    keep, drop = [], []
    for item in items:
        marker = item.get_closest_marker("kvplug_clause")
        (keep if marker is not None and wanted & set(marker.args) else drop).append(item)
    items[:] = keep
    config.hook.pytest_deselected(items=drop)


@pytest.fixture(scope="session", autouse=True)
def shorter_suite_limits():
    from kvplug_contracts import leaks, plugin
    from kvplug_contracts.suite import lifecycle, model

    with pytest.MonkeyPatch.context() as patch:
        for name, value in SHORTER_LIMITS.items():
            patch.setattr(lifecycle, name, value)
        patch.setattr(plugin, "CLOSE_LIMIT", SHORTER_LIMITS["CLOSE_LIMIT"])
        # What a backend here leaves running never ends: the check need not wait long for it.
        patch.setattr(leaks, "LEAK_GRACE", 1.0)
        # A broken backend is caught by the first failing example; shrinking it only costs time.
        no_shrink = [phase for phase in Phase if phase is not Phase.shrink]
        quick = settings(model.MACHINE_SETTINGS, phases=no_shrink, database=None)
        patch.setattr(model, "MACHINE_SETTINGS", quick)
        yield


@pytest.fixture
def server_control():
    backends.SERVER.reset()
    yield backends.SERVER
    backends.SERVER.reset()


@pytest.fixture(scope="session", autouse=True)
def stop_what_backends_left_running():
    yield
    for stop in backends.LEFT_RUNNING:
        stop()
'''


@dataclass
class SuiteRun:
    """One in-process run of the suite: its result and its per-clause summary."""

    result: pytest.RunResult
    rows: dict[int, dict[str, Any]] = field(default_factory=dict)

    @property
    def output(self) -> str:
        return "\n".join(self.result.outlines + self.result.errlines)

    def clauses(self, outcome: str) -> set[int]:
        """The clauses with at least one test of ``outcome`` ("failed", "passed", ...)."""
        return {n for n, row in self.rows.items() if row[outcome]}

    def verdicts(self) -> dict[int, str]:
        """Each clause's verdict: "pass", "FAIL", "known", "n/a" or "not run"."""
        return {n: row["verdict"] for n, row in self.rows.items()}


class RunSuite(Protocol):
    def __call__(self, url: str | None, *args: str) -> SuiteRun: ...


@pytest.fixture
def run_suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Iterator[RunSuite]:
    """``run_suite(url, *args)``: the whole suite against ``url`` (None: no --kvplug-url), with
    the backends of ``contract_backends.py`` registered."""
    monkeypatch.delenv(URL_ENV, raising=False)
    pytester.makeini("[pytest]\n")
    pytester.makepyfile(**{MODULE: BACKENDS_SOURCE})
    pytester.makeconftest(CONFTEST)
    pytester.syspathinsert()
    summary = pytester.path / "summary.json"

    def run(url: str | None, *args: str) -> SuiteRun:
        argv = [
            "--pyargs",
            "kvplug_contracts",
            "-p",
            "no:cacheprovider",
            "-q",
            "-rfEX",
            "-W",
            "ignore::pytest.PytestAssertRewriteWarning",
            "--kvplug-timeout",
            "10",
            "--kvplug-summary-json",
            str(summary),
        ]
        if url is not None:
            argv += ["--kvplug-url", url]
        summary.unlink(missing_ok=True)
        result = pytester.runpytest(*argv, *args)
        rows = json.loads(summary.read_text()) if summary.exists() else []
        return SuiteRun(result, {row["clause"]: row for row in rows})

    try:
        yield run
    finally:
        reset_registry()


# -- the reference backend keeps every clause ---------------------------------------------------


def test_reference_backend_keeps_every_clause(run_suite: RunSuite) -> None:
    run = run_suite("ref://")
    assert run.result.ret == 0, run.output
    assert run.clauses("failed") == set(), run.output
    assert run.clauses("passed") == ALL_CLAUSES, run.output
    assert run.verdicts() == dict.fromkeys(ALL_CLAUSES, "pass"), run.output
    assert run.clauses("not run") == set(), run.output
    # The only test it skips: objects over 2 GiB, checked only with --kvplug-large.
    assert run.rows[2]["n/a"] == 1
    assert sum(row["n/a"] for row in run.rows.values()) == 1, run.output
    assert_nothing_left_behind(run)


# -- each broken backend is caught by the clause it violates ----------------------------------


@dataclass(frozen=True)
class Broken:
    """A backend of ``contract_backends.BROKEN``; the clause that must catch it; a fragment of
    the violation message showing what was seen. ``full`` cases run the whole suite and check
    that no other clause fails but those in ``also`` (where the same bug shows through another
    clause's tests); the others run only the tests of their clause, to keep the file fast."""

    scheme: str
    clause: int
    shows: str
    full: bool = False
    also: frozenset[int] = frozenset()

    def __str__(self) -> str:
        return f"clause{self.clause}-{self.scheme}"


BROKEN = [
    Broken("get-raises-on-miss", 1, "raised KeyError"),
    Broken("flips-a-bit-on-read", 2, "1 of 262144 bytes differ; first at byte"),
    Broken("stores-bfloat16-as-float16", 2, "dtype torch.float16, expected torch.bfloat16", True),
    Broken("tears-overwrites", 3, "read(s) matched none of the written objects"),
    Broken("counts-all-present-keys", 4, "keys 0 1 2 3 4 returned 4, expected 3", True),
    Broken("batched-get-drops-misses", 4, "position 1 is a missing key but got MemoryObj"),
    Broken(
        "exists-answers-in-key-order",
        4,
        "batched_exists of keys 1 0 1 0 (duplicates) returned [True, True, False, False]",
        True,
        frozenset({15, 16}),
    ),
    Broken("leaks-put-reference", 5, "still allocated: a reference was never released"),
    Broken("put-takes-callers-reference", 5, "after put the caller's object has ref_count 0"),
    Broken("unchecked-reads", 6, "damaged by 'flip' returned an object", True),
    Broken("keeps-damaged-data", 6, "contains is still True: the damaged object was not removed"),
    Broken("remove-always-true", 7, "remove of a key never stored did not return False", True),
    Broken("contains-remembers-removed", 7, "contains is True after remove"),
    Broken("evicts-pinned-keys", 8, "pinned key 0 after"),
    Broken(
        "unpin-raises-when-not-pinned",
        8,
        "unpin of a key never stored raised UnexpectedBackendError",
    ),
    Broken("pins-never-expire", 8, "the pin never expired", True),
    Broken("full-store-raises-runtime-error", 9, "raised RuntimeError: store full"),
    Broken("full-store-stops-reads", 9, "get raised CapacityExceeded"),
    Broken("no-deadline", 10, "get hung while the server was paused", True),
    Broken("no-recovery-after-restart", 10, "ConnectionResetError"),
    Broken("close-blocks-the-loop", 11, "did not finish within"),
    Broken("works-after-close", 11, "did not raise BackendClosed", True, frozenset({5})),
    Broken("second-close-raises", 11, "a second close of a closed backend raised BackendClosed"),
    Broken("ignores-model-name", 12, "a key escaped its namespace"),
    Broken("ignores-worker-id", 12, "@2@0@7@half' was never written", True),
    Broken("drops-the-tenant", 16, "salt%bob' was never written"),
    Broken("declares-pin-but-cannot", 13, "declares 'pin' but pin of a stored key raised"),
    Broken("undeclared-remove-works", 13, "'remove' is not declared, so remove", True),
    Broken("lets-go-late", 13, "still held 1 reference(s) to the caller's memory"),
    Broken("forgets-on-close", 14, "after close and reopen, contains of key 0 of 4 is False"),
    Broken("loses-concurrent-writes", 15, "missed after its put completed", True),
    Broken("keeps-first-write", 3, "returned the object of the earlier put: an overwrite must"),
    Broken("removes-in-two-steps", 15, "get during remove raised CorruptObject"),
    Broken("finds-then-reads", 15, "during remove raised UnexpectedBackendError"),
    Broken("allocates-elsewhere", 5, "not of the backend's allocator"),
    Broken(
        "binds-the-opening-loop",
        15,
        "in another thread's asyncio.run raised UnexpectedBackendError",
    ),
    Broken("truncates-hash-to-64-bits", 12, "a key escaped its namespace"),
    Broken("contains-ignores-key-prefix", 12, "the prefixes do not isolate"),
    Broken("writes-files-named-by-the-key", 12, "outside its root"),
]


def _case(param: Any) -> Broken:
    return param if isinstance(param, Broken) else param.values[0]


def test_every_clause_has_a_broken_backend() -> None:
    assert {_case(case).clause for case in BROKEN} == ALL_CLAUSES


@pytest.mark.parametrize("case", BROKEN, ids=str)
def test_clause_catches_the_backend_built_to_violate_it(run_suite: RunSuite, case: Broken) -> None:
    """The clause's tests fail, naming the clause and showing the values seen; for ``full``
    cases the whole suite runs and no unrelated clause fails."""
    only = () if case.full else ("--only-clauses", str(case.clause))
    run = run_suite(f"{case.scheme}://", *only)
    assert run.result.ret == pytest.ExitCode.TESTS_FAILED, run.output
    assert run.rows[case.clause]["failed"] > 0, run.output
    assert f"clause {case.clause} (" in run.output, run.output
    assert case.shows in run.output, run.output
    if case.full:
        assert run.clauses("failed") == {case.clause, *case.also}, run.output


# -- the suite's own features -----------------------------------------------------------------

VERBOSE = "-v"
"""Undoes run_suite's -q: pytest prints report headers only at normal verbosity or above."""


def test_report_header_names_the_plugin_its_distribution_and_capabilities(
    run_suite: RunSuite,
) -> None:
    run = run_suite("cpu://", "--collect-only", VERBOSE)
    assert run.result.ret == pytest.ExitCode.OK, run.output
    run.result.stdout.fnmatch_lines(
        [
            "kvplug contract suite *: cpu://",
            "  cpu://: backend 'cpu' from kvplug-cpu *; schemes cpu; "
            "capabilities pin, zero_copy, remove, list_keys, releases_on_cancel",
        ]
    )


def test_report_header_names_backends_registered_at_runtime(run_suite: RunSuite) -> None:
    run = run_suite("audit::ref://?timeout=3", "--collect-only", VERBOSE)
    run.result.stdout.fnmatch_lines(
        [
            "kvplug contract suite *: audit::ref://?timeout=3",
            "  audit://: wrapper 'audit' from kvplug-audit *",
            "  ref://: backend 'ref' from <registered at runtime>*; schemes ref; capabilities "
            "pin, persistent, shared_across_processes, native_batching, remove, list_keys, "
            "releases_on_cancel",
        ]
    )


def test_known_failures_file_turns_failures_known_and_reports_fixed_ones(
    run_suite: RunSuite, pytester: pytest.Pytester
) -> None:
    xfails = pytester.makefile(
        ".txt",
        known=(
            "# remove-always-true:// under the contract suite\n"
            "test_remove_of_an_absent_key_returns_false   # remove says True for absent keys\n"
            "*::test_remove_deletes_and_then_reports_absence  # its second remove says True\n"
            "test_get_of_a_key_never_stored_returns_none  # listed, but this one is right\n"
        ),
    )
    selected = "remove_of_an_absent or remove_deletes or get_of_a_key_never_stored"
    run = run_suite("remove-always-true://", "--kvplug-xfails-file", str(xfails), "-k", selected)
    assert run.result.ret == pytest.ExitCode.OK, run.output
    assert run.rows[7]["known failure"] == 2, run.output
    assert run.rows[7]["failed"] == 0, run.output
    assert run.rows[1]["fixed known failure"] == 1, run.output
    run.result.stdout.fnmatch_lines(
        [
            "  1 pass    a miss returns None: *1 fixed known failure",
            "  7 known   remove of an absent key is False*: *2 known failure",
            "XPASS *::test_get_of_a_key_never_stored_returns_none - *listed, but this one is right",
        ],
        consecutive=False,
    )


def test_known_failures_file_that_does_not_exist_is_a_usage_error(run_suite: RunSuite) -> None:
    run = run_suite("ref://", "--kvplug-xfails-file", "no-such-file.txt")
    assert run.result.ret == pytest.ExitCode.USAGE_ERROR, run.output
    run.result.stderr.fnmatch_lines(["*known-failures file no-such-file.txt: No such file*"])


def test_missing_url_names_the_option_and_the_environment_variable(run_suite: RunSuite) -> None:
    run = run_suite(None, "-k", "get_of_a_key_never_stored")
    assert run.result.ret != pytest.ExitCode.OK
    assert (
        f"no backend to test: pass --kvplug-url URL (or set {URL_ENV}), for example "
        "pytest --pyargs kvplug_contracts --kvplug-url cpu://"
    ) in run.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "no backend to test: pass --kvplug-url URL"),
        (("--kvplug-url", "ref://", "--kvplug-option", "pin_ttl"), "is not NAME=VALUE"),
    ],
    ids=["missing-url", "option-without-value"],
)
def test_bad_command_line_is_one_usage_error_not_a_failure_of_every_clause(
    run_suite: RunSuite, args: tuple[str, ...], message: str
) -> None:
    run = run_suite(None, *args)
    assert run.result.ret == pytest.ExitCode.USAGE_ERROR, run.output
    run.result.stderr.fnmatch_lines([f"ERROR: *{message}*"])
    assert run.clauses("failed") == set(), run.output


def test_kvplug_option_reaches_the_backend_and_wins_over_the_query(
    run_suite: RunSuite, pytester: pytest.Pytester
) -> None:
    trace = pytester.path / "opened.jsonl"
    run = run_suite(
        "ref://?pin_ttl=7&key_prefix=from-query/",
        "--kvplug-option",
        f"trace_file={trace}",
        "--kvplug-option",
        "pin_ttl=42",
        "-k",
        "get_of_a_key_never_stored",
    )
    assert run.result.ret == pytest.ExitCode.OK, run.output
    opened = json.loads(trace.read_text().splitlines()[0])
    assert opened["pin_ttl"] == 42.0
    assert opened["key_prefix"] == "from-query/"
    assert opened["trace_file"] == str(trace)


def test_url_from_the_environment_variable(
    run_suite: RunSuite, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(URL_ENV, "ref://")
    run = run_suite(None, VERBOSE, "-k", "get_of_a_key_never_stored or round_trip_of_objects_from")
    assert run.result.ret == pytest.ExitCode.OK, run.output
    assert run.rows[1]["passed"] == 1
    assert run.rows[2]["passed"] == 1
    run.result.stdout.fnmatch_lines(["kvplug contract suite *: ref://"])


def _kvplug_contract(cwd: Path, *args: str) -> subprocess.Popen[str]:
    """``kvplug contract ARGS`` in a process of its own (it runs pytest itself)."""
    env = {k: v for k, v in os.environ.items() if k != URL_ENV}
    main = "from kvplug.runtime.cli import main; main()"
    command = [sys.executable, "-c", main, "contract", *args]
    return subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def test_kvplug_contract_command_passes_cpu_and_fails_blackhole_by_clause(
    tmp_path: Path,
) -> None:
    selected = ("-k", "get_of_a_key_never_stored or round_trip_of_objects_from")
    xfails = Path(__file__).parents[1] / "plugins/blackhole/contract-xfails.txt"
    processes = {
        "cpu": _kvplug_contract(tmp_path, "cpu://", *selected),
        "blackhole": _kvplug_contract(tmp_path, "blackhole://", *selected),
        "known": _kvplug_contract(
            tmp_path, "blackhole://", "--xfails-file", str(xfails), *selected
        ),
        "allowing": _kvplug_contract(tmp_path, "cpu://", "--allow-thread", "acme-", *selected),
    }
    done = {
        name: (process.communicate(timeout=120)[0], process.returncode)
        for name, process in processes.items()
    }

    not_run = (
        "with clauses 2, 3, 4, 5, 7, 8, 9, 11, 12, 13, 14, 15, 16 not run (clauses 6, 10 waived)"
    )
    output, code = done["cpu"]
    assert code == 0, output
    assert f"kvplug contract cpu://: PASS {not_run}; of 16 clauses 1 kept" in output
    assert "2 waived, 13 not run (the reasons are listed above)" in output
    assert "deselected (by -k, -m or another selection)" in output
    assert "backend 'cpu' from kvplug-cpu" in output and "capabilities pin, zero_copy" in output

    output, code = done["blackhole"]
    assert code == 1, output
    assert "kvplug contract blackhole://: FAIL (clause 2) with clauses 3, 4, " in output
    assert "; of 16 clauses 1 kept" in output
    assert "clause 2 (get after put is bit-identical) violated" in output

    output, code = done["known"]
    assert code == 0, output
    assert "kvplug contract blackhole://: PASS with clauses 3, 4, " in output
    assert "; of 16 clauses 1 kept, 1 with declared known failures" in output

    output, code = done["allowing"]
    assert code == 0, output
    assert "left nothing behind (" in output
    assert "; threads allowed by name prefix: acme-" in output


# -- honest reporting (issue 15) --------------------------------------------------------------


def test_a_leak_is_one_clause_5_failure_not_a_failure_of_the_leaking_tests_clauses(
    run_suite: RunSuite,
) -> None:
    """Every test that puts leaks there; the allocator's check at teardown names clause 5,
    and the clauses of the leaking tests keep the verdicts of their own checks."""
    run = run_suite("leaks-put-reference://")
    assert run.result.ret == pytest.ExitCode.TESTS_FAILED, run.output
    assert run.clauses("failed") == {5}, run.output
    assert {n for n, verdict in run.verdicts().items() if verdict != "pass"} == {5}, run.output
    assert "still allocated: a reference was never released" in run.output


def test_deselected_clauses_are_not_run_and_say_so(run_suite: RunSuite) -> None:
    run = run_suite("ref://", "-k", "get_of_a_key_never_stored")
    assert run.result.ret == pytest.ExitCode.OK, run.output
    assert run.verdicts() == {1: "pass", **dict.fromkeys(ALL_CLAUSES - {1}, "not run")}
    run.result.stdout.fnmatch_lines(
        ["  2 not run get after put is bit-identical: *not run", "*deselected (by -k*"]
    )


def test_the_summary_of_a_run_on_pytest_xdist_workers_counts_every_workers_tests(
    run_suite: RunSuite,
) -> None:
    """With -n the summary is printed by pytest-xdist's controller, which runs no test and
    collects nothing: it still counts each test under its clauses, the teardown failures that
    name a clause, the skips with their reasons, what the workers deselected and the leak
    check of every worker, as one process would."""
    selection = ("-k", "never_stored or bit_exact_for_every_dtype or beyond_two_gib")
    alone = run_suite("leaks-put-reference://", *selection)
    spread = run_suite("leaks-put-reference://", "-n", "2", *selection)
    assert "bringing up nodes" in spread.output, spread.output
    assert spread.result.ret == alone.result.ret == pytest.ExitCode.TESTS_FAILED, spread.output
    assert spread.clauses("failed") == {5}, spread.output
    assert {verdict for verdict in spread.verdicts().values()} >= {"FAIL", "pass", "not run"}

    def table(run: SuiteRun) -> dict[int, dict[str, Any]]:
        return {n: {**row, "reasons": sorted(row["reasons"])} for n, row in run.rows.items()}

    assert table(spread) == table(alone), spread.output
    leak_line = re.compile(r"^leak check: .*$", re.MULTILINE)
    assert leak_line.findall(spread.output) == leak_line.findall(alone.output) != []


def test_capacity_tests_are_not_run_without_small_options_and_say_how_to_enable_them(
    run_suite: RunSuite,
) -> None:
    run = run_suite("sized-by-arena://", "--only-clauses", "8,9")
    assert run.result.ret == pytest.ExitCode.OK, run.output
    assert run.verdicts()[8] == "not run", run.output
    assert run.verdicts()[9] == "not run", run.output
    run.result.stdout.fnmatch_lines(
        [
            "  8 not run pinned keys survive*",
            "*not run: the suite cannot make this store small enough to fill: declare "
            "contract_small_options*--kvplug-small-option NAME=VALUE*",
        ]
    )

    given = run_suite(
        "sized-by-arena://", "--only-clauses", "8,9", "--kvplug-small-option", "arena=4MiB"
    )
    assert given.result.ret == pytest.ExitCode.OK, given.output
    assert given.verdicts()[8] == given.verdicts()[9] == "pass", given.output


def test_a_size_limit_among_the_declared_options_is_found_without_small_options(
    run_suite: RunSuite,
) -> None:
    run = run_suite("no-small-options://", "--only-clauses", "8,9")
    assert run.result.ret == pytest.ExitCode.OK, run.output
    assert run.verdicts()[8] == run.verdicts()[9] == "pass", run.output


@pytest.mark.redis
def test_a_clause_not_run_makes_kvplug_contract_incomplete_unless_waived(tmp_path: Path) -> None:
    """Exit status 6 (INCOMPLETE), distinct from a failure, until the clause is waived with a
    reason; a clause deselected with -k does not count."""
    selected = ("-k", "get_of_a_key_never_stored or while_paused or while_stopped")
    with RedisServer() as server:
        runs = {
            "bare": _kvplug_contract(tmp_path, server.url, *selected),
            "waived": _kvplug_contract(
                tmp_path, server.url, "--waive", "10=checked through the proxy elsewhere", *selected
            ),
            "bad": _kvplug_contract(tmp_path, server.url, "--waive", "17=no such clause"),
        }
        done = {name: run.communicate(timeout=300)[0] for name, run in runs.items()}
    codes = {name: run.returncode for name, run in runs.items()}
    assert codes["bare"] == 6, done["bare"]
    assert "INCOMPLETE: clause 10 not run, not waived" in done["bare"], done["bare"]
    assert codes["waived"] == 0, done["waived"]
    assert "(clause 10 waived)" in done["waived"], done["waived"]
    assert "waived: checked through the proxy elsewhere" in done["waived"], done["waived"]
    assert codes["bad"] == 4, done["bad"]
    assert "--kvplug-waive '17=no such clause' is not CLAUSE=REASON" in done["bad"], done["bad"]


def test_a_waived_clause_shows_its_reason_in_the_summary(run_suite: RunSuite) -> None:
    run = run_suite(
        "sized-by-arena://", "--only-clauses", "9", "--kvplug-waive", "9=a store of its own kind"
    )
    assert run.result.ret == pytest.ExitCode.OK, run.output
    assert run.verdicts()[9] == "waived", run.output
    run.result.stdout.fnmatch_lines(["  9 waived  *", "*waived: a store of its own kind"])


def test_an_undeclared_capability_is_not_applicable_with_its_reason(run_suite: RunSuite) -> None:
    run = run_suite("no-pin://", "--only-clauses", "8")
    assert run.result.ret == pytest.ExitCode.OK, run.output
    assert run.verdicts()[8] == "n/a", run.output
    run.result.stdout.fnmatch_lines(
        ["  8 n/a     pinned keys survive*", "*not applicable: the backend does not declare 'pin'"]
    )


def test_an_operation_that_hangs_fails_fast_naming_the_clause_the_operation_and_the_key(
    run_suite: RunSuite,
) -> None:
    run = run_suite("get-sleeps://", "-k", "round_trip_of_objects_from", "--kvplug-timeout", "1.5")
    assert run.result.ret == pytest.ExitCode.TESTS_FAILED, run.output
    assert run.verdicts()[2] == "FAIL", run.output
    assert (
        "clause 2 (get after put is bit-identical) violated: get of kvplug-contract/" in run.output
    )
    assert "@1@0@0@half did not finish within 1.5 s (the suite's budget for one" in run.output


def test_a_close_that_blocks_the_loop_for_minutes_fails_clause_11_and_the_session_goes_on(
    run_suite: RunSuite,
) -> None:
    """Each close blocks the loop's thread for ten minutes: the suite gives up on that loop
    within seconds, goes on with a new one, and the tests of later clauses still pass."""
    run = run_suite("close-blocks-for-long://", "--only-clauses", "11,12")
    assert run.result.ret == pytest.ExitCode.TESTS_FAILED, run.output
    assert run.verdicts()[11] == "FAIL", run.output
    assert run.verdicts()[12] == "pass", run.output
    assert "did not finish within" in run.output


def test_a_backend_that_keeps_blocking_the_loop_stops_being_run_and_the_rest_is_not_run(
    run_suite: RunSuite,
) -> None:
    run = run_suite("get-blocks-the-loop://", "--only-clauses", "2", "--kvplug-timeout", "1")
    assert run.result.ret == pytest.ExitCode.TESTS_FAILED, run.output
    assert run.verdicts()[2] == "FAIL", run.output
    # The model test (clauses 1-4, 7) comes first and names its first clause.
    assert run.clauses("failed") <= {1, 2}, run.output
    failures = sum(row["failed"] for row in run.rows.values())
    assert 0 < failures <= MAX_ABANDONED_LOOPS, run.output
    assert run.rows[2]["not run"] > 0, run.output
    assert "the event loop then stayed blocked" in run.output
    assert "so the suite runs none of its operations any more" in run.output


def test_no_hypothesis_directory_is_left_in_the_working_directory(
    run_suite: RunSuite, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvplug_contracts.suite import model

    assert model.MACHINE_SETTINGS.database is None
    monkeypatch.delenv("HYPOTHESIS_STORAGE_DIRECTORY", raising=False)
    run = run_suite("ref://", "-k", "random_operations")
    assert run.result.ret == pytest.ExitCode.OK, run.output
    assert not (pytester.path / ".hypothesis").exists()


def test_a_vendors_contract_subclass_leaves_no_hypothesis_directory_either(
    run_suite: RunSuite, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HYPOTHESIS_STORAGE_DIRECTORY", raising=False)
    pytester.makepyfile(
        test_vendor=(
            "import pytest\n"
            "from kvplug_contracts.suite import BackendContract\n\n"
            "class TestRef(BackendContract):\n"
            "    @pytest.fixture\n"
            "    def kvplug_url(self):\n"
            "        return 'ref://'\n"
        )
    )
    result = pytester.runpytest("test_vendor.py", "-p", "no:cacheprovider", "-k", "random_op")
    assert result.ret == pytest.ExitCode.OK, "\n".join(result.outlines)
    result.assert_outcomes(passed=1)
    assert not (pytester.path / ".hypothesis").exists()


def test_the_command_agrees_with_the_suite_on_its_defaults() -> None:
    from kvplug_contracts import cli, plugin, support

    assert cli.DEFAULT_TIMEOUT == support.DEFAULT_TIMEOUT
    assert cli.VERDICTS == plugin.VERDICTS


def test_the_suite_depends_on_a_compatible_kvplug_release_not_an_exact_one() -> None:
    """Versioning policy (contracts/README.md): kvplug-contracts X.Y.z works with every kvplug
    X.Y.*, so its dependency is ``kvplug~=X.Y.0``, never ``==``."""
    import importlib.metadata

    version = (Path(__file__).parents[1] / "VERSION").read_text().strip()
    assert importlib.metadata.version("kvplug-contracts") == version
    major, minor, _ = version.split(".")
    requires = importlib.metadata.requires("kvplug-contracts") or []
    kvplug = [d.replace(" ", "") for d in requires if d.replace(" ", "").startswith("kvplug")]
    assert kvplug == [f"kvplug~={major}.{minor}.0"]
    readme = (Path(__file__).parents[1] / "contracts/README.md").read_text()
    assert "## Versioning" in readme


# -- nothing left running (issue 34) ----------------------------------------------------------

LEFT_BEHIND = (
    "*clause 11 (close is idempotent and bounded; later calls raise BackendClosed) violated: "
    "1 s after the test ended and every backend it opened was closed, it left behind "
)
"""How the leak check's failure starts (the self-test's conftest gives it 1 s of grace)."""
ONE_TEST = ("-k", "get_of_a_key_never_stored")
ALLOWED = "kvplug-selftest-"
"""A prefix of the name of the thread that leaves-a-thread-running:// keeps."""


def assert_nothing_left_behind(run: SuiteRun) -> None:
    """The leak check looked at every contract test that ran, and found nothing left."""
    found = re.search(r"leak check: (\d+) contract test\(s\) left nothing behind", run.output)
    assert found, run.output
    outcomes = run.result.parseoutcomes()
    ran = sum(outcomes.get(kind, 0) for kind in ("passed", "failed", "skipped", "xfailed"))
    assert int(found.group(1)) == ran, run.output


@pytest.mark.parametrize(
    ("scheme", "named"),
    [
        (
            "leaves-a-task-running",
            "1 asyncio task(s) still pending on the suite's event loop: <Task pending "
            "name='Task-*' coro=<LeavesATaskRunning._beat() running at *",
        ),
        (
            "leaves-a-thread-running",
            "1 thread(s) still running: 'kvplug-selftest-poller' (daemon, native id *)",
        ),
        (
            "leaves-a-process-running",
            "1 child process(es) still there: pid * (*python* -c import time; time.sleep(120))",
        ),
        ("leaves-a-port-listening", "1 port(s) still listening: 127.0.0.1:*"),
    ],
    ids=["task", "thread", "process", "port"],
)
def test_what_a_backend_leaves_running_after_close_fails_the_test_naming_it(
    run_suite: RunSuite, scheme: str, named: str
) -> None:
    run = run_suite(f"{scheme}://", *ONE_TEST)
    assert run.result.ret == pytest.ExitCode.TESTS_FAILED, run.output
    assert run.verdicts()[11] == "FAIL", run.output
    run.result.stdout.fnmatch_lines(
        [
            f"{LEFT_BEHIND}{named}. A backend's close must stop what the backend started*",
            "leak check: 1 of 1 contract test(s) left something behind*",
        ]
    )
    # The self-test's conftest stopped it when the session ended.
    assert not [t for t in threading.enumerate() if t.name.startswith(ALLOWED)]


@pytest.mark.parametrize("how", ["option", "ini", "marker"])
def test_a_thread_kept_by_design_passes_when_its_name_prefix_is_allowed(
    run_suite: RunSuite, pytester: pytest.Pytester, how: str
) -> None:
    if how == "option":
        result = run_suite(
            "leaves-a-thread-running://", *ONE_TEST, "--kvplug-allow-thread", ALLOWED
        )
        outcome = result.result
    elif how == "ini":
        pytester.makeini(f"[pytest]\nkvplug_allowed_threads =\n    {ALLOWED}\n")
        result = run_suite("leaves-a-thread-running://", *ONE_TEST)
        outcome = result.result
    else:
        pytester.makepyfile(
            test_vendor=(
                "import pytest\n"
                "from kvplug_contracts.suite import MissContract\n\n"
                f"@pytest.mark.kvplug_allow_threads({ALLOWED!r})\n"
                "class TestPoller(MissContract):\n"
                "    @pytest.fixture\n"
                "    def kvplug_url(self):\n"
                "        return 'leaves-a-thread-running://'\n"
            )
        )
        outcome = pytester.runpytest("test_vendor.py", "-p", "no:cacheprovider", *ONE_TEST)
    output = "\n".join(outcome.outlines + outcome.errlines)
    assert outcome.ret == pytest.ExitCode.OK, output
    outcome.stdout.fnmatch_lines(
        [
            f"leak check: 1 contract test(s) left nothing behind (*); threads allowed by name "
            f"prefix: {ALLOWED}"
        ]
    )


def test_the_built_in_cpu_backend_leaves_nothing_running(run_suite: RunSuite) -> None:
    run = run_suite("cpu://")
    assert run.result.ret == pytest.ExitCode.OK, run.output
    assert_nothing_left_behind(run)


def test_a_failed_put_among_many_leaves_none_of_the_others_running(
    run_suite: RunSuite, pytester: pytest.Pytester
) -> None:
    """The test's other tasks, whose puts hang, are cancelled and awaited before it ends,
    instead of being left pending when the first put fails."""
    trace = pytester.path / "puts.log"
    run = run_suite(
        "refuses-a-put-then-hangs://",
        *("-k", "concurrent_writers", "--kvplug-timeout", "1"),
        *("--kvplug-option", f"trace_file={trace}"),
    )
    lines = trace.read_text().splitlines()
    assert 0 < lines.count("waits") == lines.count("ended"), lines
    assert run.result.ret == pytest.ExitCode.TESTS_FAILED, run.output
    assert "<locals>.main() did not finish within 1 s" in run.output
    assert_nothing_left_behind(run)
