"""The ``kvplug`` command: inspect plugins and configuration, check a backend end to end."""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

import click
import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

import kvplug
from kvplug.errors import KvplugError, NotSupported
from kvplug.keys import CacheKey
from kvplug.memory import KV_DTYPES, FreeListAllocator, MemoryFormat, nbytes_of
from kvplug.registry import create_backend, load_plugin_serdes, plugins
from kvplug.runtime.bench import (
    DEFAULT_COUNT,
    DEFAULT_SHAPE,
    FLUSH_TIMEOUT,
    METHOD,
    default_bench_config,
    describe_drops,
    drop_advice,
    main_reason,
    run_bench,
)
from kvplug.runtime.config import Config, load_config
from kvplug.runtime.store import open_store
from kvplug.secrets import mask_data, mask_text, mask_url
from kvplug.serde import available_serdes, get_serde_class, serde_source
from kvplug.stats import OperationStats
from kvplug.units import format_size

T = TypeVar("T")
console = Console()
CHECK_MODEL = "kvplug-check"
"""The keys' ``fmt`` in ``kvplug check``: no engine writes it."""


@click.group()
@click.version_option(kvplug.__version__, prog_name="kvplug")
def main() -> None:
    """kvplug: pluggable storage backends for LLM KV-cache offloading."""


@main.command("plugins")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def plugins_command(as_json: bool) -> None:
    """List every installed plugin: distribution, version, schemes, serdes and load errors."""
    infos = plugins()
    load_plugin_serdes()
    serdes = _serde_rows()
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
                "serdes": [row for row in serdes if row["name"] in info.serdes],
                "error": info.error,
            }
            for info in infos
        ]
        click.echo(json.dumps(rows, indent=2))
        return
    # Schemes are what a user copies from here: they are never cut or wrapped, one per line,
    # and the description is what gives way in a narrow terminal.
    longest_scheme = max(
        (len(s) + 3 for i in infos for spec in i.specs for s in spec.schemes), default=8
    )
    longest_plugin = max(
        (len(text) for i in infos for text in (i.name, i.distribution, i.version)), default=6
    )
    table = Table(title="kvplug plugins")
    table.add_column("schemes", no_wrap=True, min_width=longest_scheme, overflow="fold")
    table.add_column("plugin", no_wrap=True, min_width=longest_plugin, overflow="fold")
    table.add_column("kind", no_wrap=True)
    table.add_column("description", ratio=1, overflow="fold")
    for info in infos:
        plugin = escape(f"{info.name}\n{info.distribution}\n{info.version}")
        if info.error:
            table.add_row("-", plugin, "-", f"[red]{escape(info.error)}[/red]")
        elif not info.specs and info.serdes:
            listed = ", ".join(info.serdes)
            table.add_row("-", plugin, "serdes", escape(f"{listed} (below)"), end_section=True)
        for spec in info.specs:
            schemes = "\n".join(f"{s}://" for s in spec.schemes)
            table.add_row(schemes, plugin, spec.kind, escape(spec.description), end_section=True)
    console.print(table)
    if not infos:
        console.print("No kvplug plugins are installed: pip install kvplug-cpu")
    serde_table = Table(title="kvplug serdes (?serde=<name> on a byte store)")
    longest_serde = max((len(str(row["name"])) for row in serdes), default=5)
    longest_source = max((len(str(row["source"])) for row in serdes), default=4)
    serde_table.add_column("serde", no_wrap=True, min_width=longest_serde, overflow="fold")
    serde_table.add_column("from", no_wrap=True, min_width=longest_source, overflow="fold")
    serde_table.add_column("lossy", no_wrap=True)
    serde_table.add_column("description", ratio=1, overflow="fold")
    for row in serdes:
        status = f"\n[red]{escape(str(row['error']))}[/red]" if row["error"] else ""
        serde_table.add_row(
            str(row["name"]),
            escape(str(row["source"])),
            "yes" if row["lossy"] else "no",
            escape(str(row["description"])) + status,
        )
    console.print(serde_table)


def _serde_rows() -> list[dict[str, object]]:
    """Every serde with who provides it and whether it can run here (for ``kvplug plugins``)."""
    rows: list[dict[str, object]] = []
    for name in available_serdes():
        try:
            serde = get_serde_class(name)
        except KvplugError as error:
            rows.append(
                {"name": name, "source": "", "lossy": False, "description": "", "error": str(error)}
            )
            continue
        rows.append(
            {
                "name": name,
                "source": serde_source(name),
                "lossy": serde.lossy,
                "description": serde.description,
                "error": serde.unavailable(),
            }
        )
    return rows


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
        click.echo(f"config error: {mask_text(str(error))}", err=True)
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


CHECK_SHAPES = ((2, 1, 1, 128), (2, 4, 256, 128), DEFAULT_SHAPE)
"""What ``kvplug check`` round-trips by default: a one-token object, a 512 KiB object and one
full model-shaped chunk (``kvplug bench``'s), so a store that refuses real chunks fails."""


async def _check(
    url: str,
    options: dict[str, Any],
    shapes: Sequence[tuple[int, ...]],
    dtype: torch.dtype,
    rounds: int,
) -> tuple[dict[str, list[float]], Any, dict[str, str], dict[str, OperationStats]]:
    largest = max(nbytes_of(shape, dtype) for shape in shapes)
    allocator = FreeListAllocator(max(2 * largest + (1 << 20), 1 << 22))
    backend = create_backend(url, allocator=allocator, **options)
    shown = mask_url(url)
    samples: dict[str, list[float]] = {}
    await _timed(samples, "open", backend.open())
    details = backend.describe()
    generator = torch.Generator().manual_seed(0)
    try:
        for shape_index, shape in enumerate(shapes):
            size = format_size(nbytes_of(shape, dtype))
            what = f"a {size} object (shape {list(shape)} {dtype})"
            for round_index in range(rounds):
                key = CacheKey(CHECK_MODEL, 1, 0, shape_index * rounds + round_index)
                obj = allocator.allocate(shape, dtype, MemoryFormat.KV_2LTD)
                if obj is None:
                    raise KvplugError("the check's own buffer is too small for the shape")
                obj.raw.copy_(
                    torch.randint(0, 256, (obj.nbytes,), dtype=torch.uint8, generator=generator)
                )
                try:
                    try:
                        await _timed(samples, f"put {size}", backend.put(key, obj))
                    except KvplugError as error:
                        raise KvplugError(
                            f"{shown}: put of {what} failed: {type(error).__name__}: {error}"
                        ) from error
                    if not await _timed(samples, f"contains {size}", backend.contains(key)):
                        raise KvplugError(
                            f"{shown}: contains() is False right after put() of {what}"
                        )
                    got = await _timed(samples, f"get {size}", backend.get(key))
                    if got is None:
                        raise KvplugError(f"{shown}: get() missed right after put() of {what}")
                    try:
                        if (got.shape, got.dtype) != (obj.shape, obj.dtype) or not torch.equal(
                            got.raw, obj.raw
                        ):
                            raise KvplugError(
                                f"{shown}: get() returned different bytes than put() of {what}"
                            )
                    finally:
                        got.release()
                    with contextlib.suppress(NotSupported):
                        await _timed(samples, f"remove {size}", backend.remove(key))
                finally:
                    obj.release()
        if await backend.get(CacheKey(CHECK_MODEL, 1, 0, -1)) is not None:
            raise KvplugError(f"{shown}: get() of a key never stored did not miss")
    finally:
        await _timed(samples, "close", backend.close())
    return samples, backend.capabilities, details, backend.operation_stats()


def _tiers_table(tier_stats: dict[str, dict[str, Any]]) -> Table:
    """Each tier's counters as ``Store.stats()`` gives them (and its Prometheus series)."""
    table = Table(title="the Store's tiers: their operation counters")
    columns = ("tier", "reads", "hits", "hit rate", "writes", "written", "errors", "dropped")
    for column in columns:
        table.add_column(column, justify="left" if column == "tier" else "right")
    for name, tier in tier_stats.items():
        rate = tier["hit_rate"]
        table.add_row(
            mask_url(name),
            str(tier["reads"]),
            str(tier["hits"]),
            "-" if rate is None else f"{rate:.0%}",
            str(tier["writes"]),
            format_size(tier["bytes_written"]),
            str(tier["errors"]),
            str(int(tier["dropped_puts"])),
        )
    return table


def _counters_table(title: str, stats: dict[str, OperationStats]) -> Table:
    """A backend's :meth:`~kvplug.backend.Backend.operation_stats`, one row per operation: the
    counters the Store's series and the engines' status reports show."""
    table = Table(title=title)
    columns = ("operation", "calls", "errors", "keys", "hits", "misses", "bytes", "mean ms")
    for column in columns:
        table.add_column(column, justify="left" if column == "operation" else "right")
    for name, counts in sorted(stats.items()):
        mean = counts.seconds / counts.calls * 1000 if counts.calls else 0.0
        table.add_row(
            name,
            *(str(n) for n in (counts.calls, counts.errors, counts.keys, counts.hits)),
            str(counts.misses),
            format_size(counts.bytes),
            f"{mean:.3f}",
        )
    return table


def _with_options(config: Config, extra: dict[str, Any]) -> Config:
    """``config`` with ``extra`` options on every tier (``kvplug check -o``)."""
    if not extra:
        return config
    data = config.to_dict()
    data["tiers"] = [{"url": tier.url, **tier.options, **extra} for tier in config.tiers]
    return Config.from_dict(data, source="the config with the -o options")


async def _check_store(
    config: Config, shapes: Sequence[tuple[int, ...]], dtype: torch.dtype, rounds: int
) -> tuple[int, list[str], dict[str, dict[str, Any]]]:
    """Round-trip each object through the whole Store of ``config``, one at a time: put it
    through the Store, flush the write-behind, read it back from every tier, remove it. How
    many objects went through, one problem per tier that did not return each bit-exact
    (with its drop reasons and what to change), and each tier's counters
    (``Store.stats()["tiers"]``)."""
    store = await open_store(config)
    names = store.tier_names
    missed: dict[str, dict[int, int]] = {name: {} for name in names}
    """Per tier: objects it did not return, by size in bytes."""
    wrong = dict.fromkeys(names, 0)
    errors: dict[str, str] = {}
    sizes: dict[int, int] = {}
    generator = torch.Generator().manual_seed(0)
    try:
        for shape_index, shape in enumerate(shapes):
            nbytes = nbytes_of(shape, dtype)
            for round_index in range(rounds):
                key = CacheKey(f"{CHECK_MODEL}/store", 1, 0, shape_index * rounds + round_index)
                obj = store.allocate(shape, dtype, MemoryFormat.KV_2LTD)
                if obj is None:
                    raise KvplugError(
                        f"the Store's memory budget ({format_size(store.budget.stats().capacity)})"
                        f" has no room for a {format_size(nbytes)} object: raise the cpu tier's "
                        "max_size or the config's buffer_size"
                    )
                obj.raw.copy_(
                    torch.randint(0, 256, (obj.nbytes,), dtype=torch.uint8, generator=generator)
                )
                sizes[nbytes] = sizes.get(nbytes, 0) + 1
                try:
                    # A put refused is not raised: each tier's drop is counted, reported below.
                    await store.offer([key], [obj])
                    try:
                        await store.flush(FLUSH_TIMEOUT)
                    except TimeoutError:
                        stalled = [n for n, t in store.stats()["tiers"].items() if t["queued"]]
                        raise KvplugError(
                            f"the Store's write-behind did not finish within {FLUSH_TIMEOUT:g} s "
                            f"(still queued for {', '.join(stalled) or 'a tier'}): a lower "
                            "tier is stalled"
                        ) from None
                    for name, backend in zip(names, store.tiers, strict=True):
                        try:
                            got = await backend.get(key)
                        except (KvplugError, OSError) as error:
                            errors[name] = f"get: {type(error).__name__}: {error}"
                            got = None
                        if got is None:
                            missed[name][nbytes] = missed[name].get(nbytes, 0) + 1
                            continue
                        if (got.shape, got.dtype) != (obj.shape, obj.dtype) or not torch.equal(
                            got.raw, obj.raw
                        ):
                            wrong[name] += 1
                        got.release()
                    with contextlib.suppress(NotSupported):
                        await store.remove(key)
                finally:
                    obj.release()
    finally:
        await store.close()
    total = sum(sizes.values())
    stats = store.stats()["tiers"]
    problems = []
    for name, health in zip(names, store.health(), strict=True):
        lost = sum(missed[name].values())
        if not lost and not wrong[name]:
            continue
        tier = stats[name]
        dropped = {reason: int(n) for reason, n in tier["dropped_by_reason"].items() if n}
        offered = int(tier.get("offered_puts", total))
        parts = [f"tier {name} returned {total - lost - wrong[name]} of {total} objects"]
        if lost:
            parts.append(
                "missed "
                + ", ".join(
                    f"{n} of {sizes[nbytes]} {format_size(nbytes)} objects"
                    for nbytes, n in sorted(missed[name].items())
                )
            )
        if wrong[name]:
            parts.append(f"{wrong[name]} read back with different bytes")
        if dropped:
            parts.append(describe_drops(offered, dropped, took_none=lost == total))
        last = errors.get(name) or health.last_error or health.last_dropped
        if last:
            parts.append(f"last problem: {last}")
        if dropped:
            advice = drop_advice(
                main_reason(dropped),
                object_bytes=max(missed[name] or sizes),
                write_behind_limit=store.write_behind_limit,
            )
            parts.append(f"to fix: {advice}")
        problems.append("; ".join(parts))
    return total, problems, stats


@main.command("check")
@click.argument("url", required=False)
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    help="Config file whose tiers are all checked, each with its options, when no URL is given.",
)
@click.option(
    "--shape",
    "shapes",
    multiple=True,
    callback=lambda c, p, v: tuple(_parse_shape(text) for text in v) or CHECK_SHAPES,
    help="Shape of a test object (repeatable). Default: a one-token object, a 512 KiB object "
    "and one full chunk of 2,32,256,1024.",
)
@click.option("--dtype", type=click.Choice(sorted(KV_DTYPES)), default="float16", show_default=True)
@click.option(
    "--rounds", type=click.IntRange(1, 10_000), default=3, show_default=True, help="per shape"
)
@click.option(
    "-o",
    "--option",
    "option_pairs",
    multiple=True,
    metavar="NAME=VALUE",
    help="Backend option (repeatable); wins over the URL's query and the config's options.",
)
def check_command(
    url: str | None,
    config_path: str | None,
    shapes: tuple[tuple[int, ...], ...],
    dtype: str,
    rounds: int,
    option_pairs: tuple[str, ...],
) -> None:
    """Open URL (or every configured tier), round-trip objects bit-exact, report latency.

    With no URL, each configured tier is checked on its own, then the objects also go through
    the whole configured Store, one at a time (put through the Store, flush its write-behind,
    read every tier back): a tier that does not get an object through the Store (the
    write-behind dropped it, the tier refused it) fails the check, named with the reason and
    what to change.
    """
    try:
        extra = _parse_options(option_pairs)
        store_config = None
        if url is None:
            config = load_config(config_path)
            targets = [
                (f"tier {index} ", tier.url, {**tier.options, **extra})
                for index, tier in enumerate(config.tiers)
            ]
            store_config = _with_options(config, extra)
        else:
            targets = [("", url, extra)]
    except KvplugError as error:
        click.echo(f"check failed: {mask_text(str(error))}", err=True)
        sys.exit(1)
    failed = 0
    for label, target, options in targets:
        try:
            samples, capabilities, details, counters = asyncio.run(
                _check(target, options, shapes, KV_DTYPES[dtype], rounds)
            )
        except KvplugError as error:
            click.echo(f"check failed: {label}{mask_text(str(error))}", err=True)
            failed += 1
            continue
        sizes = ", ".join(format_size(nbytes_of(shape, KV_DTYPES[dtype])) for shape in shapes)
        table = Table(
            title=f"kvplug check {label}{mask_url(target)}: {rounds} round(s) of {sizes}, bit-exact"
        )
        for column in ("operation", "calls", "p50 ms", "max ms"):
            table.add_column(column, justify="right" if column != "operation" else "left")
        for name, values in samples.items():
            table.add_row(
                name, str(len(values)), f"{statistics.median(values):.3f}", f"{max(values):.3f}"
            )
        console.print(table)
        console.print(_counters_table("the backend's operation counters", counters))
        console.print("capabilities: " + (", ".join(capabilities.declared()) or "none"))
        for name, value in details.items():
            console.print(f"{name}: {value}", markup=False, highlight=False)
        console.print(f"[green]OK[/green] {escape(label + mask_url(target))}")
    if store_config is not None:
        targets.append(("the Store", "", {}))
        tier_stats: dict[str, dict[str, Any]] = {}
        try:
            total, problems, tier_stats = asyncio.run(
                _check_store(store_config, shapes, KV_DTYPES[dtype], rounds)
            )
        except KvplugError as error:
            total, problems = 0, [f"{type(error).__name__}: {error}"]
        if tier_stats:
            console.print(_tiers_table(tier_stats))
        for problem in problems:
            click.echo(f"check failed: the Store: {mask_text(problem)}", err=True)
        if problems:
            failed += 1
        else:
            console.print(
                f"[green]OK[/green] the Store of {len(store_config.tiers)} tier(s): each of "
                f"{total} objects put through it, flushed and read back bit-exact from every tier"
            )
    if failed:
        click.echo(f"check failed for {failed} of {len(targets)} target(s)", err=True)
        sys.exit(1)


@main.command(
    "bench",
    help="Store and read back KV chunks through the tiers, verify every byte, report GB/s.\n\n"
    f"How it measures: {METHOD}. Exits 1 when a tier stores or returns fewer chunks than it "
    "was given, naming the tier, the counts, why its puts were dropped and what to change.",
)
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
            click.echo(f"bench failed: {mask_text(str(error))}", err=True)
            sys.exit(1)
    table = Table(
        title=f"kvplug bench: {count} chunks of {shape} {dtype} ({format_size(chunk_bytes)} each)"
    )
    for column in ("operation", "tier", "chunks", "GB/s", "p50 ms/call", "p99 ms/call", "misses"):
        table.add_column(
            column,
            justify="left" if column in ("operation", "tier") else "right",
            overflow="fold",  # a tier's URL is never cut short
        )
    for row in result.rows:
        measured = row.count > 0
        table.add_row(
            row.operation,
            row.tier,
            str(row.chunks),
            "-" if not measured else "zero-copy" if row.zero_copy else f"{row.gb_per_s:.2f}",
            f"{row.percentile_ms(0.5):.2f}" if measured else "-",
            f"{row.percentile_ms(0.99):.2f}" if measured else "-",
            str(row.misses),
        )
    console.print(table)

    def say(line: str) -> None:  # one line each, never wrapped: tests and scripts read them
        console.print(mask_text(line), markup=False, highlight=False, soft_wrap=True)

    say(f"method: {METHOD}")
    say(
        f"sustained: {count} chunks ({format_size(count * chunk_bytes)}) into every tier "
        f"in {result.put_seconds:.2f} s from the first put until flush() returned: "
        f"{result.sustained_gb_per_s:.2f} GB/s; {result.waited_puts} of {count} puts waited for "
        f"write-behind room ({result.waited_seconds:.2f} s in all; write_behind_size "
        f"{format_size(result.write_behind_limit)})"
    )
    for tier in result.tiers:
        say(
            f"tier {tier.tier}: {tier.stored} of {tier.given} chunks stored, {tier.returned} "
            f"returned, {tier.dropped} puts dropped"
        )
        if tier.removed is None:
            say(
                f"tier {tier.tier} cannot delete: the chunks it stored stay under "
                f"{result.namespace}@... until it evicts or expires them."
            )
    failures = result.shortfalls
    if result.refused:
        failures.append(
            f"the store accepted {count - result.refused} of {count} puts (Store.offer); the "
            "tiers' lines say why"
        )
    if result.mismatches:
        failures.append(f"{result.mismatches} chunk(s) read back with wrong bytes")
    for line in failures:
        console.print(f"[red]FAIL[/red] {escape(mask_text(line))}", soft_wrap=True)
    if failures:
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
