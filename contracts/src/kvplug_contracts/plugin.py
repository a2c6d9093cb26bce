"""The pytest plugin of the conformance suite (registered through the ``pytest11`` entry point).

It adds the ``--kvplug-*`` options, the fixtures the contract classes use, the report header
naming the backend under test, the known-failures file, a summary by clause, and the check
after every contract test that it left nothing running (:mod:`kvplug_contracts.leaks`).

Fixtures a vendor may override in a subclass of a ``*Contract`` class (or in a conftest):

* ``kvplug_url`` / ``kvplug_options``: what to open (default: the command-line options);
* ``small_store_options``: options that make the store small enough to fill, for the
  capacity and pin-pressure tests of clauses 8 and 9 (default: ``--kvplug-small-option
  NAME=VALUE`` when given, else the backend class's ``contract_small_options`` mapping, else
  4 MiB of the one option named as a size limit, else None, and those tests are ``not run``
  with a reason saying how to enable them);
* ``damage_stored``: an async ``damage(backend, key, mode) -> bool`` that damages stored
  data (default: for :class:`~kvplug.backend.RawValues` backends, every
  :class:`~kvplug.backend.BytesBackend` among them, rewrites the stored value; for
  :class:`~kvplug.backend.StoredFiles` backends, such as ``file://``, damages the files that
  hold the key);
* ``server_control``: an object with ``pause()``, ``resume()``, ``stop()`` and ``start()``
  for the server behind the URL (default: None, so deadline and recovery clauses are not run;
  with ``--kvplug-proxy``, the :class:`~kvplug_contracts.faultproxy.FaultProxy` that the
  backend is routed through).

A clause that cannot run against a backend by its nature is waived with a reason: the backend
class's ``contract_waivers`` mapping (clause -> reason), a ``kvplug_waivers`` mapping on the
contract subclass, or ``--kvplug-waive CLAUSE=REASON``; its verdict is ``waived``. ``kvplug
contract`` exits 6 (INCOMPLETE) when a clause is ``not run`` and not waived.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Generator, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis.configuration import set_hypothesis_home_dir

import kvplug
from kvplug import Backend, FreeListAllocator
from kvplug.backend import RawValues, StoredFiles
from kvplug.registry import plugins, registry
from kvplug.runtime.store import Store
from kvplug.secrets import mask_text, mask_url, remember_in
from kvplug.url import BackendURL, split_chain
from kvplug_contracts.faultproxy import FaultProxy, upstream_of
from kvplug_contracts.leaks import (
    ALLOW_INI,
    ALLOW_MARKER,
    ALLOW_OPTION,
    LeakCheck,
    LeakTally,
    allowed_thread_prefixes,
)
from kvplug_contracts.support import (
    CLAUSES,
    DEFAULT_TIMEOUT,
    NOT_APPLICABLE,
    NOT_RUN,
    RUNNING,
    ContractTimeout,
    Keyspace,
    LoopRunner,
    layers,
    violated,
)
from kvplug_contracts.waivers import configured_waivers, size_limit_option
from kvplug_contracts.workers import DESELECTED, LEAKS, AcrossWorkers

URL_ENV = "KVPLUG_CONTRACT_URL"
SUITE_ALLOCATOR_SIZE = 512 << 20
CLOSE_LIMIT = 10.0
OUTCOMES = ("passed", "failed", "n/a", "not run", "known failure", "fixed known failure")
VERDICTS = ("FAIL", "known", "pass", "n/a", "waived", "not run")
SMALL_OPTIONS_ATTRIBUTE = "contract_small_options"
_VIOLATED_CLAUSE = re.compile(r"clause (\d+) \(")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvplug", "kvplug backend conformance suite")
    group.addoption(
        "--kvplug-url",
        default=None,
        help=f"URL of the backend under test (default: ${URL_ENV})",
    )
    group.addoption(
        "--kvplug-option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="backend option, repeatable; wins over the URL's query",
    )
    group.addoption(
        "--kvplug-small-option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="option that makes the store small enough to fill (repeatable), for the capacity "
        f"and pin-pressure tests (clauses 8, 9); wins over the class's {SMALL_OPTIONS_ATTRIBUTE}",
    )
    group.addoption(
        "--kvplug-waive",
        action="append",
        default=[],
        metavar="CLAUSE=REASON",
        help="a clause the suite cannot run against this backend, waived with the reason "
        "(repeatable); joins the backend class's contract_waivers",
    )
    group.addoption(
        "--kvplug-xfails-file",
        default=None,
        metavar="PATH",
        help="known failures: one test-name or node-id pattern per line, '# reason' after it",
    )
    group.addoption(
        "--kvplug-timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        help="seconds one backend operation may take before its test fails, naming the "
        "clause, the operation and the key (default %(default)s)",
    )
    group.addoption(
        "--kvplug-large",
        action="store_true",
        help="also round-trip objects larger than 2 GiB (needs that much memory twice)",
    )
    group.addoption(
        "--kvplug-proxy",
        action="store_true",
        help="route the backend through a fault proxy in front of the URL's host:port, which "
        "the suite pauses and stops to check clause 10 (for servers it cannot control)",
    )
    group.addoption(
        "--kvplug-summary-json",
        default=None,
        metavar="PATH",
        help="write the per-clause summary to this JSON file",
    )
    allowed_threads = (
        "threads whose name starts with PREFIX may outlive a contract test (a client "
        "library's background thread kept by design); every other thread, task, child "
        "process or listening port a test leaves behind fails it"
    )
    group.addoption(
        ALLOW_OPTION,
        action="append",
        default=[],
        metavar="PREFIX",
        help=f"{allowed_threads} (repeatable)",
    )
    parser.addini(ALLOW_INI, allowed_threads + ": one PREFIX a line", type="linelist")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "kvplug_clause(*numbers, central=False): the backend-contract clauses a test checks; "
        "central: the clauses' verdicts rest on it",
    )
    config.addinivalue_line(
        "markers",
        f"{ALLOW_MARKER}(*prefixes): threads whose name starts with one of the prefixes may "
        "outlive the contract tests it marks (a client library's thread kept by design)",
    )
    config.stash[LEAKS] = LeakTally()
    config.pluginmanager.register(ClauseSummary(config), "kvplug-clause-summary")
    # Learn the secrets of the backend under test before any report could show them.
    pairs = (
        pair.partition("=")
        for pair in config.getoption("--kvplug-option") + config.getoption("--kvplug-small-option")
    )
    remember_in({"url": _configured_url(config), **{name: value for name, _, value in pairs}})
    if _configured_url(config):
        _keep_hypothesis_files_in_a_temporary_directory(config)


_HYPOTHESIS_HOME = pytest.StashKey[bool]()


def _keep_hypothesis_files_in_a_temporary_directory(config: pytest.Config) -> None:
    """Hypothesis caches files under ``.hypothesis/`` in the working directory even without
    an example database; a session that runs contract tests (against a URL, or a vendor's
    ``BackendContract`` subclass) leaves nothing in the caller's directory (set
    ``HYPOTHESIS_STORAGE_DIRECTORY`` to choose where instead)."""
    if os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY") or config.stash.get(_HYPOTHESIS_HOME, False):
        return
    config.stash[_HYPOTHESIS_HOME] = True
    directory = tempfile.mkdtemp(prefix="kvplug-contract-hypothesis-")
    set_hypothesis_home_dir(directory)

    def clean_up() -> None:
        set_hypothesis_home_dir(None)
        shutil.rmtree(directory, ignore_errors=True)

    config.add_cleanup(clean_up)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Mask secrets in the report of every contract test (and of every test of a run given a
    backend URL): a failure's traceback shows the values of the fixtures it received (the URL,
    the options), and captured output may hold them too."""
    report = yield
    if item.get_closest_marker("kvplug_clause") is not None or _configured_url(item.config):
        hide_secrets(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    report = yield
    if _configured_url(collector.config):
        hide_secrets(report)
    return report


def hide_secrets(report: pytest.TestReport | pytest.CollectReport) -> None:
    """Mask secrets (:func:`kvplug.secrets.mask_text`) in ``report`` in place: its failure
    representation, captured sections and known-failure reason."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):  # a skip: (path, line, reason)
        report.longrepr = (longrepr[0], longrepr[1], mask_text(longrepr[2]))
    elif isinstance(longrepr, str):
        report.longrepr = mask_text(longrepr)
    elif longrepr is not None:
        _masked(longrepr, set())
        text = report.longreprtext
        if mask_text(text) != text:  # a representation this walk does not know
            report.longrepr = mask_text(text)
    report.sections = [(title, mask_text(content)) for title, content in report.sections]
    if isinstance(report, pytest.TestReport) and isinstance(getattr(report, "wasxfail", None), str):
        report.wasxfail = mask_text(report.wasxfail)


def _masked(value: Any, seen: set[int]) -> Any:
    if isinstance(value, str):
        return mask_text(value)
    if isinstance(value, list):
        value[:] = [_masked(item, seen) for item in value]
    elif isinstance(value, tuple):
        return tuple(_masked(item, seen) for item in value)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        _mask_fields(value, seen)
    return value


def _mask_fields(obj: Any, seen: set[int]) -> None:
    """Mask every string inside pytest's failure representation (dataclasses of strings,
    lists and tuples), keeping its structure so that it prints as usual."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        masked = _masked(value, seen)
        if masked is not value:
            object.__setattr__(obj, field.name, masked)


def _configured_url(config: pytest.Config) -> str | None:
    url: str | None = config.getoption("--kvplug-url") or os.environ.get(URL_ENV) or None
    return url


def _parse_options(pairs: list[str], flag: str = "--kvplug-option") -> dict[str, str]:
    options = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise pytest.UsageError(
                f"a {flag} is not NAME=VALUE (not shown: it may hold a secret); "
                f"write e.g. {flag} max_size=1GiB"
            )
        options[name] = value
    return options


def describe_backend(url: str) -> list[str]:
    """Header lines: each part of the URL chain with its plugin, version and capabilities (for
    a ``store://`` URL, each tier of its config too)."""
    lines = [f"kvplug contract suite {kvplug.__version__}: {mask_url(url)}"]
    try:
        lines += _describe_chain(url, "  ")
    except kvplug.KvplugError as error:
        lines.append(f"  cannot resolve the URL: {error}")
    return lines


def _describe_chain(url: str, indent: str) -> list[str]:
    lines = []
    infos = plugins()
    for part in split_chain(url):
        parsed = BackendURL.parse(part if "://" in part else f"{part}://")
        spec = registry().resolve(parsed.scheme)
        info = next((p for p in infos if spec in p.specs), None)
        dist = f"{info.distribution} {info.version}".rstrip() if info else "runtime"
        line = f"{indent}{parsed.scheme}://: {spec.kind} {spec.name!r} from {dist}"
        if spec.kind == "backend":
            factory = registry().factory(spec)
            line += f"; schemes {', '.join(spec.schemes)}"
            if issubclass(factory, Store):
                lines.append(line + "; capabilities from its tiers:")
                for tier in Store.config_of(parsed).tiers:
                    lines += _describe_chain(tier.url, indent + "  ")
                continue
            capabilities = factory.capabilities.declared()
            line += f"; capabilities {', '.join(capabilities) or 'none'}"
        lines.append(line)
    return lines


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    url = _configured_url(config)
    return describe_backend(url) if url else None


def load_known_failures(path: str | Path) -> dict[str, str]:
    """Known failures from a file: one test-name or node-id pattern (fnmatch) per line, with an
    optional ``# reason`` after it; blank lines and lines starting with ``#`` are ignored."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise pytest.UsageError(f"known-failures file {path}: {error.strerror}") from None
    entries = {}
    for line in text.splitlines():
        pattern, _, reason = line.partition("#")
        pattern = pattern.strip()
        if pattern:
            entries[pattern] = reason.strip() or "declared as a known failure"
    return entries


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark declared known failures: from ``--kvplug-xfails-file`` and from a contract
    subclass's ``kvplug_known_failures`` mapping (pattern -> reason)."""
    path = config.getoption("--kvplug-xfails-file")
    from_file = load_known_failures(path) if path else {}
    for item in items:
        if item.get_closest_marker("kvplug_clause") is None:
            continue
        declared = {**getattr(getattr(item, "cls", None), "kvplug_known_failures", {}), **from_file}
        for pattern, reason in declared.items():
            if fnmatch.fnmatchcase(item.name, pattern) or fnmatch.fnmatchcase(item.nodeid, pattern):
                item.add_marker(pytest.mark.xfail(reason=f"known failure: {reason}", strict=False))
                break


def clause_verdict(row: dict[str, Any]) -> str:
    """The verdict of one clause from its summary row: ``FAIL``, ``known`` (declared known
    failures), ``pass``, ``n/a`` (it does not apply: every central test, or every test, was
    skipped as not applicable), ``waived`` (not run, and waived with a reason: ``waived`` in
    the row) or ``not run`` (the suite could not run, or did not select, a central test: never
    a pass)."""
    verdict = _unwaived_verdict(row)
    return "waived" if verdict == "not run" and row.get("waived") else verdict


def _unwaived_verdict(row: dict[str, Any]) -> str:
    if row["failed"]:
        return "FAIL"
    if row["known failure"]:
        return "known"
    central = row.get("central", {})
    if central.get("total"):
        if central.get("not run"):
            return "not run"
        return "pass" if central.get("passed") else "n/a"
    if row["passed"] or row["fixed known failure"]:
        return "pass"
    return "n/a" if row["n/a"] and not row["not run"] else "not run"


class ClauseSummary(AcrossWorkers):
    """Collects each contract test's outcome under the clauses it is marked with.

    A test's own clauses get the outcome of its call (or of its setup, when that fails or
    skips). A failure in teardown that names a clause, such as the allocator's leak check
    (clause 5) or a close that hangs (clause 11), counts against that clause only: one leak is
    one clause-5 failure, not a failure of the clause whose test happened to leak.
    """

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.clauses_of: dict[str, tuple[int, ...]] = {}
        self.central: set[str] = set()
        self.outcome_of: dict[str, str] = {}
        self.reason_of: dict[str, str] = {}
        self.failed_clause: dict[str, int] = {}
        self.findings: dict[str, set[int]] = {}
        self.deselected: set[str] = set()
        self.waived = configured_waivers(config, _configured_url(config))

    def _learn(self, item: pytest.Item) -> bool:
        marker = item.get_closest_marker("kvplug_clause")
        if marker is None:
            return False
        self.waived.update(getattr(getattr(item, "cls", None), "kvplug_waivers", {}))
        self.clauses_of[item.nodeid] = tuple(int(n) for n in marker.args)
        if marker.kwargs.get("central"):
            self.central.add(item.nodeid)
        return True

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            self._learn(item)

    def pytest_deselected(self, items: Sequence[pytest.Item]) -> None:
        for item in items:
            if self._learn(item):
                self.outcome_of[item.nodeid] = "not run"
                self.reason_of[item.nodeid] = DESELECTED
                self.deselected.add(item.nodeid)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        clauses = self.clauses_of.get(item.nodeid)
        RUNNING.clause = clauses[0] if clauses else None

    def pytest_runtest_logfinish(self, nodeid: str) -> None:
        RUNNING.clause = None

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        nodeid = report.nodeid
        if nodeid not in self.clauses_of:
            marks = getattr(report, "kvplug_clauses", None)
            if marks is None:
                return
            self._learn_marks(nodeid, marks)
        named = _named_clause(report.longreprtext) if report.failed else None
        if report.when == "teardown":
            if report.failed and named:
                self.findings.setdefault(nodeid, set()).add(named)
                return
            if not report.failed or self.outcome_of.get(nodeid) == "failed":
                return
        elif self.outcome_of.get(nodeid) == "failed":
            return
        if hasattr(report, "wasxfail"):
            outcome = "known failure" if report.skipped else "fixed known failure"
        elif report.failed:
            outcome = "failed"
            if named:
                self.failed_clause[nodeid] = named
        elif report.skipped:
            reason = _skip_reason(report)
            outcome = "not run" if reason.startswith(NOT_RUN) else "n/a"
            self.reason_of[nodeid] = reason
        elif report.when == "call":
            outcome = "passed"
        else:
            return
        self.outcome_of[nodeid] = outcome

    def table(self) -> dict[int, dict[str, Any]]:
        """Per clause: how many tests had each outcome, the same for its central tests
        (``central``), and why tests were skipped (``reasons``)."""
        counts: dict[int, dict[str, Any]] = {
            n: {
                **dict.fromkeys(OUTCOMES, 0),
                "central": {"total": 0},
                "reasons": [],
                "waived": self.waived.get(n),
            }
            for n in CLAUSES
        }
        for nodeid, outcome in self.outcome_of.items():
            # A failure counts against the clause its message names, when it names one.
            named = self.failed_clause.get(nodeid) if outcome == "failed" else None
            for number in (named,) if named else self.clauses_of.get(nodeid, ()):
                row = counts[number]
                row[outcome] += 1
                if nodeid in self.central:
                    central = row["central"]
                    central["total"] += 1
                    kind = "passed" if outcome == "fixed known failure" else outcome
                    central[kind] = central.get(kind, 0) + 1
                reason = self.reason_of.get(nodeid)
                if reason and outcome in ("n/a", "not run") and reason not in row["reasons"]:
                    row["reasons"].append(reason)
        for numbers in self.findings.values():
            for number in numbers:
                counts[number]["failed"] += 1
        return counts

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not set(self.outcome_of) - self.deselected or hasattr(self.config, "workerinput"):
            return  # no contract test ran (or all deselected), or a pytest-xdist worker
        table = self.table()
        terminalreporter.section("kvplug contract clauses")
        for number, title in CLAUSES.items():
            row = table[number]
            verdict = clause_verdict(row)
            shown = ", ".join(f"{row[o]} {o}" for o in OUTCOMES if row[o])
            terminalreporter.write_line(f"{number:>3} {verdict:<7} {title}: {shown or 'no test'}")
            if verdict == "waived":
                terminalreporter.write_line(f"{'':>12}waived: {row['waived']}")
            if verdict in ("n/a", "not run", "waived"):
                for reason in row["reasons"] or ["no test of this clause was collected"]:
                    terminalreporter.write_line(f"{'':>12}{reason}")
        leaks = self.config.stash[LEAKS].line()
        if leaks:
            terminalreporter.write_line(leaks)
        path = self.config.getoption("--kvplug-summary-json")
        if path:
            rows = [
                {"clause": n, "title": CLAUSES[n], "verdict": clause_verdict(table[n]), **table[n]}
                for n in CLAUSES
            ]
            Path(path).write_text(json.dumps(rows, indent=2))


def _named_clause(text: str) -> int | None:
    """The clause a failure names (``clause N (...) violated``); with chained exceptions, the
    one raised last."""
    named = [int(n) for n in _VIOLATED_CLAUSE.findall(text) if int(n) in CLAUSES]
    return named[-1] if named else None


def _skip_reason(report: pytest.TestReport) -> str:
    """The reason of a skip, prefixed ``not applicable: `` or ``not run: ``; a skip that the
    suite did not word (a vendor's own ``pytest.skip``) counts as not run."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    reason = reason.removeprefix("Skipped: ")
    if reason.startswith((NOT_APPLICABLE, NOT_RUN)):
        return reason
    return f"{NOT_RUN}{reason}"


# -- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def kvplug_runner(pytestconfig: pytest.Config) -> Iterator[LoopRunner]:
    """The suite's own event loop: vendors need no asyncio plugin."""
    runner = LoopRunner(pytestconfig.getoption("--kvplug-timeout"))
    yield runner
    runner.close()


def _is_contract_test(item: pytest.Item) -> bool:
    """A test of the suite's ``*Contract`` classes (also in a vendor's subclass, with the
    vendor's own tests there), or one marked with :func:`~kvplug_contracts.support.clause`."""
    if item.get_closest_marker("kvplug_clause") is not None:
        return True
    cls = getattr(item, "cls", None)
    return cls is not None and any(
        base.__module__.startswith("kvplug_contracts.suite") for base in cls.__mro__
    )


@pytest.fixture(autouse=True)
def kvplug_leak_check(request: pytest.FixtureRequest) -> Iterator[None]:
    """After every contract test, and the close of every backend it opened: fail it (clause
    11) when it left an asyncio task, a thread, a child process or a listening port behind
    (see :mod:`kvplug_contracts.leaks` for what is allowed). Set up as the first
    function-scoped fixture, so it is torn down last."""
    item = request.node
    if not isinstance(item, pytest.Item) or not _is_contract_test(item):
        yield
        return
    tally = request.config.stash[LEAKS]
    allowed = allowed_thread_prefixes(item)
    tally.allowed.update(allowed)
    check = LeakCheck(request.getfixturevalue("kvplug_runner"), allowed)
    yield
    tally.checked += 1
    try:
        check.check()
    except BaseException:
        tally.leaking.append(item.nodeid)
        raise


NO_URL = (
    f"no backend to test: pass --kvplug-url URL (or set {URL_ENV}), for example "
    "pytest --pyargs kvplug_contracts --kvplug-url cpu://"
)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Bad suite options are one usage error, not an error in every test."""
    config = session.config
    _parse_options(config.getoption("--kvplug-option"))
    _parse_options(config.getoption("--kvplug-small-option"), "--kvplug-small-option")
    _proxied_upstream(config)
    if any(item.get_closest_marker("kvplug_clause") is not None for item in session.items):
        _keep_hypothesis_files_in_a_temporary_directory(config)
    if _configured_url(config):
        return
    for item in session.items:
        definitions = getattr(item, "_fixtureinfo", None)
        chain = definitions.name2fixturedefs.get("kvplug_url", ()) if definitions else ()
        if chain and chain[-1].func.__module__ == __name__:
            raise pytest.UsageError(NO_URL)


def _proxied_upstream(config: pytest.Config) -> tuple[str, int] | None:
    """The ``(host, port)`` that ``--kvplug-proxy`` puts a fault proxy in front of, or None
    without that flag; a usage error when the URL has no single host:port."""
    if not config.getoption("--kvplug-proxy"):
        return None
    url = _configured_url(config)
    if not url:
        raise pytest.UsageError(
            f"--kvplug-proxy needs --kvplug-url (or ${URL_ENV}): the fault proxy goes in front "
            "of that URL's host:port. With a kvplug_url fixture of your own, put a "
            "kvplug_contracts.faultproxy.FaultProxy in front of it yourself (see the "
            "kvplug-contracts README, 'Clause 10 without process control')"
        )
    try:
        return upstream_of(url)
    except (ValueError, kvplug.KvplugError) as error:
        raise pytest.UsageError(f"--kvplug-proxy: {error}") from None


@pytest.fixture(scope="session")
def kvplug_fault_proxy(pytestconfig: pytest.Config) -> Iterator[FaultProxy | None]:
    """With ``--kvplug-proxy``: the fault proxy in front of the URL's host:port, which
    ``kvplug_url`` routes the backend through and ``server_control`` returns; else None."""
    upstream = _proxied_upstream(pytestconfig)
    if upstream is None:
        yield None
        return
    with FaultProxy(upstream) as proxy:
        yield proxy


@pytest.fixture(scope="session")
def kvplug_url(pytestconfig: pytest.Config, kvplug_fault_proxy: FaultProxy | None) -> str:
    """The URL of the backend under test (with ``--kvplug-proxy``, pointing at the proxy)."""
    url = _configured_url(pytestconfig)
    if not url:
        raise pytest.UsageError(NO_URL)
    return kvplug_fault_proxy.url_for(url) if kvplug_fault_proxy is not None else url


@pytest.fixture(scope="session")
def kvplug_options(pytestconfig: pytest.Config) -> dict[str, Any]:
    """Options for the backend under test, from ``--kvplug-option NAME=VALUE``."""
    return _parse_options(pytestconfig.getoption("--kvplug-option"))


@pytest.fixture
def run(kvplug_runner: LoopRunner) -> Callable[..., Any]:
    """``run(coroutine, timeout=None)``: await on the suite's loop and return the result."""
    return kvplug_runner.run


@pytest.fixture
def allocator(kvplug_runner: LoopRunner) -> Iterator[FreeListAllocator]:
    """Where objects of the test and objects returned by ``get`` live. When the test ends and
    every backend it opened is closed, nothing may remain allocated (clause 5); unless the
    test's backend blocked the event loop, whose abandoned operations still hold objects (that
    failure is reported already)."""
    abandoned = kvplug_runner.abandoned_loops
    suite_allocator = FreeListAllocator(SUITE_ALLOCATOR_SIZE, pin=False)
    yield suite_allocator
    stats = suite_allocator.stats()
    if stats.used and kvplug_runner.abandoned_loops == abandoned and not kvplug_runner.gave_up:
        violated(
            5,
            f"after the test and the backend's close, {stats.object_count} object(s) "
            f"({stats.used} bytes) are still allocated: a reference was never released",
        )


@pytest.fixture
def keyspace(request: pytest.FixtureRequest) -> Keyspace:
    """Keys in a namespace of this test's own."""
    return Keyspace(request.node.nodeid)


@pytest.fixture
def open_contract_backend(
    kvplug_url: str,
    kvplug_options: dict[str, Any],
    allocator: FreeListAllocator,
    kvplug_runner: LoopRunner,
) -> Iterator[Callable[..., Backend]]:
    """``open(url=None, **options)``: open a backend through ``kvplug.open_backend`` (so the
    scheme's entry point is exercised), closed again when the test ends."""
    opened: list[Backend] = []

    def open_backend(url: str | None = None, **options: Any) -> Backend:
        backend = kvplug_runner.run(
            kvplug.open_backend(
                url or kvplug_url, allocator=allocator, **{**kvplug_options, **options}
            )
        )
        opened.append(backend)
        return backend

    yield open_backend
    for backend in opened:
        if type(backend) in kvplug_runner.blocking_closers:
            continue  # its close blocked the loop once (a clause-11 failure): not waited again
        try:
            kvplug_runner.run(backend.close(), timeout=CLOSE_LIMIT)
        except ContractTimeout:
            violated(11, f"close() of {backend!r} did not finish within {CLOSE_LIMIT} s")


@pytest.fixture
def backend(open_contract_backend: Callable[..., Backend]) -> Backend:
    """The backend under test, opened for this test."""
    return open_contract_backend()


@pytest.fixture
def small_store_options(pytestconfig: pytest.Config, backend: Backend) -> dict[str, Any] | None:
    """Options that make the store small enough to fill in a test (a few MiB), or None, and
    the capacity and pin-pressure tests (clauses 8, 9) are ``not run``.

    In order: ``--kvplug-small-option NAME=VALUE`` (repeatable); else the
    ``contract_small_options`` class attribute of the backend (or of a backend it wraps)::

        class AcmeBackend(BytesBackend):
            contract_small_options: ClassVar[dict[str, Any]] = {"max_size": "4MiB"}

    else, when the backend's ``Options`` has one size limit named as such (``max_size``,
    ``capacity``, ``max_bytes``, ``max_memory``, ``size_limit``, ...), 4 MiB of it; else None.
    A vendor may also override this fixture."""
    given = _parse_options(pytestconfig.getoption("--kvplug-small-option"), "--kvplug-small-option")
    if given:
        return dict(given)
    for layer in layers(backend):
        declared = getattr(type(layer), SMALL_OPTIONS_ATTRIBUTE, None)
        if declared is not None:
            return dict(declared)
    for layer in layers(backend):
        found = size_limit_option(type(layer))
        if found is not None:
            return found
    return None


@pytest.fixture
def damage_stored() -> Callable[..., Any] | None:
    """An async ``damage(backend, key, mode)`` that damages what is stored under ``key``
    (``mode`` is ``"flip"``, ``"truncate"`` or ``"garbage"``) and returns whether it could; the
    default handles every backend, also behind wrappers, that is a
    :class:`~kvplug.backend.RawValues` (every :class:`~kvplug.backend.BytesBackend`: the stored
    value is rewritten) or a :class:`~kvplug.backend.StoredFiles` (the local files holding
    ``key``, such as ``file://``, are rewritten)."""

    async def damage(backend: Backend, key: kvplug.CacheKey, mode: str) -> bool:
        for layer in layers(backend):
            if isinstance(layer, StoredFiles):
                paths = [Path(path) for path in layer.stored_files(key)]
                for path in paths:
                    path.write_bytes(_damaged(path.read_bytes(), mode))
                return bool(paths)
            if isinstance(layer, RawValues):
                data = await layer.read_raw(key)
                if data is None:
                    return False
                await layer.write_raw(key, _damaged(data, mode))
                return True
        return False

    return damage


def _damaged(data: bytes, mode: str) -> bytes:
    """``data`` with a bit flipped in the middle, cut in half, or replaced by garbage."""
    damaged = bytearray(data)
    if mode == "flip":
        damaged[len(damaged) // 2] ^= 0x10
    elif mode == "truncate":
        del damaged[len(damaged) // 2 :]
    else:
        damaged = bytearray(b"\x00garbage\xff" * 7)
    return bytes(damaged)


@pytest.fixture
def server_control(kvplug_fault_proxy: FaultProxy | None) -> Iterator[Any]:
    """Control over the server behind the URL (``pause``, ``resume``, ``stop``, ``start``), or
    None when the fixture cannot reach it; override it, or pass ``--kvplug-proxy``, to run
    clause 10. The ``--kvplug-proxy`` fault proxy is healed after each test."""
    yield kvplug_fault_proxy
    if kvplug_fault_proxy is not None:
        kvplug_fault_proxy.heal()
