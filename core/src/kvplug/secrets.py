"""Secrets: the one rule that decides what kvplug never prints, and the functions that apply it.

A secret is

* the password in a URL's user info (``redis://app:s3cret@host``), also in a URL that does not
  parse, where the password is taken to run from the first ``:`` after the user name to the
  last ``@``, whatever it contains;
* the value of every URL query parameter, backend option, config entry or mapping key whose
  *name* looks secret (:func:`is_secret_name`: ``password``, ``sentinel_password``, ``token``,
  ``secret``, ``api_key``, ``access_key``, ``auth``, ``credential``, ...), whatever the
  value's type.

Every message, ``repr``, log record, metric label and CLI output of kvplug shows a secret as
:data:`MASK`. Build messages from masked parts (``str(BackendURL)``, :func:`mask_url`,
:func:`mask_data`, :func:`mask_repr`); :class:`SecretFilter`, installed on every ``kvplug``
logger, masks log records once more as a second line of defence, and also hides any secret
value kvplug has seen (:func:`remember`) wherever it turns up in free text.

Example::

    >>> from kvplug.secrets import is_secret_name, mask_data, mask_url
    >>> mask_url("redis://app:pa/ss@cache-1:6379?db=2&token=abc")
    'redis://app:***@cache-1:6379?db=2&token=***'
    >>> mask_data({"url": "redis://h:6379", "sentinel_password": 829371645, "db": 2})
    {'url': 'redis://h:6379', 'sentinel_password': '***', 'db': 2}
    >>> is_secret_name("apiKey"), is_secret_name("key_prefix"), is_secret_name("max_tokens")
    (True, False, False)
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any
from urllib.parse import quote, unquote

MASK = "***"
"""What a secret is shown as."""

MIN_REMEMBERED_LENGTH = 6
"""Shorter secrets are masked where their name or place says they are secret, but not searched
for in free text, where they would hide ordinary words."""

MAX_REMEMBERED = 1024

_CONTAINERS = (Mapping, list, tuple, set, frozenset)

_WORD_BOUNDARY = re.compile(r"[^A-Za-z0-9]+|(?<=[a-z0-9])(?=[A-Z])")
_SECRET_WORDS = frozenset(
    {"pass", "pw", "pwd", "auth", "authorization", "cookie", "sig", "signature"}
)
_SECRET_PARTS = ("password", "passwd", "passphrase", "secret", "credential", "apikey")
_SCHEME_SEPARATOR = "://"
_CHAIN_PART = re.compile(r"[a-z][a-z0-9+.-]*(?:://|::|$)")
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://\S*")
_ASSIGNMENT = re.compile(r"(?<![\w.-])([A-Za-z_][\w.-]*)=('[^']*'|\"[^\"]*\"|[^\s&]+)")
_QUOTED_ITEM = re.compile(
    r"""(['"])([^'"\s]{1,100})\1(\s*:\s*)('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|[^\s,}\]]+)"""
)

Span = tuple[int, int]


def is_secret_name(name: object) -> bool:
    """Whether an option, query parameter or mapping key named ``name`` holds a secret.

    The name is split into words (``_``, ``-``, ``.``, camelCase). It is secret when a word
    contains password, passwd, passphrase, secret, credential or apikey; when a word is or
    ends in ``token`` (not ``tokens``); when a word is pass, pw, pwd, auth, authorization,
    cookie, sig or signature; or when its last word is or ends in ``key`` (``api_key``,
    ``accessKey``; not ``key_prefix``).
    """
    if not isinstance(name, str):
        return False
    words = [word.lower() for word in _WORD_BOUNDARY.split(unquote(name)) if word]
    if not words:
        return False
    for word in words:
        if word in _SECRET_WORDS or word.endswith("token"):
            return True
        if any(part in word for part in _SECRET_PARTS):
            return True
    return words[-1].endswith("key")


# -- remembered secrets -------------------------------------------------------------------

_remembered: dict[str, None] = {}
_longest_first: list[str] = []
_remembered_lock = threading.Lock()


def _secret_texts(value: object) -> Iterator[str]:
    """The strings a secret value may be printed as: itself, or each item it holds (each
    container once, however often it is shared or inside itself)."""
    walked: dict[int, object] = {}  # keeps each walked container alive, so its id stays its own
    stack = [value]
    while stack:
        item = stack.pop()
        if item is None or isinstance(item, bool):
            continue
        if isinstance(item, _CONTAINERS):
            if id(item) not in walked:
                walked[id(item)] = item
                items = item.values() if isinstance(item, Mapping) else item
                stack.extend(reversed(list(items)))
            continue
        reveal = getattr(item, "get_secret_value", None)
        if callable(reveal):
            item = reveal()
        yield item if isinstance(item, str) else str(item)


def remember(*values: object) -> None:
    """Learn secret values (as given and %-encoded; the items of a list or mapping), so that
    :func:`mask_text` and the log filter hide them wherever they turn up. Values shorter than
    :data:`MIN_REMEMBERED_LENGTH` are ignored; the oldest are forgotten past
    :data:`MAX_REMEMBERED`."""
    global _longest_first
    forms = [
        form
        for value in values
        for text in _secret_texts(value)
        for form in dict.fromkeys((text, quote(text, safe="")))
        if len(form) >= MIN_REMEMBERED_LENGTH
    ]
    if not forms:
        return
    with _remembered_lock:
        for form in forms:
            _remembered.pop(form, None)
            _remembered[form] = None
        while len(_remembered) > MAX_REMEMBERED:
            del _remembered[next(iter(_remembered))]
        _longest_first = sorted(_remembered, key=len, reverse=True)


@contextmanager
def remembered_only_inside() -> Iterator[None]:
    """Forget, on leaving the block, every secret :func:`remember` learned inside it.

    kvplug remembers secrets for the life of the process, which is right for a service but
    not between tests: a test that remembers a random password (a property test may draw a
    word such as ``kvplug-disk``) would otherwise mask that word in every later test's text.
    kvplug's own test run wraps each test in this block.

    Example::

        >>> with remembered_only_inside():
        ...     remember("hunter2-for-a-moment")
        ...     mask_text("login hunter2-for-a-moment")
        'login ***'
        >>> mask_text("login hunter2-for-a-moment")
        'login hunter2-for-a-moment'
    """
    global _remembered, _longest_first
    with _remembered_lock:
        before = dict(_remembered), _longest_first
    try:
        yield
    finally:
        with _remembered_lock:
            _remembered, _longest_first = before


def _hide_remembered(text: str) -> str:
    for secret in _longest_first:
        if secret in text:
            text = text.replace(secret, MASK)
    return text


# -- URLs ---------------------------------------------------------------------------------


def _netloc_end(text: str, start: int) -> int:
    ends = [i for i in (text.find(c, start) for c in "/?#") if i >= 0]
    return min(ends, default=len(text))


def _separators(text: str) -> tuple[list[int], bool]:
    """Positions of every ``://`` in ``text``, and whether each one ends a scheme that starts
    the text or follows a ``::`` (one that does not is inside a password or a path)."""
    positions = [m.start() for m in re.finditer(re.escape(_SCHEME_SEPARATOR), text)]
    for position in positions:
        scheme = re.search(r"[A-Za-z][A-Za-z0-9+.-]*$", text[:position])
        start = scheme.start() if scheme else position
        if not (start == 0 or text.endswith("::", 0, start)):
            return positions, False
    return positions, True


def _password_spans(text: str) -> tuple[list[Span], bool]:
    """Where passwords are in ``text`` (one URL or a ``::`` chain, parseable or not), and
    whether that is certain. It is not when an ``@`` stands outside every host part or a
    ``://`` stands where no scheme can: then a password may hold ``/``, ``?``, ``#``, ``::``
    or ``://`` and is taken to run from the ``:`` after the user name to the last ``@``."""
    last_at = text.rfind("@")
    if last_at < 0:
        return [], True
    separators, placed = _separators(text)
    netlocs = [(p + 3, _netloc_end(text, p + 3)) for p in separators]
    certain = placed and all(
        any(start <= at < end for start, end in netlocs)
        for at in (i for i, c in enumerate(text) if c == "@")
    )
    if certain:
        spans = []
        for start, end in netlocs:
            at = text.rfind("@", start, end)
            colon = text.find(":", start, at) if at >= 0 else -1
            if colon >= 0:
                spans.append((colon + 1, at))
        return spans, True
    before = [p + 3 for p in separators if p + 3 <= last_at]
    for start in before:
        colon = text.find(":", start, last_at)
        if colon >= 0 and not any(c in text[start:colon] for c in "/?#"):
            return [(colon + 1, last_at)], False
    if before and text.find(":", before[-1], last_at) < 0:
        return [], False  # an '@' in a path, and no ':' that could start a password
    colon = text.find(":", before[0] if before else 0, last_at)
    return ([(colon + 1, last_at)] if colon >= 0 else []), False


def _value_end(text: str, start: int) -> int:
    """Where a query value starting at ``start`` ends: at the ``&`` that starts the next
    ``name=value`` pair, or at a ``::`` before the next part of a chain (a piece without
    ``=`` after an ``&`` is taken to be part of the value)."""
    index = start
    while index < len(text):
        if text[index] == "&":
            name = re.match(r"[^&=]*", text[index + 1 :])
            after = index + 1 + (name.end() if name else 0)
            if after < len(text) and text[after] == "=":
                return index
        if text.startswith("::", index) and _CHAIN_PART.match(text, index + 2):
            return index
        index += 1
    return index


def _query_spans(text: str, passwords: list[Span]) -> list[Span]:
    spans = []
    for match in re.finditer(r"[?&]([^=&?#/:@\s]*)=", text):
        if any(start <= match.start() < end for start, end in passwords):
            continue
        if is_secret_name(match.group(1)):
            spans.append((match.end(), _value_end(text, match.end())))
    return spans


def _apply(text: str, spans: Iterable[Span]) -> str:
    """``text`` with each span (merged where they overlap) replaced by the mask."""
    merged: list[list[int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    pieces = []
    last = 0
    for start, end in merged:
        pieces += [text[last:start], MASK]
        last = end
    pieces.append(text[last:])
    return "".join(pieces)


def url_secret_spans(text: str) -> tuple[list[Span], bool]:
    """The ``(start, end)`` spans of the secrets in ``text``, one URL or a ``::`` chain of
    them (parseable or not), and whether the password's extent is certain (see
    :func:`mask_url`). The secrets found are remembered (:func:`remember`)."""
    passwords, certain = _password_spans(text)
    spans = passwords + _query_spans(text, passwords)
    remember(*(text[start:end] for start, end in spans))
    return spans, certain


def mask_url(text: str) -> str:
    """``text``, one URL or a ``::`` chain of them, with its passwords and secret-named query
    values shown as ``***``.

    It needs no valid URL: where an ``@`` stands after a ``/``, ``?`` or ``#``, or a ``://``
    where no scheme can end (a password that holds one of them), everything from the ``:``
    after the user name to the last ``@`` is masked, which may hide more than the password
    but never less.
    """
    spans, _ = url_secret_spans(text)
    return _apply(text, spans)


# -- data and free text -------------------------------------------------------------------


def _masked_string(text: str) -> str:
    return _hide_remembered(mask_url(text) if _SCHEME_SEPARATOR in text else text)


def mask_data(value: Any, name: object = None) -> Any:
    """A copy of ``value`` (mappings, lists, tuples and sets walked; the copies are dicts and
    lists) safe to print: the value of every secret-named key is ``***`` (``None`` stays
    ``None``), URLs in strings are masked (:func:`mask_url`) and remembered secrets are hidden.
    ``name``: the key ``value`` is stored under, if any.

    Each container is walked once, however often it is shared: its copy is shared the same way
    (a container inside itself gives a copy inside itself), so data that shares parts many
    times (YAML aliases, or lists built as ``[part] * 10``) costs what it holds, not what it
    would print as.

    Example::

        >>> part = {"token": "abc", "n": 1}
        >>> masked = mask_data({"a": [part, part], "b": part})
        >>> masked["b"], masked["a"][0] is masked["b"]
        ({'token': '***', 'n': 1}, True)
    """
    copies: dict[int, tuple[Any, Any]] = {}  # id of a container: (the container, its copy)
    to_fill: list[tuple[Any, Any]] = []

    def masked(item: Any, key: object) -> Any:
        if is_secret_name(key) and item is not None:
            remember(item)
            return MASK
        if isinstance(item, _CONTAINERS):
            known = copies.get(id(item))
            if known is None:
                known = copies[id(item)] = (item, {} if isinstance(item, Mapping) else [])
                to_fill.append(known)
            return known[1]
        if isinstance(item, str):
            return _masked_string(item)
        if callable(getattr(item, "get_secret_value", None)):
            return MASK
        return item

    result = masked(value, name)
    while to_fill:
        original, copy = to_fill.pop()
        if isinstance(copy, dict):
            for key, item in original.items():
                copy[key] = masked(item, key)
        else:
            copy.extend(masked(item, None) for item in original)
    return result


def remember_in(value: Any) -> None:
    """Remember (:func:`remember`) the secrets inside ``value``, as :func:`mask_data` finds
    them, so that logs hide them even where they turn up without their name."""
    mask_data(value)


MAX_REPR_LENGTH = 100_000
"""The longest text :func:`mask_repr` returns; a longer one is cut and ends in ``...``. Data
that shares parts many times prints each part in full at every place it stands, so its
``repr`` can be far longer than the data; no message needs more than this."""


def _repr_pieces(value: Any) -> Iterator[str]:
    """``repr(value)`` piece by piece, for dicts and lists as :func:`mask_data` makes them, so
    that a caller can stop reading. A dict or list inside itself is shown as ``{...}`` or
    ``[...]``, as ``repr`` shows it."""
    showing: set[int] = set()
    todo: list[tuple[str, Any]] = [("value", value)]  # ("text" | "value" | "end", item)
    while todo:
        kind, item = todo.pop()
        if kind == "text":
            yield item
        elif kind == "end":
            showing.discard(id(item))
            yield "}" if type(item) is dict else "]"
        elif type(item) not in (dict, list) or not item:
            yield repr(item)
        elif id(item) in showing:
            yield "{...}" if type(item) is dict else "[...]"
        else:
            showing.add(id(item))
            todo.append(("end", item))
            if type(item) is dict:
                yield "{"
                for index, (key, child) in reversed(list(enumerate(item.items()))):
                    todo += [("value", child), ("text", (", " if index else "") + f"{key!r}: ")]
            else:
                yield "["
                for index, child in reversed(list(enumerate(item))):
                    todo += [("value", child), ("text", ", ")] if index else [("value", child)]


def mask_repr(value: Any, limit: int | None = None) -> str:
    """``repr`` of :func:`mask_data` of ``value``, cut to ``limit`` characters (at most
    :data:`MAX_REPR_LENGTH`); only as much of it is made as is shown."""
    cap = MAX_REPR_LENGTH if limit is None else min(limit, MAX_REPR_LENGTH)
    pieces: list[str] = []
    length = 0
    cut = False
    for piece in _repr_pieces(mask_data(value)):
        if length > cap:
            cut = True
            break
        pieces.append(piece)
        length += len(piece)
    text = mask_text("".join(pieces))
    return text if not cut and len(text) <= cap else text[: cap - 3] + "..."


def _secret_in_text(name: str) -> bool:
    # In free text a bare "key=" is kvplug's cache key (audit lines), not a secret.
    return name.lower() not in {"key", "keys"} and is_secret_name(name)


def mask_text(text: str) -> str:
    """Free text (a message, a traceback, a report) with every secret kvplug can recognise
    masked: remembered secret values, passwords of URLs in it (a URL runs to the next
    whitespace), and values of secret-named ``name=value`` and ``'name': value`` items (but
    a bare ``key=``, which names a cache key in kvplug's log lines)."""
    text = _hide_remembered(text)
    text = _URL_IN_TEXT.sub(lambda m: mask_url(m.group(0)), text)

    def assignment(match: re.Match[str]) -> str:
        if not _secret_in_text(match.group(1)) or match.group(2).startswith(MASK):
            return match.group(0)
        remember(match.group(2).strip("'\""))
        return f"{match.group(1)}={MASK}"

    def item(match: re.Match[str]) -> str:
        quote_mark, name, colon, value = match.groups()
        if not _secret_in_text(name) or value.strip("'\"").startswith(MASK):
            return match.group(0)
        remember(value.strip("'\""))
        return f"{quote_mark}{name}{quote_mark}{colon}'{MASK}'"

    return _QUOTED_ITEM.sub(item, _ASSIGNMENT.sub(assignment, text))


# -- logging ------------------------------------------------------------------------------


class SecretFilter(logging.Filter):
    """Masks secrets in a log record's message, traceback and stack (:func:`mask_text`).

    Installed on the ``kvplug`` logger and every ``kvplug.*`` logger by
    :func:`install_log_filter`; it never drops a record.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a bad format string: logging reports it as usual
            return True
        masked = mask_text(message)
        if masked != message:
            record.msg, record.args = masked, None
        if record.exc_info and not record.exc_text:
            record.exc_text = mask_text(logging.Formatter().formatException(record.exc_info))
        if record.stack_info:
            record.stack_info = mask_text(record.stack_info)
        return True


SECRET_FILTER = SecretFilter()


def install_log_filter() -> None:
    """Put :data:`SECRET_FILTER` on the ``kvplug`` logger and every ``kvplug.*`` and
    ``kvplug_*`` logger that exists now (a logger's filters do not apply to its children, so
    each needs its own). kvplug calls it on import and whenever a backend is constructed."""
    names = [
        name
        for name in list(logging.root.manager.loggerDict)
        if name.startswith(("kvplug.", "kvplug_"))
    ]
    for name in ("kvplug", *names):
        logger = logging.getLogger(name)
        if SECRET_FILTER not in logger.filters:
            logger.addFilter(SECRET_FILTER)


__all__ = [
    "MASK",
    "MAX_REPR_LENGTH",
    "SECRET_FILTER",
    "SecretFilter",
    "install_log_filter",
    "is_secret_name",
    "mask_data",
    "mask_repr",
    "mask_text",
    "mask_url",
    "remember",
    "remember_in",
    "remembered_only_inside",
    "url_secret_spans",
]
