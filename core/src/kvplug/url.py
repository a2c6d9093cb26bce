"""Backend URLs: ``scheme://[user[:password]@]host[:port][,host[:port]...][/path][?k=v&...]``.

:class:`BackendURL` is immutable. Its password and the values of its secret-named query
parameters (``token``, ``api_key``, ... : :func:`kvplug.secrets.is_secret_name`) never appear
in ``str``, ``repr``, errors or logs (they show as ``***``); :meth:`BackendURL.secret_url`
gives the real string to the one place that needs it, the client library. Query parameters
become backend options; options given explicitly in code or config win over them.

Wrappers compose with ``::`` as in fsspec: ``audit::redis://cache-1:6379`` is the audit
wrapper around a Redis backend, and a wrapper takes its own options in its own query,
``audit://?fail_rate=0.01::cpu://``.

Example::

    >>> from kvplug.url import BackendURL
    >>> url = BackendURL.parse("redis+sentinel://app:s3cret@h1:26379,h2:26379/mymaster?db=2")
    >>> url.scheme, url.hosts, url.path, url.options
    ('redis+sentinel', (('h1', 26379), ('h2', 26379)), '/mymaster', {'db': '2'})
    >>> str(url)
    'redis+sentinel://app:***@h1:26379,h2:26379/mymaster?db=2'
    >>> str(BackendURL.parse("acme://h:1?api_key=abc&shard=2"))
    'acme://h:1?api_key=***&shard=2'
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, quote, unquote

from kvplug.errors import InvalidBackendURL
from kvplug.secrets import MASK, is_secret_name, mask_url, remember, url_secret_spans

MAX_URL_LENGTH = 8192
_SCHEME = re.compile(r"[a-z][a-z0-9+.-]*")
_HOSTNAME = re.compile(r"[A-Za-z0-9_.~%-]+")

mask_passwords = mask_url
"""The former name of :func:`kvplug.secrets.mask_url`."""


def _fail(text: str, problem: str, fix: str) -> InvalidBackendURL:
    return InvalidBackendURL(f"invalid backend URL {mask_url(text)!r}: {problem}. {fix}")


def _parse_host(text: str, raw: str) -> tuple[str, int | None]:
    if raw.startswith("["):
        end = raw.find("]")
        if end < 0:
            raise _fail(text, f"host {raw!r} opens '[' without ']'", "Write IPv6 as [::1]:port")
        host, rest = raw[1:end], raw[end + 1 :]
        if not host or not all(c in "0123456789abcdefABCDEF:." for c in host):
            raise _fail(text, f"{host!r} is not an IPv6 address", "Write IPv6 as [::1]:port")
        if rest and not rest.startswith(":"):
            raise _fail(text, f"unexpected {rest!r} after ']'", "Write IPv6 as [::1]:port")
        port_text = rest[1:] if rest else None
    else:
        host, sep, port_text_raw = raw.partition(":")
        port_text = port_text_raw if sep else None
        if not _HOSTNAME.fullmatch(host):
            raise _fail(text, f"host {host!r} is not a valid host name", "Use a name or an IP")
    if port_text is None:
        return host, None
    if not (port_text.isascii() and port_text.isdigit()) or not 0 < int(port_text) < 65536:
        raise _fail(text, f"port {port_text!r} is not a number from 1 to 65535", "Fix the port")
    return host, int(port_text)


@dataclass(frozen=True)
class BackendURL:
    """A parsed backend URL. Build it with :meth:`parse`."""

    scheme: str
    hosts: tuple[tuple[str, int | None], ...] = ()
    path: str = ""
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    query: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, text: str | BackendURL) -> BackendURL:
        """Parse ``text``; raises :class:`InvalidBackendURL` naming the problem and the fix."""
        if isinstance(text, BackendURL):
            return text
        if not isinstance(text, str):
            raise InvalidBackendURL(f"a backend URL must be a string, got {type(text).__name__}.")
        if len(text) > MAX_URL_LENGTH:
            shown = mask_url(text)[:64] + "..."
            raise InvalidBackendURL(
                f"invalid backend URL {shown!r}: it is {len(text)} characters long. Shorten it"
            )
        if any(ord(c) < 33 or ord(c) == 127 for c in text):
            raise _fail(
                text, "it contains whitespace or control characters", "Remove them or %-encode"
            )
        scheme, sep, rest = text.partition("://")
        if not sep:
            raise _fail(
                text,
                "it has no '://'",
                "Write it as scheme://..., e.g. cpu:// or redis://host:6379",
            )
        secrets, certain = url_secret_spans(text)
        if secrets and not certain:
            raise _fail(
                text,
                "where its password ends is ambiguous (an '@' after a '/', '?' or '#', or a "
                "'://' inside it)",
                "%-encode '/', '?', '#', ':' and '@' in the password (%2F %3F %23 %3A %40), and "
                "an '@' in a path or query as %40",
            )
        if not _SCHEME.fullmatch(scheme):
            raise _fail(
                text,
                f"scheme {scheme!r} is not lower-case letters, digits, '+', '-' or '.'",
                "Use a scheme such as cpu, file or redis+sentinel",
            )
        rest, hash_mark, _ = rest.partition("#")
        if hash_mark:
            raise _fail(text, "it has a '#fragment'", "Remove it")
        rest, _, query_text = rest.partition("?")
        slash = rest.find("/")
        netloc, path = (rest, "") if slash < 0 else (rest[:slash], rest[slash:])
        username = password = None
        if "@" in netloc:
            userinfo, _, netloc = netloc.rpartition("@")
            user, colon, secret = userinfo.partition(":")
            username = unquote(user) or None
            password = unquote(secret) if colon else None
        hosts = tuple(_parse_host(text, h) for h in netloc.split(",")) if netloc else ()
        try:
            pairs = parse_qsl(query_text, keep_blank_values=True, strict_parsing=bool(query_text))
        except ValueError:
            raise _fail(text, "its query is not k=v&k=v", "Fix the query string") from None
        seen: set[str] = set()
        for key, _value in pairs:
            if key in seen:
                raise _fail(text, f"option {key!r} is given twice", "Give each option once")
            seen.add(key)
        remember(password, *(value for key, value in pairs if is_secret_name(key)))
        return cls(scheme, hosts, unquote(path), username, password, tuple(pairs))

    @property
    def options(self) -> dict[str, str]:
        """Query parameters as a new dict."""
        return dict(self.query)

    @property
    def host(self) -> str | None:
        """The first host, or ``None``."""
        return self.hosts[0][0] if self.hosts else None

    @property
    def port(self) -> int | None:
        """The first host's port, or ``None``."""
        return self.hosts[0][1] if self.hosts else None

    @property
    def base_scheme(self) -> str:
        """``redis`` for ``redis+sentinel``."""
        return self.scheme.split("+", 1)[0]

    def _render(self, *, masked: bool) -> str:
        netloc = ",".join(
            (f"[{h}]" if ":" in h else h) + (f":{p}" if p is not None else "")
            for h, p in self.hosts
        )
        password = self.password
        if password is not None:
            password = MASK if masked else quote(password, safe="")
        if self.username is not None or password is not None:
            user = quote(self.username or "", safe="")
            netloc = f"{user}:{password}@{netloc}" if password is not None else f"{user}@{netloc}"
        query = "&".join(
            f"{quote(k, safe='')}=" + (MASK if masked and is_secret_name(k) else quote(v, safe=""))
            for k, v in self.query
        )
        return f"{self.scheme}://{netloc}{quote(self.path, safe='/,:')}" + (
            f"?{query}" if query else ""
        )

    def secret_url(self) -> str:
        """The URL with its real password and query values, for handing to a client library;
        never log it."""
        return self._render(masked=False)

    def __str__(self) -> str:
        return self._render(masked=True)

    def __repr__(self) -> str:
        return f"BackendURL({str(self)!r})"

    def with_options(self, **options: Any) -> BackendURL:
        """A copy whose query has ``options`` added or replaced (values are stringified)."""
        merged = dict(self.query)
        merged.update({k: str(v) for k, v in options.items()})
        return BackendURL(
            self.scheme, self.hosts, self.path, self.username, self.password, tuple(merged.items())
        )


def split_chain(text: str) -> list[str]:
    """Split ``wrapper::...::inner-url`` at the ``::`` outside IPv6 brackets, outermost first."""
    parts: list[str] = []
    depth = 0
    start = 0
    index = 0
    while index < len(text):
        char = text[index]
        if char == "[":
            depth += 1
        elif char == "]":
            depth = max(0, depth - 1)
        elif depth == 0 and text.startswith("::", index):
            parts.append(text[start:index])
            start = index + 2
            index += 2
            continue
        index += 1
    parts.append(text[start:])
    if any(not part for part in parts):
        raise InvalidBackendURL(
            f"invalid backend URL chain {mask_url(text)!r}: an empty part around '::'. "
            "Write wrapper::inner, e.g. audit::cpu://"
        )
    secrets, _ = url_secret_spans(text)
    if len(parts) > 1 and any(
        begin <= split < end for begin, end in secrets for split in _split_points(parts)
    ):
        raise InvalidBackendURL(
            f"invalid backend URL chain {mask_url(text)!r}: a password holds '::', which "
            "separates wrappers. %-encode it in the password as %3A%3A"
        )
    return parts


def _split_points(parts: list[str]) -> list[int]:
    """Where the ``::`` between ``parts`` stand in the text they were split from."""
    points = []
    position = 0
    for part in parts[:-1]:
        position += len(part)
        points.append(position)
        position += 2
    return points


__all__ = ["BackendURL", "mask_passwords", "mask_url", "split_chain"]
