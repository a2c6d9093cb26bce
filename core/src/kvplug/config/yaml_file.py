"""Reading YAML config text and files safely: no Python objects, no key given twice in one
mapping, no values nested deeper than :data:`MAX_NESTING`; every failure a ConfigError saying
where."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from kvplug.config.conversions import expand
from kvplug.errors import ConfigError

MAX_NESTING = 32
"""How deep config values may nest; far beyond any real configuration."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that rejects a key given twice in one mapping."""


def _construct_unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _value_node in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node)
        try:
            duplicate = key in seen
        except TypeError:
            continue
        if duplicate:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping",
                node.start_mark,
                f"found the key {key!r} twice; give each key once",
                key_node.start_mark,
            )
        seen.add(key)
    return loader.construct_mapping(node)


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping
)


def _nesting_depth(data: object) -> int:
    """How deep ``data``'s mappings and lists nest, found without recursion (each container
    is walked once, so YAML aliases that share one list many times cost nothing extra)."""
    deepest = 0
    seen: set[int] = set()
    stack: list[tuple[object, int]] = [(data, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, Mapping):
            children: Iterable[object] = value.values()
        elif isinstance(value, list | tuple):
            children = value
        else:
            continue
        if id(value) in seen:
            continue
        seen.add(id(value))
        deepest = max(deepest, depth + 1)
        if deepest > MAX_NESTING:
            break
        stack.extend((child, depth + 1) for child in children)
    return deepest


def parse_yaml(text: str, where: str) -> Mapping[str, Any]:
    """The top-level mapping of YAML ``text`` (empty for an empty document); ``where`` names
    the text in errors."""
    too_deep = ConfigError(
        f"cannot read {where}: its values nest more than {MAX_NESTING} levels deep, which no "
        "kvplug or LMCache setting needs. Flatten the nested lists and mappings."
    )
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        problem = getattr(error, "problem", None) or str(error)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(
            f"cannot read {where}: invalid YAML{at}: {problem}. Fix the YAML there."
        ) from None
    except RecursionError:
        raise too_deep from None
    if _nesting_depth(data) > MAX_NESTING:
        raise too_deep
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{where} must hold a mapping of config keys at the top level (key: value lines), "
            f"but holds a {type(data).__name__}. Write it as e.g. 'chunk_size: 256'."
        )
    return data


def read_yaml_file(path: Path, named_by: str | None = None) -> Mapping[str, Any]:
    """The top-level mapping of the YAML file ``path``; ``named_by`` is the variable that
    named the file, for errors."""
    origin = f" (named by {named_by})" if named_by else ""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            f"config file {path}{origin} does not exist. Check the path, or leave it unset to "
            "use the defaults."
        ) from None
    except IsADirectoryError:
        raise ConfigError(
            f"config file {path}{origin} is a directory. Name the YAML file inside it."
        ) from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(
            f"cannot read config file {path}{origin}: {error}. Make it a readable UTF-8 file."
        ) from None
    return parse_yaml(text, f"config file {path}{origin}")


def looks_like_path(text: str) -> bool:
    """Whether ``text`` names a file rather than holding YAML: one line that ends in
    ``.yaml``/``.yml``/``.json`` or names an existing file."""
    if "\n" in text:
        return False
    stripped = text.strip()
    if stripped.lower().endswith((".yaml", ".yml", ".json")):
        return True
    try:
        return expand(stripped).is_file()
    except (OSError, ValueError):  # ValueError: a NUL character
        return False
