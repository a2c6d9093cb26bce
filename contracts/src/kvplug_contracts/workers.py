"""The contract suite's clause summary under pytest-xdist (``-n``): the controller, which prints
the summary, collects nothing, so a test's clauses travel with its reports, and what a worker
deselected and its leak tally with the output it sends when it finishes (internal)."""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any

import pytest

from kvplug_contracts.leaks import LeakTally

DESELECTED = "deselected (by -k, -m or another selection): the suite did not run it this time"
WORKER_OUTPUT = "kvplug_contract_summary"
LEAKS = pytest.StashKey[LeakTally]()
"""The session's :class:`LeakTally`."""


class AcrossWorkers:
    """The hooks of :class:`~kvplug_contracts.plugin.ClauseSummary` that carry its state from
    pytest-xdist workers to the controller; harmless in a run without workers."""

    config: pytest.Config
    clauses_of: dict[str, tuple[int, ...]]
    central: set[str]
    outcome_of: dict[str, str]
    reason_of: dict[str, str]
    deselected: set[str]
    waived: dict[int, str]

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        report = yield
        if item.nodeid in self.clauses_of:
            report.kvplug_clauses = self._marks(item.nodeid)  # type: ignore[attr-defined]
        return report

    def _marks(self, nodeid: str) -> tuple[list[int], bool]:
        return list(self.clauses_of[nodeid]), nodeid in self.central

    def _learn_marks(self, nodeid: str, marks: Sequence[Any]) -> None:
        clauses, central = marks
        self.clauses_of[nodeid] = tuple(clauses)
        if central:
            self.central.add(nodeid)

    def pytest_sessionfinish(self) -> None:
        output = getattr(self.config, "workeroutput", None)
        if output is None:
            return  # not a pytest-xdist worker
        tally = self.config.stash[LEAKS]
        output[WORKER_OUTPUT] = {
            "deselected": {nodeid: self._marks(nodeid) for nodeid in self.deselected},
            "leaks": [tally.checked, tally.leaking, sorted(tally.allowed)],
            "waived": {str(number): reason for number, reason in self.waived.items()},
        }

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any) -> None:
        """pytest-xdist's controller: a worker finished."""
        output = getattr(node, "workeroutput", {}).get(WORKER_OUTPUT)
        if output is None:
            return  # it crashed (its test fails) or ran no contract plugin
        for nodeid, marks in output["deselected"].items():
            self._learn_marks(nodeid, marks)  # every worker deselects the same tests
            self.outcome_of[nodeid] = "not run"
            self.reason_of[nodeid] = DESELECTED
            self.deselected.add(nodeid)
        self.waived.update({int(n): reason for n, reason in output.get("waived", {}).items()})
        checked, leaking, allowed = output["leaks"]
        tally = self.config.stash[LEAKS]
        tally.checked += checked
        tally.leaking += leaking
        tally.allowed.update(allowed)


__all__ = ["DESELECTED", "LEAKS", "WORKER_OUTPUT", "AcrossWorkers"]
