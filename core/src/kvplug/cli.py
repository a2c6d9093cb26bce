"""The ``kvplug`` command: inspect plugins and configuration, check a backend end to end."""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

import click
import torch
from rich.console import Console
from rich.table import Table

import kvplug
from kvplug.bench import (
    DEFAULT_COUNT,
    DEFAULT_SHAPE,
    default_bench_config,
    run_bench,
)
from kvplug.config import load_config
from kvplug.errors import KvplugError, NotSupported
from kvplug.keys import CacheKey
from kvplug.memory import KV_DTYPES, FreeListAllocator, MemoryFormat, nbytes_of
from kvplug.registry import create_backend, plugins
from kvplug.secrets import mask_data, mask_url

T = TypeVar("T")
console = Console()


@click.group()
@click.version_option(kvplug.__version__, prog_name="kvplug")
def main() -> None:
    """kvplug: pluggable storage backends for LLM KV-cache offloading."""


@main.command("plugins")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def plugins_command(as_json: bool) -> None:
    """List every installed plugin: distribution, version, schemes and load errors."""
    infos = plugins()
    if as_json:
        rows = [
            {
                "plugin": info.name,
                "distribution": info.distribution,
                "version": info.version,
                "backends": [
                    {
                        "name": spec.name,
                        "schemes": list(spec.schemes),
                        "kind": spec.kind,
                        "description": spec.description,
                    }
                    for spec in info.specs
                ],
                "error": info.error,
            }
            for info in infos
        ]
        click.echo(json.dumps(rows, indent=2))
        return
    table = Table(title="kvplug plugins")
    for column in ("plugin", "distribution", "version", "schemes", "kind", "description"):
        table.add_column(column)
    for info in infos:
        if info.error:
            table.add_row(
                info.name, info.distribution, info.version, "-", "-", f"[red]{info.error}[/red]"
            )
        for spec in info.specs:
            schemes = ", ".join(f"{s}://" for s in spec.schemes)
            table.add_row(
                info.name, info.distribution, info.version, schemes, spec.kind, spec.description
            )
    console.print(table)
    if not infos:
        console.print("No kvplug plugins are installed: pip install kvplug-cpu")


@main.command("config")
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    help="Config file (default: KVPLUG_CONFIG_FILE, else built-in defaults).",
)
def config_command(config_path: str | None) -> None:
    """Print the resolved configuration in the explicit tiers form (secrets masked)."""
    import yaml

    try:
        config = load_config(config_path)
    except KvplugError as error:
        click.echo(f"config error: {error}", err=True)
        sys.exit(1)
    click.echo(yaml.safe_dump(mask_data(config.to_dict()), sort_keys=False), nl=False)


def _parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of integers") from None
    if not shape or any(dim <= 0 for dim in shape):
        raise click.BadParameter(f"{text!r} needs positive dimensions, e.g. 2,32,256,1024")
    return shape


def _parse_options(pairs: tuple[str, ...]) -> dict[str, str]:
    options = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise click.BadParameter(
                "an option is not NAME=VALUE (not shown: it may hold a secret); "
                "write e.g. -o max_size=1GiB"
            )
        options[name] = value
    return options


async def _timed(samples: dict[str, list[float]], name: str, op: Awaitable[T]) -> T:
    start = time.perf_counter()
    result = await op
    samples.setdefault(name, []).append((time.perf_counter() - start) * 1000)
    return result


async def _check(
    url: str, options: dict[str, Any], shape: tuple[int, ...], dtype: torch.dtype, rounds: int
) -> tuple[dict[str, list[float]], Any, dict[str, str]]:
    allocator = FreeListAllocator(max(2 * nbytes_of(shape, dtype) + (1 << 20), 1 << 22))
    backend = create_backend(url, allocator=allocator, **options)
    shown = mask_url(url)
    samples: dict[str, list[float]] = {}
    await _timed(samples, "open", backend.open())
    details = backend.describe()
    generator = torch.Generator().manual_seed(0)
    try:
        for round_index in range(rounds):
            key = CacheKey("kvplug-check", "check-model", 1, 0, round_index)
            obj = allocator.allocate(shape, dtype, MemoryFormat.KV_2LTD)
            if obj is None:
                raise KvplugError("the check's own buffer is too small for the shape")
            obj.raw.copy_(
                torch.randint(0, 256, (obj.nbytes,), dtype=torch.uint8, generator=generator)
            )
            try:
                await _timed(samples, "put", backend.put(key, obj))
                if not await _timed(samples, "contains", backend.contains(key)):
                    raise KvplugError(f"{shown}: contains() is False right after put()")
                got = await _timed(samples, "get", backend.get(key))
                if got is None:
                    raise KvplugError(f"{shown}: get() missed right after put()")
                try:
                    if (got.shape, got.dtype) != (obj.shape, obj.dtype) or not torch.equal(
                        got.raw, obj.raw
                    ):
                        raise KvplugError(f"{shown}: get() returned different bytes than put()")
                finally:
                    got.release()
                with contextlib.suppress(NotSupported):
                    await _timed(samples, "remove", backend.remove(key))
            finally:
                obj.release()
        if await backend.get(CacheKey("kvplug-check", "check-model", 1, 0, -1)) is not None:
            raise KvplugError(f"{shown}: get() of a key never stored did not miss")
    finally:
        await _timed(samples, "close", backend.close())
    return samples, backend.capabilities, details


@main.command("check")
@click.argument("url", required=False)
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    help="Config file whose first tier is checked when no URL is given.",
)
@click.option(
    "--shape",
    default="2,4,256,128",
    show_default=True,
    callback=lambda c, p, v: _parse_shape(v),
    help="Shape of the test object.",
)
@click.option("--dtype", type=click.Choice(sorted(KV_DTYPES)), default="float16", show_default=True)
@click.option("--rounds", type=click.IntRange(1, 10_000), default=5, show_default=True)
@click.option(
    "-o",
    "--option",
    "option_pairs",
    multiple=True,
    metavar="NAME=VALUE",
    help="Backend option (repeatable); wins over the URL's query.",
)
def check_command(
    url: str | None,
    config_path: str | None,
    shape: tuple[int, ...],
    dtype: str,
    rounds: int,
    option_pairs: tuple[str, ...],
) -> None:
    """Open URL (or the configured first tier), round-trip objects, report latency."""
    options: dict[str, Any] = {}
    try:
        if url is None:
            tier = load_config(config_path).tiers[0]
            url, options = tier.url, dict(tier.options)
        options.update(_parse_options(option_pairs))
        samples, capabilities, details = asyncio.run(
            _check(url, options, shape, KV_DTYPES[dtype], rounds)
        )
    except KvplugError as error:
        click.echo(f"check failed: {error}", err=True)
        sys.exit(1)
    size = nbytes_of(shape, KV_DTYPES[dtype])
    title = f"kvplug check {mask_url(url)}: {rounds} round(s) of {size} bytes, bit-exact"
    table = Table(title=title)
    for column in ("operation", "calls", "p50 ms", "max ms"):
        table.add_column(column, justify="right" if column != "operation" else "left")
    for name, values in samples.items():
        table.add_row(
            name, str(len(values)), f"{statistics.median(values):.3f}", f"{max(values):.3f}"
        )
    console.print(table)
    console.print("capabilities: " + (", ".join(capabilities.declared()) or "none"))
    for name, value in details.items():
        console.print(f"{name}: {value}", markup=False, highlight=False)
    console.print("[green]OK[/green]")


@main.command("bench")
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    help="Config whose tiers to measure (default: cpu:// in front of file:// in a temp dir).",
)
@click.option(
    "--shape",
    default=",".join(str(d) for d in DEFAULT_SHAPE),
    show_default=True,
    callback=lambda c, p, v: _parse_shape(v),
    help="Shape of one KV chunk ([2, layers, tokens, heads*head_size]).",
)
@click.option("--dtype", type=click.Choice(sorted(KV_DTYPES)), default="float16", show_default=True)
@click.option(
    "--count",
    type=click.IntRange(1, 1_000_000),
    default=DEFAULT_COUNT,
    show_default=True,
    help="Number of chunks.",
)
def bench_command(config_path: str | None, shape: tuple[int, ...], dtype: str, count: int) -> None:
    """Store and read back KV chunks through the tiers, verify every byte, report GB/s."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    torch_dtype = KV_DTYPES[dtype]
    chunk_bytes = nbytes_of(shape, torch_dtype)
    with (
        tempfile.TemporaryDirectory(prefix="kvplug-bench-") as scratch,
        Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            console=console,
            transient=True,
        ) as bar,
    ):
        tasks: dict[str, Any] = {}

        def progress(phase: str, done: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = bar.add_task(phase, total=total)
            bar.update(tasks[phase], completed=done)

        try:
            config = (
                load_config(config_path)
                if config_path
                else default_bench_config(scratch, chunk_bytes, count)
            )
            result = asyncio.run(
                run_bench(config, shape=shape, dtype=torch_dtype, count=count, progress=progress)
            )
        except KvplugError as error:
            click.echo(f"bench failed: {error}", err=True)
            sys.exit(1)
    table = Table(
        title=f"kvplug bench: {count} chunks of {shape} {dtype} "
        f"({chunk_bytes / 2**20:.1f} MiB each)"
    )
    for column in ("operation", "tier", "chunks", "GB/s", "p50 ms", "p99 ms", "misses"):
        table.add_column(column, justify="left" if column in ("operation", "tier") else "right")
    for row in result.rows:
        table.add_row(
            row.operation,
            row.tier,
            str(row.count),
            "zero-copy" if row.zero_copy else f"{row.gb_per_s:.2f}",
            f"{row.percentile_ms(0.5):.2f}",
            f"{row.percentile_ms(0.99):.2f}",
            str(row.misses),
        )
    console.print(table)
    if result.mismatches:
        console.print(f"[red]{result.mismatches} chunk(s) read back with wrong bytes[/red]")
        sys.exit(1)
    console.print(f"[green]verified[/green] {result.verified} reads bit-exact")


def _add_plugin_commands() -> None:
    """Commands other distributions add through the ``kvplug.commands`` entry-point group
    (kvplug-contracts adds ``kvplug contract``)."""
    import importlib.metadata

    for entry_point in importlib.metadata.entry_points(group="kvplug.commands"):
        try:
            command = entry_point.load()
        except Exception as error:
            dist = entry_point.dist.metadata["Name"] if entry_point.dist else entry_point.value
            message = f"cannot load the {entry_point.name!r} command of {dist}: {error}"

            @main.command(entry_point.name, help=message)
            def broken(message: str = message) -> None:
                click.echo(message, err=True)
                sys.exit(1)

            continue
        main.add_command(command, entry_point.name)
    if "contract" not in main.commands:

        @main.command("contract", context_settings={"ignore_unknown_options": True})
        @click.argument("args", nargs=-1, type=click.UNPROCESSED)
        def contract_missing(args: tuple[str, ...]) -> None:
            """Run the backend conformance suite (needs kvplug-contracts)."""
            click.echo("kvplug contract needs the suite: pip install kvplug-contracts", err=True)
            sys.exit(1)


_add_plugin_commands()

__all__ = ["main"]
