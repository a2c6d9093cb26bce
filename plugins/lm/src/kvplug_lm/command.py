"""``kvplug lm-server``: the command line, one option per field of
:class:`~kvplug_lm.server_options.ServerOptions` (its default and help stated there), plus
``--secret-file`` and ``--log-level``. Every option also reads ``KVPLUG_LM_<NAME>``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import click

from kvplug.errors import KvplugError
from kvplug.units import format_size, parse_size
from kvplug_lm.server_options import ServerOptions, command_line_fields

ENV_PREFIX = "KVPLUG_LM_"


def _env(name: str) -> str:
    return ENV_PREFIX + name.upper()


def _size(flag: str) -> Callable[[click.Context, click.Parameter, Any], int | None]:
    def parse(_ctx: click.Context, _param: click.Parameter, value: Any) -> int | None:
        if value is None:
            return None
        try:
            return parse_size(value, what=flag)
        except ValueError as error:
            raise click.BadParameter(str(error)) from None

    return parse


def _click_type(annotation: Any) -> Any:
    """The click type of a field annotated ``annotation`` (``X | None`` as ``X``)."""
    choices = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    if typing.get_origin(annotation) is Literal:
        return click.Choice(list(choices))
    if choices and len(choices) == 1:
        return _click_type(choices[0])
    return annotation if annotation in (int, float) else str


def _option_of(option: dataclasses.Field[Any], annotation: Any) -> Callable[[Any], Any]:
    """The click option of one field, its default the field's (a size shown as one)."""
    flag = "--" + option.name.replace("_", "-")
    default: Any = option.default
    extra: dict[str, Any] = {}
    if option.metadata.get("size"):
        extra["callback"] = _size(flag)
        default = format_size(default) if default % 1024 == 0 else str(default)
    else:
        extra["type"] = _click_type(annotation)
    return click.option(
        flag,
        option.name,
        default=default,
        show_default=default is not None,
        envvar=_env(option.name),
        help=option.metadata["help"],
        **extra,
    )


def build_command() -> click.Command:
    """The ``kvplug lm-server`` click command."""
    from kvplug_lm.server import LMServer, loop_factory, run_until_signal

    def lm_server(secret_file: str | None, log_level: str, **values: Any) -> None:
        logging.basicConfig(
            level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
        secret: bytes | None = None
        if secret_file is not None:
            secret = Path(secret_file).read_bytes().strip()
        elif os.environ.get(_env("secret")):
            secret = os.environ[_env("secret")].encode()
        if secret is not None and not secret:
            raise click.BadParameter("the shared secret is empty", param_hint="--secret-file")
        given = {name: value for name, value in values.items() if value is not None}
        try:
            options = ServerOptions(secret=secret, **given)
        except ValueError as error:
            raise click.UsageError(str(error)) from None
        server = LMServer(options)
        with asyncio.Runner(loop_factory=loop_factory(options.loop)) as runner:
            try:
                runner.run(run_until_signal(server))
            except (OSError, KvplugError) as error:
                raise click.ClickException(str(error)) from None
        sys.exit(0)

    hints = typing.get_type_hints(ServerOptions)
    decorated: Callable[..., None] = lm_server
    decorated = click.option(
        "--log-level", default="INFO", envvar=_env("log_level"), show_default=True
    )(decorated)
    decorated = click.option(
        "--secret-file",
        type=click.Path(exists=True, dir_okay=False),
        default=None,
        envvar=_env("secret_file"),
        help=f"File holding the extended mode's shared secret (or set {_env('secret')}).",
    )(decorated)
    for option in reversed(command_line_fields()):
        decorated = _option_of(option, hints[option.name])(decorated)
    return click.command(
        "lm-server",
        help="Serve LMCache's lm:// protocol (and kvplug's extended mode) from memory, "
        "bounded by --max-memory, optionally spilling to a kvplug tier.",
    )(decorated)


def main() -> None:
    """Run ``kvplug lm-server`` with the process' arguments."""
    build_command()(auto_envvar_prefix="KVPLUG_LM")


__all__ = ["ENV_PREFIX", "build_command", "main"]
