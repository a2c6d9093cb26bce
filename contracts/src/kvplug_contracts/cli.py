"""``kvplug contract URL`` (or ``--config FILE``): the whole suite against one backend, or
against the tiered Store a config file describes, summarised by clause.

Registered as a ``kvplug.commands`` entry point, so ``kvplug`` gains the command when
kvplug-contracts is installed. pytest is imported only when the command runs.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import click

# The suite's constants, without importing pytest (see the module docstring).
DEFAULT_TIMEOUT = 10.0
VERDICTS = ("FAIL", "known", "pass", "n/a", "waived", "not run")
INCOMPLETE = 6
"""The exit status of a run that failed nothing but left a clause not run for want of a
declaration (a way to fill the store, to pause its server, to damage its data), unwaived: not a
pass. pytest's own statuses are 0 to 5."""


@click.command("contract")
@click.argument("url", required=False)
@click.option(
    "--config",
    "config_file",
    type=click.Path(exists=True, dir_okay=False),
    help="Check the tiered Store of this config file (the same as URL store:///ABS/PATH).",
)
@click.option(
    "-o",
    "--option",
    "option_pairs",
    multiple=True,
    metavar="NAME=VALUE",
    help="Backend option (repeatable); wins over the URL's query.",
)
@click.option(
    "--small-option",
    "small_option_pairs",
    multiple=True,
    metavar="NAME=VALUE",
    help="Option that makes the store small enough to fill (repeatable), for the capacity "
    "and pin-pressure tests (clauses 8, 9); without it the backend class's "
    "contract_small_options are used, or those tests are not run.",
)
@click.option(
    "--waive",
    "waivers",
    multiple=True,
    metavar="CLAUSE=REASON",
    help="Waive a clause the suite cannot run against this backend, with the reason "
    "(repeatable); joins the backend class's contract_waivers. A clause left not run and not "
    f"waived makes the run INCOMPLETE (exit status {INCOMPLETE}).",
)
@click.option(
    "--xfails-file",
    type=click.Path(exists=True, dir_okay=False),
    help="Known failures: one test-name pattern per line, '# reason' after it.",
)
@click.option(
    "--timeout",
    type=float,
    default=DEFAULT_TIMEOUT,
    show_default=True,
    help="Seconds one backend operation may take before its test fails, naming the clause, "
    "the operation and the key.",
)
@click.option(
    "--proxy",
    is_flag=True,
    help="Put the suite's fault proxy in front of the URL's host:port, so that clause 10 "
    "(deadlines and recovery) runs for a server this command cannot stop.",
)
@click.option("--large", is_flag=True, help="Also round-trip objects larger than 2 GiB.")
@click.option(
    "--allow-thread",
    "allowed_threads",
    multiple=True,
    metavar="PREFIX",
    help="A thread whose name starts with PREFIX may outlive a test: a client library's "
    "background thread kept by design (repeatable). Any other thread, asyncio task, child "
    "process or listening port a test leaves behind fails it.",
)
@click.option("-k", "keyword", help="Only tests matching this pytest -k expression.")
@click.option("-v", "--verbose", is_flag=True, help="List every test, not only failures.")
def contract_command(
    url: str | None,
    config_file: str | None,
    option_pairs: tuple[str, ...],
    small_option_pairs: tuple[str, ...],
    waivers: tuple[str, ...],
    xfails_file: str | None,
    timeout: float,
    proxy: bool,
    large: bool,
    allowed_threads: tuple[str, ...],
    keyword: str | None,
    verbose: bool,
) -> None:
    """Run the backend conformance suite against URL (or the Store of --config FILE) and
    summarise it by clause."""
    import pytest

    if (url is None) == (config_file is None):
        raise click.UsageError("give a backend URL or --config FILE (one of them).")
    if config_file is not None:
        from kvplug.runtime.store import store_url

        url = store_url(config_file)
    assert url is not None

    from kvplug.secrets import mask_url
    from kvplug_contracts.plugin import describe_backend

    with tempfile.TemporaryDirectory(prefix="kvplug-contract-") as workdir:
        summary = Path(workdir) / "summary.json"
        ini = Path(workdir) / "pytest.ini"
        ini.write_text("[pytest]\n")  # the caller's own pytest settings must not change the run
        args = [
            "--pyargs",
            "kvplug_contracts",
            "-c",
            str(ini),
            "--rootdir",
            workdir,
            "-p",
            "no:cacheprovider",
            "-v" if verbose else "-q",
            "-rfEX",
            # This module already imported the package, which pytest would like to rewrite;
            # the suite reports through its own messages, so that rewrite is not needed.
            "-W",
            "ignore::pytest.PytestAssertRewriteWarning",
            "--kvplug-url",
            url,
            "--kvplug-timeout",
            str(timeout),
            "--kvplug-summary-json",
            str(summary),
        ]
        for pair in option_pairs:
            args += ["--kvplug-option", pair]
        for pair in small_option_pairs:
            args += ["--kvplug-small-option", pair]
        for pair in waivers:
            args += ["--kvplug-waive", pair]
        if xfails_file:
            args += ["--kvplug-xfails-file", str(Path(xfails_file).resolve())]
        if proxy:
            args.append("--kvplug-proxy")
        if large:
            args.append("--kvplug-large")
        for prefix in allowed_threads:
            args += ["--kvplug-allow-thread", prefix]
        if keyword:
            args += ["-k", keyword]
        for line in describe_backend(url):
            click.echo(line)
        code = int(pytest.main(args))
        rows = json.loads(summary.read_text()) if summary.exists() else []

    line, status = verdict_of(rows, code)
    click.echo(f"kvplug contract {mask_url(url)}: {line}")
    sys.exit(status)


def verdict_of(rows: list[dict[str, Any]], code: int) -> tuple[str, int]:
    """The one-line verdict from the suite's per-clause summary rows and pytest's exit code,
    for example ``INCOMPLETE: clauses 8, 9 not run; of 16 clauses 12 kept, ...``, and the exit
    status: pytest's, or :data:`INCOMPLETE` when a clause was left not run, unwaived, for
    another reason than ``-k`` deselecting its tests."""
    from kvplug_contracts.plugin import clause_verdict
    from kvplug_contracts.workers import DESELECTED

    verdicts = {row["clause"]: clause_verdict(row) for row in rows}
    numbers = {v: [str(n) for n, got in verdicts.items() if got == v] for v in VERDICTS}
    failed, not_run = numbers["FAIL"], numbers["not run"]
    wanting = [
        str(row["clause"])
        for row in rows
        if verdicts[row["clause"]] == "not run"
        and any(reason != DESELECTED for reason in row["reasons"] or [""])
    ]
    status = code
    if failed or code:
        verdict = f"FAIL ({_clauses(failed)})" if failed else f"FAIL (pytest exit code {code})"
    elif wanting:
        verdict = f"INCOMPLETE: {_clauses(wanting)} not run, not waived"
        status = INCOMPLETE
    else:
        verdict = "PASS"
    if not_run and not wanting:
        verdict += f" with {_clauses(not_run)} not run"
    if numbers["waived"]:
        verdict += f" ({_clauses(numbers['waived'])} waived)"
    line = (
        f"{verdict}; of {len(rows)} clauses {len(numbers['pass'])} kept, "
        f"{len(numbers['known'])} with declared known failures, "
        f"{len(numbers['n/a'])} not applicable to this backend's declared capabilities, "
        f"{len(numbers['waived'])} waived, "
        f"{len(not_run)} not run (the reasons are listed above)"
    )
    return line, status


def _clauses(numbers: list[str]) -> str:
    return f"clause{'s' if len(numbers) > 1 else ''} {', '.join(numbers)}"
