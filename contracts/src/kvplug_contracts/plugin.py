"""The pytest plugin of the conformance suite (registered through the ``pytest11`` entry point).

It adds the ``--kvplug-*`` options, the fixtures the contract classes use, the report header
naming the backend under test, the known-failures file, and a summary by clause.

Fixtures a vendor may override in a subclass of a ``*Contract`` class (or in a conftest):

* ``kvplug_url`` / ``kvplug_options``: what to open (default: the command-line options);
* ``small_store_options``: options that make the store small enough to fill (default:
  ``max_size=4MiB`` when the backend has a ``max_size`` option, else the clause is n/a);
* ``damage_stored``: an async ``damage(backend, key, mode) -> bool`` that damages stored
  data (default: for :class:`~kvplug.backend.BytesBackend` s, rewrites the stored value; for
  backends with a ``stored_files(key)`` method listing the local files that hold a key, such
  as ``file://``, damages those files);
* ``server_control``: an object with ``pause()``, ``resume()``, ``stop()`` and ``start()``
  for the server behind the URL (default: None, so deadline and recovery clauses are n/a).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import re
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

import kvplug
from kvplug import Backend, BytesBackend, FreeListAllocator
from kvplug.registry import plugins, registry
from kvplug.secrets import mask_text, mask_url, remember_in
from kvplug.store import Store
from kvplug.url import BackendURL, split_chain
from kvplug_contracts.support import (
    CLAUSES,
    DEFAULT_TIMEOUT,
    ContractTimeout,
    Keyspace,
    LoopRunner,
    innermost,
    layers,
    violated,
)

URL_ENV = "KVPLUG_CONTRACT_URL"
SUITE_ALLOCATOR_SIZE = 512 << 20
CLOSE_LIMIT = 10.0
OUTCOMES = ("passed", "failed", "n/a", "known failure", "fixed known failure")
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
        "--kvplug-xfails-file",
        default=None,
        metavar="PATH",
        help="known failures: one test-name or node-id pattern per line, '# reason' after it",
    )
    group.addoption(
        "--kvplug-timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        help="seconds one backend operation may take before the test fails (default %(default)s)",
    )
    group.addoption(
        "--kvplug-large",
        action="store_true",
        help="also round-trip objects larger than 2 GiB (needs that much memory twice)",
    )
    group.addoption(
        "--kvplug-summary-json",
        default=None,
        metavar="PATH",
        help="write the per-clause summary to this JSON file",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "kvplug_clause(*numbers): the backend-contract clauses a test checks"
    )
    config.pluginmanager.register(ClauseSummary(config), "kvplug-clause-summary")
    # Learn the secrets of the backend under test before any report could show them.
    pairs = (pair.partition("=") for pair in config.getoption("--kvplug-option"))
    remember_in({"url": _configured_url(config), **{name: value for name, _, value in pairs}})


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


def _parse_options(pairs: list[str]) -> dict[str, str]:
    options = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise pytest.UsageError(
                "a --kvplug-option is not NAME=VALUE (not shown: it may hold a secret); "
                "write e.g. --kvplug-option max_size=1GiB"
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


def clause_verdict(row: dict[str, int]) -> str:
    """``FAIL``, ``known`` (declared known failures), ``pass`` or ``n/a`` for one clause."""
    if row["failed"]:
        return "FAIL"
    if row["known failure"]:
        return "known"
    return "pass" if row["passed"] or row["fixed known failure"] else "n/a"


class ClauseSummary:
    """Collects each contract test's outcome under the clauses it is marked with."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.clauses_of: dict[str, tuple[int, ...]] = {}
        self.outcome_of: dict[str, str] = {}
        self.failed_clause: dict[str, int] = {}

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            marker = item.get_closest_marker("kvplug_clause")
            if marker is not None:
                self.clauses_of[item.nodeid] = tuple(int(n) for n in marker.args)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.nodeid not in self.clauses_of:
            return
        previous = self.outcome_of.get(report.nodeid)
        if previous == "failed":
            return
        if hasattr(report, "wasxfail"):
            outcome = "known failure" if report.skipped else "fixed known failure"
        elif report.failed:
            outcome = "failed"
            named = _VIOLATED_CLAUSE.search(report.longreprtext)
            if named and int(named.group(1)) in self.clauses_of[report.nodeid]:
                self.failed_clause[report.nodeid] = int(named.group(1))
        elif report.skipped:
            outcome = "n/a"
        elif report.when == "call":
            outcome = "passed"
        else:
            return
        self.outcome_of[report.nodeid] = outcome

    def table(self) -> dict[int, dict[str, int]]:
        counts = {n: dict.fromkeys(OUTCOMES, 0) for n in CLAUSES}
        for nodeid, outcome in self.outcome_of.items():
            # A failure counts against the clause its message names, when it names one.
            named = self.failed_clause.get(nodeid) if outcome == "failed" else None
            for number in (named,) if named else self.clauses_of.get(nodeid, ()):
                counts[number][outcome] += 1
        return counts

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.outcome_of:
            return
        table = self.table()
        terminalreporter.section("kvplug contract clauses")
        for number, title in CLAUSES.items():
            row = table[number]
            shown = ", ".join(f"{row[o]} {o}" for o in OUTCOMES if row[o])
            terminalreporter.write_line(
                f"{number:>3} {clause_verdict(row):<5} {title}: {shown or 'no test'}"
            )
        path = self.config.getoption("--kvplug-summary-json")
        if path:
            rows = [{"clause": n, "title": CLAUSES[n], **table[n]} for n in CLAUSES]
            Path(path).write_text(json.dumps(rows, indent=2))


# -- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def kvplug_runner(pytestconfig: pytest.Config) -> Iterator[LoopRunner]:
    """The suite's own event loop: vendors need no asyncio plugin."""
    runner = LoopRunner(pytestconfig.getoption("--kvplug-timeout"))
    yield runner
    runner.close()


NO_URL = (
    f"no backend to test: pass --kvplug-url URL (or set {URL_ENV}), for example "
    "pytest --pyargs kvplug_contracts --kvplug-url cpu://"
)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Bad suite options are one usage error, not an error in every test."""
    config = session.config
    _parse_options(config.getoption("--kvplug-option"))
    if _configured_url(config):
        return
    for item in session.items:
        definitions = getattr(item, "_fixtureinfo", None)
        chain = definitions.name2fixturedefs.get("kvplug_url", ()) if definitions else ()
        if chain and chain[-1].func.__module__ == __name__:
            raise pytest.UsageError(NO_URL)


@pytest.fixture(scope="session")
def kvplug_url(pytestconfig: pytest.Config) -> str:
    """The URL of the backend under test."""
    url = _configured_url(pytestconfig)
    if not url:
        raise pytest.UsageError(NO_URL)
    return url


@pytest.fixture(scope="session")
def kvplug_options(pytestconfig: pytest.Config) -> dict[str, Any]:
    """Options for the backend under test, from ``--kvplug-option NAME=VALUE``."""
    return _parse_options(pytestconfig.getoption("--kvplug-option"))


@pytest.fixture
def run(kvplug_runner: LoopRunner) -> Callable[..., Any]:
    """``run(coroutine, timeout=None)``: await on the suite's loop and return the result."""
    return kvplug_runner.run


@pytest.fixture
def allocator() -> Iterator[FreeListAllocator]:
    """Where objects of the test and objects returned by ``get`` live. When the test ends and
    every backend it opened is closed, nothing may remain allocated (clause 5)."""
    suite_allocator = FreeListAllocator(SUITE_ALLOCATOR_SIZE, pin=False)
    yield suite_allocator
    stats = suite_allocator.stats()
    if stats.used:
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
        try:
            kvplug_runner.run(backend.close(), timeout=CLOSE_LIMIT)
        except ContractTimeout:
            violated(11, f"close() of {backend!r} did not finish within {CLOSE_LIMIT} s")


@pytest.fixture
def backend(open_contract_backend: Callable[..., Backend]) -> Backend:
    """The backend under test, opened for this test."""
    return open_contract_backend()


@pytest.fixture
def small_store_options(backend: Backend) -> dict[str, Any] | None:
    """Options that make the store small enough to fill in a test, or None (clause 9 n/a)."""
    if "max_size" in type(innermost(backend)).Options.model_fields:
        return {"max_size": "4MiB"}
    return None


@pytest.fixture
def damage_stored() -> Callable[..., Any] | None:
    """An async ``damage(backend, key, mode)`` that damages what is stored under ``key``
    (``mode`` is ``"flip"``, ``"truncate"`` or ``"garbage"``) and returns whether it could; the
    default handles every :class:`~kvplug.backend.BytesBackend` and every backend with a
    ``stored_files(key)`` method (the local files holding ``key``), also behind wrappers."""

    async def damage(backend: Backend, key: kvplug.CacheKey, mode: str) -> bool:
        backend = next(
            (
                layer
                for layer in layers(backend)
                if isinstance(layer, BytesBackend) or callable(getattr(layer, "stored_files", None))
            ),
            backend,
        )
        stored_files = getattr(backend, "stored_files", None)
        if not isinstance(backend, BytesBackend) and callable(stored_files):
            paths = [Path(path) for path in stored_files(key)]
            for path in paths:
                path.write_bytes(_damaged(path.read_bytes(), mode))
            return bool(paths)
        if not isinstance(backend, BytesBackend):
            return False
        store_key = backend.key_string(key)
        data = await backend.get_bytes(store_key)
        if data is None:
            return False
        await backend.put_bytes(store_key, [_damaged(bytes(data), mode)])
        return True

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
def server_control() -> Any:
    """Control over the server behind the URL (``pause``, ``resume``, ``stop``, ``start``), or
    None when the fixture cannot reach it; override it to run clause 10."""
    return None
