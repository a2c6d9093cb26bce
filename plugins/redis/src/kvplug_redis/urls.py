"""The URL forms of the Redis tier, read into where to connect.

::

    redis://[user[:password]@]host[:port][/db]           one server (port 6379 by default)
    rediss://host:6380?ssl_ca_certs=/etc/ca.pem          the same over TLS
    unix:///run/redis/redis.sock?db=1                    a unix socket
    redis+sentinel://[user[:password]@]h1:26379,h2:26379/mymaster
                                                         a Sentinel-managed master
                                                         (LMCache's redis-sentinel:// too)
    rediss+sentinel://h1:26379,h2:26379/mymaster?ssl_ca_certs=/etc/ca.pem
                                                         the same, TLS to the sentinels and
                                                         to the servers they name
    redis+cluster://[user[:password]@]h1:7000,h2:7001    a Redis Cluster

The scheme picks a :class:`Mode`; :class:`UrlForms` (one per backend class, so kvplug-valkey's
``valkey://`` forms are read the same way and named in its messages) checks the URL and its
options against the mode and reads the URL into a :class:`Target`.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass

from kvplug.errors import InvalidBackendURL
from kvplug.tls import TLS_FILE_OPTIONS
from kvplug.url import BackendURL
from kvplug_redis.options import SECRET_OPTIONS, SENTINEL_OPTIONS, RedisOptions


class Mode(enum.Enum):
    """How the backend reaches Redis, chosen by the URL's scheme."""

    STANDALONE = "standalone"
    TLS = "tls"
    UNIX = "unix"
    SENTINEL = "sentinel"
    CLUSTER = "cluster"


@dataclass(frozen=True)
class Target:
    """Where the URL points: validated hosts, socket path, database and Sentinel service."""

    hosts: tuple[tuple[str, int], ...] = ()
    socket_path: str | None = None
    db: int = 0
    service: str | None = None


def escape_glob(text: str) -> str:
    """``text`` as a literal in a Redis glob pattern (``SCAN MATCH``)."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def url_error(url: BackendURL, problem: str, fix: str) -> InvalidBackendURL:
    """The error for a URL (shown masked) that cannot be used: ``problem``, then ``fix``."""
    return InvalidBackendURL(f"{url}: {problem}. {fix}")


@dataclass(frozen=True)
class UrlForms:
    """The URL forms one backend class serves: which scheme connects how, which of them use
    TLS, the prefix of its environment variables and its defaults."""

    schemes: Mapping[str, Mode]
    """Scheme -> how to connect. Where two schemes share a mode, hints name the first (plain)
    or the first TLS one."""
    tls_schemes: frozenset[str]
    """The schemes whose connections use TLS."""
    env_prefix: str
    """``REDIS``: ``REDIS_SERVICE_NAME`` names the default Sentinel service, and hints name
    ``$REDIS_PASSWORD``."""
    default_port: int
    default_sentinel_port: int
    default_service_name: str

    def tls_mismatch(self) -> str | None:
        """Why :attr:`tls_schemes` does not fit :attr:`schemes`, or None if it does: it must
        hold every ``Mode.TLS`` scheme (one left out would connect in the clear) and no scheme
        of another class."""
        tls_mode = {scheme for scheme, mode in self.schemes.items() if mode is Mode.TLS}
        if tls_mode <= self.tls_schemes <= set(self.schemes):
            return None
        return (
            f"tls_schemes must hold every Mode.TLS scheme of its schemes "
            f"({', '.join(sorted(tls_mode))}) and no other class's schemes; it holds "
            f"{', '.join(sorted(self.tls_schemes))}."
        )

    def scheme_of(self, mode: Mode, *, tls: bool = False) -> str:
        """The scheme for ``mode`` as hints spell it (``redis+sentinel://``), its TLS form with
        ``tls`` (``rediss+sentinel://``) where the mode has one."""
        named = [scheme for scheme, m in self.schemes.items() if m is mode]
        fitting = (scheme for scheme in named if (scheme in self.tls_schemes) == tls)
        return next(fitting, named[0]) + "://"

    def refuse_secrets_in_query(self, url: BackendURL) -> None:
        """Raise :class:`~kvplug.errors.InvalidBackendURL` if ``url``'s query holds a password."""
        leaked = [name for name in SECRET_OPTIONS if name in url.options]
        if leaked:
            # The URL is not shown: its query, which holds the secret, is not masked.
            raise InvalidBackendURL(
                f"a {url.scheme}:// URL has {leaked[0]!r} in its query, where URLs are logged "
                f"unmasked. Put the password in the user-info part "
                f"({url.scheme}://user:password@host), in ${self.env_prefix}_PASSWORD, or in "
                "the option given in code or config."
            )

    def check_options_fit(self, url: BackendURL, mode: Mode, options: RedisOptions) -> None:
        """Raise :class:`~kvplug.errors.InvalidBackendURL` for an option given that ``url``'s
        form would ignore: TLS files without TLS, Sentinel options without Sentinel, replica
        reads where there are no replicas to find."""
        given = options.model_fields_set
        scheme = url.scheme
        tls = scheme in self.tls_schemes
        sentinel_scheme = self.scheme_of(Mode.SENTINEL, tls=tls)
        if not tls:
            tls_given = [name for name in TLS_FILE_OPTIONS if name in given]
            if tls_given:
                raise url_error(
                    url,
                    f"option {tls_given[0]!r} applies to TLS, which {scheme}:// does not use",
                    self._tls_hint(mode),
                )
        if mode is not Mode.SENTINEL:
            sentinel = [name for name in SENTINEL_OPTIONS if name in given]
            if sentinel:
                raise url_error(
                    url,
                    f"option {sentinel[0]!r} applies to Sentinel only",
                    f"Use {sentinel_scheme}h1:26379,h2:26379/service, or drop the option",
                )
        if options.read_from_replicas and mode not in (Mode.SENTINEL, Mode.CLUSTER):
            raise url_error(
                url,
                f"read_from_replicas needs replicas that {scheme}:// cannot find",
                f"Use {sentinel_scheme} or {self.scheme_of(Mode.CLUSTER)}, or drop the option",
            )

    def _tls_hint(self, mode: Mode) -> str:
        """The scheme to write for TLS instead of a plain one of ``mode``."""
        tls_sentinel = self.scheme_of(Mode.SENTINEL, tls=True) + "h1:26379,h2:26379/service"
        tls_server = self.scheme_of(Mode.TLS, tls=True) + "host:port"
        if mode is Mode.SENTINEL:
            return f"Use {tls_sentinel} for TLS to the sentinels and servers, or drop the option"
        if mode is Mode.CLUSTER:
            return (
                f"TLS to a Cluster is not offered; use {tls_server} or {tls_sentinel}, or drop "
                "the option"
            )
        return f"Use {tls_server} for TLS, or drop the option"

    def target(self, url: BackendURL, mode: Mode, options: RedisOptions) -> Target:
        """Where ``url`` (of ``mode``) points, the ``db`` option winning over its path; raises
        :class:`~kvplug.errors.InvalidBackendURL` naming the form to write where it is not one
        of the forms above."""
        scheme = url.scheme
        if mode is Mode.UNIX:
            if url.hosts or not url.path.startswith("/") or url.path.endswith("/"):
                raise url_error(
                    url,
                    "a unix:// URL names a socket file by its absolute path and has no host",
                    "Write three slashes: unix:///run/redis/redis.sock",
                )
            return Target(socket_path=url.path, db=options.db or 0)
        if not url.hosts:
            example = {
                Mode.SENTINEL: f"{scheme}://h1:26379,h2:26379/mymaster",
                Mode.CLUSTER: f"{scheme}://h1:7000,h2:7001",
            }.get(mode, f"{scheme}://host:{self.default_port}")
            raise url_error(url, "it names no host", f"Write it as {example}")
        if mode is Mode.SENTINEL:
            port = self.default_sentinel_port
            service = url.path.strip("/") or (
                os.environ.get(f"{self.env_prefix}_SERVICE_NAME") or self.default_service_name
            )
            if "/" in service:
                raise url_error(
                    url,
                    f"the path {url.path!r} is not one Sentinel service name",
                    f"Write it as {scheme}://h1:26379,h2:26379/mymaster",
                )
            hosts = tuple((host, p or port) for host, p in url.hosts)
            return Target(hosts=hosts, db=options.db or 0, service=service)
        hosts = tuple((host, p or self.default_port) for host, p in url.hosts)
        if mode is Mode.CLUSTER:
            if url.path.strip("/") or options.db:
                raise url_error(
                    url,
                    "Redis Cluster has only database 0",
                    f"Drop the path and the db option: {scheme}://h1:7000,h2:7001",
                )
            return Target(hosts=hosts)
        if len(hosts) > 1:
            tls = scheme in self.tls_schemes
            raise url_error(
                url,
                f"{scheme}:// takes one host, it names {len(hosts)}",
                f"Use {self.scheme_of(Mode.SENTINEL, tls=tls)}h1,h2/service or "
                f"{self.scheme_of(Mode.CLUSTER)}h1,h2 for several servers",
            )
        db_text = url.path.strip("/")
        if db_text and not (db_text.isascii() and db_text.isdigit()):
            raise url_error(
                url,
                f"the path {url.path!r} is not a database number",
                f"Write the database as a number: {scheme}://host:{self.default_port}/0",
            )
        db = options.db if options.db is not None else int(db_text or 0)
        return Target(hosts=hosts, db=db)


__all__ = ["Mode", "Target", "UrlForms", "escape_glob", "url_error"]
