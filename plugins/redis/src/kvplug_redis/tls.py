"""The ``ssl_*`` options of the TLS schemes, as the client library's connection arguments and
as an :class:`ssl.SSLContext` for direct reads, both checking the server the same way.

A PEM file that is missing or unreadable fails when the backend is created, naming the
option, rather than later as an unreachable server.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

from kvplug.url import BackendURL
from kvplug_redis.options import TLS_OPTIONS, RedisOptions
from kvplug_redis.urls import url_error


def tls_settings(options: RedisOptions, url: BackendURL) -> dict[str, Any]:
    """The ``ssl_*`` connection arguments of a TLS scheme, its PEM files checked now."""
    for name in TLS_OPTIONS:
        path = getattr(options, name)
        if path is not None and not Path(path).is_file():
            raise url_error(
                url, f"{name} {path!r} is not a readable file", "Give the path of a PEM file"
            )
    return {
        "ssl_ca_certs": options.ssl_ca_certs,
        "ssl_certfile": options.ssl_certfile,
        "ssl_keyfile": options.ssl_keyfile,
        "ssl_cert_reqs": options.ssl_cert_reqs,
        "ssl_check_hostname": options.ssl_check_hostname,
    }


def ssl_context(options: RedisOptions, url: BackendURL) -> ssl.SSLContext:
    """The ``ssl_*`` options as an :class:`ssl.SSLContext` for direct reads, checking the
    server as the client library's TLS connections do."""
    verify = {
        "required": ssl.CERT_REQUIRED,
        "optional": ssl.CERT_OPTIONAL,
        "none": ssl.CERT_NONE,
    }[options.ssl_cert_reqs]
    try:
        context = ssl.create_default_context(cafile=options.ssl_ca_certs)
        context.check_hostname = options.ssl_check_hostname and verify != ssl.CERT_NONE
        context.verify_mode = verify
        if options.ssl_certfile is not None:
            context.load_cert_chain(options.ssl_certfile, options.ssl_keyfile)
    except (ssl.SSLError, OSError) as error:
        raise url_error(
            url,
            f"the TLS files could not be loaded ({error})",
            "Give PEM files: ssl_ca_certs a CA bundle, ssl_certfile and ssl_keyfile the "
            "client certificate and its key",
        ) from None
    return context


__all__ = ["ssl_context", "tls_settings"]
