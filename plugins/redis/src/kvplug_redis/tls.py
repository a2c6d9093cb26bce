"""The ``ssl_*`` options of the TLS schemes (:class:`kvplug.tls.TLSOptions`), as the client
library's connection arguments and as an :class:`ssl.SSLContext` for direct reads, both checking
the server the same way (:func:`kvplug.tls.client_context`).

A PEM file that is missing or unreadable fails when the backend is created, naming the
option, rather than later as an unreachable server.
"""

from __future__ import annotations

import ssl
from typing import Any

from kvplug.tls import TLSFilesError, check_tls_files, client_context
from kvplug.url import BackendURL
from kvplug_redis.options import RedisOptions
from kvplug_redis.urls import url_error


def tls_settings(options: RedisOptions, url: BackendURL) -> dict[str, Any]:
    """The ``ssl_*`` connection arguments of a TLS scheme, its PEM files checked now."""
    try:
        check_tls_files(options)
    except TLSFilesError as error:
        raise _named(url, error) from None
    return {
        "ssl_ca_certs": options.ssl_ca_certs,
        "ssl_certfile": options.ssl_certfile,
        "ssl_keyfile": options.ssl_keyfile,
        "ssl_cert_reqs": options.ssl_cert_reqs,
        "ssl_check_hostname": options.ssl_check_hostname,
    }


def ssl_context(options: RedisOptions, url: BackendURL) -> ssl.SSLContext:
    """The ``ssl_*`` options as an :class:`ssl.SSLContext` for direct reads."""
    try:
        return client_context(options)
    except TLSFilesError as error:
        raise _named(url, error) from None


def _named(url: BackendURL, error: TLSFilesError) -> Exception:
    return url_error(url, error.fact, error.fix.rstrip("."))


__all__ = ["ssl_context", "tls_settings"]
