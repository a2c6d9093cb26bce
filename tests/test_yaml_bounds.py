"""Bounded reading of config data (issue 34, 7a): YAML aliases cannot expand a config without
bound, a value cannot contain itself, and the secret walks cost what data holds, not what its
shared parts would print as."""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvplug.errors import ConfigError
from kvplug.runtime.config import Config, load_config
from kvplug.runtime.config import yaml_file as bounds
from kvplug.secrets import MAX_REPR_LENGTH, mask_data, mask_repr

GUARD_S = 60
"""How long a run that may expand without bound (on code without the bound) gets before it
counts as hanging: bounded code refuses in well under 2 s (timed inside the run), but starting
the kvplug command (torch included) took over 20 s on a busy 2-core machine."""


def laughs(levels: int, use: str = "") -> str:
    """A "billion laughs" config: ``levels + 2`` lines whose aliases expand to 10**(levels + 1)
    scalars under ``extra_config``, and the line ``use`` after them."""
    lines = ['  a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"  a{n}: &a{n} [{', '.join([f'*a{n - 1}'] * 10)}]" for n in range(1, levels + 1)]
    return "extra_config:\n" + "\n".join(lines) + f"\n{use}\n"


def _error(call: Any, *args: Any, **kwargs: Any) -> str:
    with pytest.raises(ConfigError) as caught:
        call(*args, **kwargs)
    return str(caught.value)


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


def _run_guarded(args: list[str], env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run ``python args`` with at most :data:`GUARD_S` seconds and 4 GiB: exit code and
    output; a run past the time fails the test."""
    clean = {name: value for name, value in os.environ.items() if not name.startswith("KVPLUG_")}
    try:
        done = subprocess.run(
            [sys.executable, *args],
            env={**clean, **(env or {})},
            capture_output=True,
            text=True,
            timeout=GUARD_S,
            preexec_fn=_limit_memory,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"python {' '.join(args)} did not finish in {GUARD_S} s")
    return done.returncode, done.stdout + done.stderr


_TIMED_LOAD = """\
import sys, time
from kvplug.runtime.config import Config, load_config
from kvplug.errors import ConfigError
load = {{"load_config": lambda: load_config(sys.argv[1], env={{}}),
        "from_yaml path": lambda: Config.from_yaml(sys.argv[1]),
        "from_yaml text": lambda: Config.from_yaml(open(sys.argv[1]).read()),
        "KVPLUG_CONFIG_FILE": lambda: load_config()}}[{entry!r}]
started = time.perf_counter()
try:
    load()
except ConfigError as error:
    print(f"refused after {{time.perf_counter() - started:.3f}} s: {{error}}")
    sys.exit(3)
print("loaded")
"""


def _assert_names_fact_cause_and_fix(message: str, where: str) -> None:
    assert where in message
    assert f"more than kvplug reads from one config ({bounds.MAX_EXPANDED_NODES})" in message
    assert "aliases" in message and "anchor (&name)" in message and "billion laughs" in message
    assert "Write the repeated values out" in message


# --- a billion laughs fails fast on every way in ----------------------------------------------


@pytest.mark.parametrize(
    "entry", ["load_config", "from_yaml path", "from_yaml text", "KVPLUG_CONFIG_FILE"]
)
def test_billion_laughs_fails_fast_through_every_loader(tmp_path: Path, entry: str) -> None:
    path = tmp_path / "laughs.yaml"
    path.write_text(laughs(9))
    code, output = _run_guarded(
        ["-c", _TIMED_LOAD.format(entry=entry), str(path)], {"KVPLUG_CONFIG_FILE": str(path)}
    )
    assert code == 3, output
    refused = re.search(r"^refused after ([0-9.]+) s: (.*)$", output, flags=re.MULTILINE)
    assert refused is not None, output
    seconds, message = float(refused[1]), refused[2]
    assert seconds < 2
    _assert_names_fact_cause_and_fix(message, "the YAML text" if "text" in entry else str(path))
    if entry == "KVPLUG_CONFIG_FILE":
        assert "named by KVPLUG_CONFIG_FILE" in message


@pytest.mark.parametrize("named_by", ["--config", "KVPLUG_CONFIG_FILE"])
def test_kvplug_config_refuses_a_billion_laughs_at_once(tmp_path: Path, named_by: str) -> None:
    path = tmp_path / "laughs.yaml"
    path.write_text(laughs(9))
    command = ["-c", "from kvplug.runtime.cli import main; main()", "config"]
    if named_by == "--config":
        code, output = _run_guarded([*command, "--config", str(path)])
    else:
        code, output = _run_guarded(command, {"KVPLUG_CONFIG_FILE": str(path)})
    assert code == 1, output
    assert output.startswith("config error: ")
    _assert_names_fact_cause_and_fix(output, str(path))


@pytest.mark.parametrize(
    "use", ["", "tiers: [{url: 'cpu://', shared: *a5}]", "chunk_size: *a5", "tiers: *a5"]
)
def test_aliases_that_expand_past_the_bound_are_refused_wherever_they_stand(use: str) -> None:
    # 10**6 scalars: code without the bound walks them for seconds, then accepts the file or
    # rejects the value (after printing it).
    message = _error(Config.from_yaml, laughs(5, use))
    _assert_names_fact_cause_and_fix(message, "the YAML text")
    assert "the list at line 6, column 7 (&a4) to 111111 nodes" in message


# --- the bounds are exact, and real aliases stay legal -------------------------------------------

SHARED_OPTIONS = """\
extra_config:
  common: &common {timeout: 2.5, retries: 3}
tiers:
  - url: cpu://?max_size=1GiB
  - {<<: *common, url: 'redis://cache-1:6379'}
  - url: redis://cache-2:6379
    <<: *common
    timeout: 4
  - {url: 'redis://cache-3:6379', options: *common}
"""


def _nodes_document(total: int) -> tuple[str, int]:
    """A config whose nodes, with its aliases expanded, number ``total``, and how many aliases
    it uses: the root mapping, its key and its value (3), the key and list ``base`` (2 + 99
    scalars), the key and list ``uses`` (2 + 100 per alias of base) and the key and list
    ``pad`` (2 + the scalars left)."""
    uses, pad = divmod(total - 3 - 101 - 2 - 2, 100)
    text = (
        "extra_config:\n"
        f"  base: &base [{', '.join(['x'] * 99)}]\n"
        f"  uses: [{', '.join(['*base'] * uses)}]\n"
        f"  pad: [{', '.join(['p'] * pad)}]\n"
    )
    return text, uses


def _aliases_document(count: int) -> tuple[str, int]:
    return f"extra_config:\n  one: &one x\n  uses: [{', '.join(['*one'] * count)}]\n", count


@pytest.mark.parametrize("bound", ["expanded nodes", "alias uses"])
def test_real_aliases_load_and_so_does_each_bound_but_not_one_past(bound: str) -> None:
    config = Config.from_yaml(SHARED_OPTIONS)
    assert [dict(tier.options) for tier in config.tiers[1:]] == [
        {"timeout": 2.5, "retries": 3},
        {"timeout": 4, "retries": 3},
        {"options": {"timeout": 2.5, "retries": 3}},
    ]
    make: Callable[[int], tuple[str, int]]
    if bound == "expanded nodes":
        limit, make = bounds.MAX_EXPANDED_NODES, _nodes_document
        fact = f"expand the mapping at line 1, column 1 to {limit + 1} nodes"
    else:
        limit, make = bounds.MAX_ALIAS_USES, _aliases_document
        fact = f"uses YAML aliases more than {limit} times (alias {limit + 1} is *one at line 3"
    text, uses = make(limit)
    assert uses <= bounds.MAX_ALIAS_USES
    assert len(Config.from_yaml(text).extra_config["uses"]) == uses
    assert fact in _error(Config.from_yaml, make(limit + 1)[0])


def test_a_big_config_without_aliases_is_bounded_too(monkeypatch: pytest.MonkeyPatch) -> None:
    # A smaller bound: composing 10**5 scalars in pure Python takes seconds. The root mapping,
    # extra_config and its mapping, pad and its list are 5 nodes; the scalars the rest.
    monkeypatch.setattr(bounds, "MAX_EXPANDED_NODES", 1000)
    assert (
        len(Config.from_yaml(f"extra_config: {{pad: [{'p, ' * 995}]}}").extra_config["pad"]) == 995
    )
    message = _error(Config.from_yaml, f"extra_config: {{pad: [{'p, ' * 996}]}}")
    assert "the mapping at line 1, column 1 holds 1001 nodes" in message
    assert "aliases" not in message and "Remove what kvplug does not read" in message


@pytest.mark.parametrize(
    ("text", "what"),
    [
        ("extra_config: &loop {again: *loop}", "the mapping at line 1, column 15 (&loop)"),
        ("extra_config: {x: &loop [1, *loop]}", "the list at line 1, column 19 (&loop)"),
        ("tiers: &loop [cpu://, *loop]", "the list at line 1, column 8 (&loop)"),
    ],
)
def test_a_value_that_holds_an_alias_of_itself_is_refused(text: str, what: str) -> None:
    message = _error(Config.from_yaml, text)
    assert f"{what} contains an alias of itself (*loop)" in message
    assert "Write the value out" in message


def test_a_value_shared_at_two_depths_counts_at_the_deeper() -> None:
    # 28 levels under &deep: 30 where 'shallow' uses it, 34 under 'deeper'.
    deep = "[" * 28 + "]" * 28
    text = f"extra_config:\n  a: &deep {deep}\n  deeper: [[[[*deep]]]]\n  shallow: *deep\n"
    assert "nest more than 32 levels" in _error(Config.from_yaml, text)
    assert Config.from_yaml(text.replace("[[[[*deep]]]]", "[[*deep]]")).extra_config


@pytest.mark.parametrize("levels", [40, 100_000])
def test_deeply_nested_extra_config_json_in_the_environment_is_refused(levels: int) -> None:
    raw = '{"x": ' + "[" * levels + "]" * levels + "}"
    message = _error(load_config, env={"KVPLUG_EXTRA_CONFIG": raw})
    assert "environment variable KVPLUG_EXTRA_CONFIG" in message
    assert "nest more than 32 levels" in message


# --- walks of data that shares its parts ------------------------------------------------------


class Probe:
    """A value that counts how often a walk asks it for a secret (``get_secret_value``)."""

    def __init__(self) -> None:
        self.looked_up = 0

    def __getattr__(self, name: str) -> Any:
        if name != "get_secret_value":
            raise AttributeError(name)
        self.looked_up += 1
        return lambda: "probe-secret-value"


def shared(leaf: object, levels: int) -> list[Any]:
    """``leaf`` 10**levels times over, in ``levels + 1`` lists."""
    data: list[Any] = [leaf]
    for _ in range(levels):
        data = [data] * 10
    return data


def _walks_of(call: Any, leaf_to_data: Any) -> tuple[int, int]:
    """How often ``call`` asks the probe for its secret when it stands once, and when it
    stands 10**5 times in shared lists."""
    once, many = Probe(), Probe()
    call(leaf_to_data([once]))
    call(leaf_to_data(shared(many, 5)))
    return once.looked_up, many.looked_up


@pytest.mark.parametrize(
    "leaf_to_data",
    [lambda data: data, lambda data: {"tiers": data}, lambda data: {"password": data}],
    ids=["list", "under a name", "under a secret name"],
)
def test_mask_data_walks_a_shared_part_once(leaf_to_data: Any) -> None:
    once, many = _walks_of(mask_data, leaf_to_data)
    assert once == many >= 1


def test_loading_a_config_built_with_shared_parts_walks_each_part_once() -> None:
    def load(data: Any) -> None:
        load_config(env={}, extra_config={"data": data, "api_key": data})

    once, many = _walks_of(load, lambda data: data)
    assert once == many >= 1


def test_mask_data_keeps_sharing_and_masks_every_place_of_a_shared_secret() -> None:
    part = {"token": "tok-3f9a2c", "url": "redis://app:pw-8c1d@h:1", "n": 1}
    masked = mask_data({"a": [part, part], "b": part})
    assert masked["a"][0] is masked["a"][1] is masked["b"]
    assert masked["b"] == {"token": "***", "url": "redis://app:***@h:1", "n": 1}


def test_mask_data_and_mask_repr_take_data_that_holds_itself() -> None:
    loop: list[Any] = [1]
    loop.append(loop)
    table: dict[str, Any] = {"list": loop, "password": "pw-loop-77"}
    table["self"] = table
    masked = mask_data(table)
    assert masked["self"] is masked and masked["list"][1] is masked["list"]
    assert mask_repr(table) == "{'list': [1, [...]], 'password': '***', 'self': {...}}"


class Shown:
    """A value that counts how often it is printed."""

    def __init__(self) -> None:
        self.printed = 0

    def __repr__(self) -> str:
        self.printed += 1
        return "Shown()"


@pytest.mark.parametrize("limit", [80, None])
def test_mask_repr_of_shared_data_prints_only_what_it_shows(limit: int | None) -> None:
    shown = Shown()
    text = mask_repr(shared(["lol", shown], 5), limit)
    assert len(text) == (limit or MAX_REPR_LENGTH) and text.endswith("...")
    assert text[:-3] == repr(shared(["lol", Shown()], 5))[: len(text) - 3]
    assert shown.printed <= len(text) // len("Shown()")
