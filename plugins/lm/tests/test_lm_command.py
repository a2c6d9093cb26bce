"""``kvplug lm-server``'s command line is generated from ServerOptions: one default each."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from kvplug.units import parse_size
from kvplug_lm.command import build_command
from kvplug_lm.server_options import ServerOptions, command_line_fields


def test_every_option_has_its_fields_default_and_help() -> None:
    command = build_command()
    options = {p.name: p for p in command.params if isinstance(p, click.Option)}
    fields = command_line_fields()
    assert {f.name for f in fields} | {"secret_file", "log_level"} == set(options)
    for field in fields:
        option = options[field.name]
        default = option.default
        if field.metadata["size"]:
            default = parse_size(str(default))
        assert default == field.default, field.name
        assert option.help == field.metadata["help"]
        assert option.envvar == "KVPLUG_LM_" + field.name.upper()
    assert "secret" not in options  # a secret is read from a file or the environment only


def test_options_not_given_take_the_fields_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[ServerOptions] = []

    class Refuses(Exception):
        pass

    def capture(options: ServerOptions) -> None:
        seen.append(options)
        raise Refuses

    monkeypatch.setattr("kvplug_lm.server.LMServer", capture)
    result = CliRunner().invoke(build_command(), ["--max-memory", "64MiB", "--plain", "deny"])
    assert isinstance(result.exception, Refuses), result.output
    (options,) = seen
    expected = dataclasses.replace(ServerOptions(), max_memory=64 << 20, plain="deny")
    assert options == expected


def test_a_bad_size_names_the_option() -> None:
    result = CliRunner().invoke(build_command(), ["--min-rate", "fast"])
    assert result.exit_code == 2 and "--min-rate" in result.output


def test_the_docs_table_lists_every_option_and_no_other() -> None:
    docs = Path(__file__).resolve().parents[3] / "docs" / "lm.md"
    table = docs.read_text().split("## The server: `kvplug lm-server`", 1)[1].split("\n\n")[1]
    documented = set(re.findall(r"^\| `(--[a-z-]+)", table, flags=re.MULTILINE))
    command = build_command()
    flags = {opt for p in command.params if isinstance(p, click.Option) for opt in p.opts}
    assert documented == flags - {"--help"}
