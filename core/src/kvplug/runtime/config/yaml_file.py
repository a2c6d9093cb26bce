"""Reading YAML config text and files safely: no Python objects, no key given twice in one
mapping, no alias expansion past :data:`MAX_ALIAS_USES` and :data:`MAX_EXPANDED_NODES`, no value
that contains itself, no values nested deeper than :data:`MAX_NESTING`; every failure a
ConfigError saying where.

Every YAML document kvplug reads goes through :func:`load_yaml`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from kvplug.errors import ConfigError
from kvplug.runtime.config.conversions import expand

MAX_NESTING = 32
"""How deep config values may nest; far beyond any real configuration."""

MAX_ALIAS_USES = 5_000
"""How many aliases (``*name``) one YAML document may use.

A real config uses a few, e.g. to share one options mapping between its tiers (``<<: *common``);
even one alias in every item of a thousand-item list stays below this. Past it, the document is
refused while it is read, before any value is built."""

MAX_EXPANDED_NODES = 100_000
"""How many nodes a YAML document may hold once every alias is expanded: each mapping, list, key
and scalar counts one, at each place where it stands or an alias repeats it.

An alias costs nothing to read (it refers to the value its anchor marks), but everything that
walks the config afterwards (masking secrets for output, comparing, printing, the engine's own
code) sees the value in full at every place an alias repeats it, and aliases of aliases
multiply: eleven lines, each a list of ten aliases of the line above, make 10**9 nodes (a
"billion laughs" document), which take minutes and tens of GiB to walk. Real configs hold tens
to a few thousand nodes; 100,000 takes well under a second to walk. The count is taken on the
document's node graph, each distinct node once, before any value is built."""

_KINDS: dict[type[yaml.Node], str] = {yaml.MappingNode: "mapping", yaml.SequenceNode: "list"}


class _BoundedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that rejects a key given twice in one mapping, counts the aliases a
    document uses (refusing one past :data:`MAX_ALIAS_USES`) and keeps each node's anchor name
    for messages. ``where`` names the text in errors."""

    def __init__(self, text: str, where: str) -> None:
        super().__init__(text)
        self.where = where
        self.alias_uses = 0
        self.anchors_by_node: dict[int, str] = {}

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        event: yaml.Event = self.peek_event()  # type: ignore[no-untyped-call]  # stubs lack it
        if isinstance(event, yaml.AliasEvent):
            self.alias_uses += 1
            if self.alias_uses > MAX_ALIAS_USES:
                raise ConfigError(
                    f"cannot read {self.where}: it uses YAML aliases more than "
                    f"{MAX_ALIAS_USES} times (alias {self.alias_uses} is *{event.anchor}"
                    f"{_at(event.start_mark)}). Each alias repeats the value its anchor "
                    "(&name) marks, and no kvplug or LMCache config repeats values this often. "
                    "Use fewer aliases: share larger values (a whole tier's options) or write "
                    "the values out."
                )
            return super().compose_node(parent, index)
        node = super().compose_node(parent, index)
        anchor = getattr(event, "anchor", None)
        if node is not None and anchor is not None:
            self.anchors_by_node[id(node)] = anchor
        return node

    def describe(self, node: yaml.Node) -> str:
        """``the list at line 3 (&name)``: a node, for messages."""
        kind = _KINDS.get(type(node), "value")
        anchor = self.anchors_by_node.get(id(node))
        return f"the {kind}{_at(node.start_mark)}" + (f" (&{anchor})" if anchor else "")


def _at(mark: Any) -> str:
    """`` at line L, column C`` of a YAML mark (PyYAML's or libyaml's), or nothing for None."""
    return f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""


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


_BoundedLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping
)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _check_expansion(root: yaml.Node, loader: _BoundedLoader) -> None:
    """Raise a ConfigError when ``root``, with its aliases expanded, holds more than
    :data:`MAX_EXPANDED_NODES` nodes or contains itself.

    Each distinct node is visited once (a post-order walk without recursion, remembering each
    node's expanded size), so the check costs what the text holds, not what it expands to."""
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if children_done:
            on_path.discard(id(node))
            size = 1 + sum(sizes[id(child)] for child in _children(node))
            sizes[id(node)] = size
            if size > MAX_EXPANDED_NODES:
                raise ConfigError(_expansion_message(loader, node, size))
            continue
        if id(node) in sizes:
            continue
        if id(node) in on_path:
            anchor = loader.anchors_by_node.get(id(node), "name")
            raise ConfigError(
                f"cannot read {loader.where}: {loader.describe(node)} contains an alias of "
                f"itself (*{anchor}), so it would repeat without end. Write the value out "
                "without referring to itself."
            )
        on_path.add(id(node))
        stack.append((node, True))
        stack.extend((child, False) for child in _children(node) if id(child) not in sizes)


def _expansion_message(loader: _BoundedLoader, node: yaml.Node, size: int) -> str:
    if loader.alias_uses == 0:
        return (
            f"cannot read {loader.where}: {loader.describe(node)} holds {size} nodes (keys, "
            f"values and items), more than kvplug reads from one config ({MAX_EXPANDED_NODES}) "
            "and far more than any kvplug or LMCache setting needs. Remove what kvplug does "
            "not read."
        )
    return (
        f"cannot read {loader.where}: its YAML aliases expand {loader.describe(node)} to "
        f"{size} nodes (keys, values and items), more than kvplug reads from one config "
        f"({MAX_EXPANDED_NODES}). The cause: a value marked with an anchor (&name) is repeated "
        "at each of its aliases (*name), and a repeated value that holds aliases repeats "
        "their values again, so the counts multiply (a 'billion laughs' document) and every "
        "reader of the config would walk them all, for minutes and gigabytes. Write the "
        "repeated values out, or repeat them fewer times: no kvplug or LMCache config needs "
        f"more than {MAX_EXPANDED_NODES} nodes."
    )


def nesting_depth(data: object) -> int:
    """How deep ``data``'s mappings and lists nest (a scalar: 0, ``[]``: 1), found without
    recursion, each container once: a container shared at several depths (through YAML aliases
    or in Python) counts at its deepest, and one inside itself counts as deeper than
    :data:`MAX_NESTING`."""
    heights: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[object, bool]] = [(data, False)]
    while stack:
        value, children_done = stack.pop()
        if isinstance(value, Mapping):
            children: Iterable[object] = value.values()
        elif isinstance(value, list | tuple):
            children = value
        else:
            heights[id(value)] = 0
            continue
        if children_done:
            on_path.discard(id(value))
            height = 1 + max((heights[id(child)] for child in children), default=0)
            if height > MAX_NESTING:
                return height
            heights[id(value)] = height
        elif id(value) in on_path:
            return MAX_NESTING + 1
        elif id(value) not in heights:
            on_path.add(id(value))
            stack.append((value, True))
            stack.extend((child, False) for child in children)
    return heights[id(data)]


def too_deep(where: str) -> ConfigError:
    """The error for values nested past :data:`MAX_NESTING` in ``where``."""
    return ConfigError(
        f"cannot read {where}: its values nest more than {MAX_NESTING} levels deep, which no "
        "kvplug or LMCache setting needs. Flatten the nested lists and mappings."
    )


def _load_checked(text: str, where: str) -> Any:
    """``yaml.load`` with :class:`_BoundedLoader`, and :func:`_check_expansion` between
    composing the document and building its values."""
    loader = _BoundedLoader(text, where)
    try:
        root = loader.get_single_node()
        if root is None:
            return None
        _check_expansion(root, loader)
        return loader.construct_document(root)
    finally:
        loader.dispose()


def load_yaml(text: str, where: str) -> Any:
    """The value of the YAML document ``text`` (None for an empty one), read safely: plain data
    only, no key twice in one mapping, at most :data:`MAX_ALIAS_USES` aliases and
    :data:`MAX_EXPANDED_NODES` nodes with them expanded (checked before any value is built), no
    value that contains itself, nesting at most :data:`MAX_NESTING` deep. ``where`` names the
    text in the :class:`~kvplug.errors.ConfigError` for anything else.

    Values an alias repeats are one shared object, never copies.

    Example::

        >>> load_yaml("{base: &b {timeout: 2}, tiers: [{<<: *b, url: 'cpu://'}]}", "the text")
        {'base': {'timeout': 2}, 'tiers': [{'timeout': 2, 'url': 'cpu://'}]}
        >>> laughs = "{a0: &a0 [lol, lol]"
        >>> for n in range(1, 7):
        ...     laughs += f", a{n}: &a{n} [" + ", ".join([f"*a{n - 1}"] * 10) + "]"
        >>> load_yaml(laughs + "}", "the text")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        kvplug.errors.ConfigError: cannot read the text: its YAML aliases expand the list ...
    """
    try:
        data = _load_checked(text, where)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        problem = getattr(error, "problem", None) or str(error)
        raise ConfigError(
            f"cannot read {where}: invalid YAML{_at(mark)}: {problem}. Fix the YAML there."
        ) from None
    except RecursionError:
        raise too_deep(where) from None
    if nesting_depth(data) > MAX_NESTING:
        raise too_deep(where)
    return data


def parse_yaml(text: str, where: str) -> Mapping[str, Any]:
    """The top-level mapping of YAML ``text`` (empty for an empty document), read by
    :func:`load_yaml`; ``where`` names the text in errors."""
    data = load_yaml(text, where)
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
