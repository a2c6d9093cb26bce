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

import click


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
    "--xfails-file",
    type=click.Path(exists=True, dir_okay=False),
    help="Known failures: one test-name pattern per line, '# reason' after it.",
)
@click.option(
    "--timeout",
    type=float,
    default=30.0,
    show_default=True,
    help="Seconds one operation may take before its test fails.",
)
@click.option("--large", is_flag=True, help="Also round-trip objects larger than 2 GiB.")
@click.option("-k", "keyword", help="Only tests matching this pytest -k expression.")
@click.option("-v", "--verbose", is_flag=True, help="List every test, not only failures.")
def contract_command(
    url: str | None,
    config_file: str | None,
    option_pairs: tuple[str, ...],
    xfails_file: str | None,
    timeout: float,
    large: bool,
    keyword: str | None,
    verbose: bool,
) -> None:
    """Run the backend conformance suite against URL (or the Store of --config FILE) and
    summarise it by clause."""
    import pytest

    if (url is None) == (config_file is None):
        raise click.UsageError("give a backend URL or --config FILE (one of them).")
    if config_file is not None:
        url = f"store://{Path(config_file).resolve()}"
    assert url is not None

    from kvplug.secrets import mask_url
    from kvplug_contracts.plugin import clause_verdict, describe_backend

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
        if xfails_file:
            args += ["--kvplug-xfails-file", str(Path(xfails_file).resolve())]
        if large:
            args.append("--kvplug-large")
        if keyword:
            args += ["-k", keyword]
        for line in describe_backend(url):
            click.echo(line)
        code = int(pytest.main(args))
        rows = json.loads(summary.read_text()) if summary.exists() else []

    verdicts = {row["clause"]: clause_verdict(row) for row in rows}
    failed = [str(n) for n, verdict in verdicts.items() if verdict == "FAIL"]
    counts = {v: list(verdicts.values()).count(v) for v in ("pass", "known", "n/a")}
    verdict = f"FAIL (clauses {', '.join(failed)})" if failed or code else "PASS"
    click.echo(
        f"kvplug contract {mask_url(url)}: {verdict}; of {len(rows)} clauses "
        f"{counts['pass']} kept, {counts['known']} with declared known failures, "
        f"{counts['n/a']} not applicable to this backend's capabilities or fixtures"
    )
    sys.exit(code)
