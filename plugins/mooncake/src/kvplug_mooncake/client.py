"""Mooncake's Python client before the first object moves: the installed wheel and the calls
it must have, a check that the master answers before Mooncake's ``setup`` meets it, and the
``setup`` itself.

Mooncake's ``setup`` holds the GIL while it waits for the master (the whole process stalls)
and waits 60 to 90 s for one that does not answer; :func:`check_master_answers` finds a
master that is down, paused or silent within ``connect_timeout`` first.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import os
import socket
import struct
from typing import Any
from urllib.parse import urlsplit

from kvplug.errors import BackendUnavailable, ConfigError
from kvplug_mooncake import codes

DISTRIBUTIONS = ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine")
REQUIRED_CALLS = (
    "setup",
    "register_buffer",
    "unregister_buffer",
    "batch_is_exist",
    "batch_put_from_multi_buffers",
    "batch_upsert_from",
    "batch_get_into",
    "batch_get_into_multi_buffers",
    "batch_get_replica_desc",
    "batch_remove",
    "remove",
    "close",
)
"""The calls of ``MooncakeDistributedStore`` this backend uses (0.3.10 and later have them)."""

UNSERVED_REQUEST = struct.pack("<BBBBIIII", 0xDE, 1, 0, 0, 0, 0, 0, 0)
"""A coro_rpc request header (Mooncake's RPC framework: magic 0xde, version 1) for function
id 0, which no master serves: it answers by closing the connection."""

RPC_TIMEOUT_VARIABLE = "MC_RPC_TIMEOUT_MS"


def installed_version() -> str:
    """The installed Mooncake wheel and its version, such as
    ``mooncake-transfer-engine-non-cuda 0.3.13.post1``."""
    for name in DISTRIBUTIONS:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return f"{name} {importlib.metadata.version(name)}"
    return "mooncake (version unknown)"


def load_store_class() -> type[Any]:
    """``mooncake.store.MooncakeDistributedStore``, once it is known to have every call this
    backend uses; else :class:`~kvplug.errors.BackendUnavailable` naming the version."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as error:
        hint = (
            " Debian's libibverbs1 must be installed (apt-get install libibverbs1)."
            if "libibverbs" in str(error)
            else ""
        )
        raise BackendUnavailable(
            f"mooncakestore:// needs Mooncake's Python client, which does not import here "
            f"({error}).{hint} Install it: pip install 'kvplug-mooncake[client]' (the "
            "mooncake-transfer-engine-non-cuda wheel; mooncake-transfer-engine on CUDA hosts)."
        ) from None
    missing = [name for name in REQUIRED_CALLS if not hasattr(MooncakeDistributedStore, name)]
    doc = getattr(MooncakeDistributedStore.remove, "__doc__", "") or ""
    if "force" not in doc:
        missing.append("remove(key, force=...)")
    if missing:
        raise BackendUnavailable(
            f"the installed {installed_version()} lacks {', '.join(missing)}, which "
            "mooncakestore:// moves objects with (zero-copy batch calls, forced removal). "
            "Install mooncake-transfer-engine-non-cuda>=0.3.13."
        )
    store_class: type[Any] = MooncakeDistributedStore
    return store_class


def check_master_answers(master: str, limit: float) -> str:
    """Check that the master at ``master`` (host:port) answers within ``limit`` seconds, and
    return the local address of the connection (this client's default hostname).

    It connects and sends a request no master serves (:data:`UNSERVED_REQUEST`), which a
    live master answers by closing the connection; a paused master, or a port that accepts
    and stays silent, answers nothing."""
    host, _, port_text = master.rpartition(":")
    host = host.strip("[]")
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError(
            f"the Mooncake master address {master!r} has no port: write host:port."
        ) from None
    try:
        with socket.create_connection((host, port), timeout=limit) as connection:
            local: str = connection.getsockname()[0]
            connection.sendall(UNSERVED_REQUEST)
            connection.recv(1)
    except TimeoutError:
        raise BackendUnavailable(
            f"the Mooncake master at {master} accepts connections but did not answer "
            f"within {limit} s (connect_timeout): it is paused or overloaded, or this port "
            "is not a mooncake_master's --rpc_port."
        ) from None
    except OSError as error:
        raise BackendUnavailable(
            f"no Mooncake master answers at {master} ({error.strerror or error}). "
            "Start mooncake_master there (--rpc_port) or fix the URL."
        ) from None
    return local


def check_metadata_server(url: str, limit: float) -> None:
    """Check that the HTTP metadata server at ``url`` accepts connections within ``limit``."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", port), timeout=limit):
            pass
    except OSError as error:
        raise BackendUnavailable(
            f"no Mooncake metadata server answers at {url} ({error.strerror or error}). "
            "Start the master with --enable_http_metadata_server, or use "
            "metadata_server=P2PHANDSHAKE."
        ) from None


async def set_up_client(store_class: type[Any], settings: dict[str, Any], rpc_wait: float) -> Any:
    """A client set up by Mooncake's ``setup`` with ``settings``, its master calls bounded
    to ``rpc_wait`` seconds. ``setup`` holds the GIL while it runs, so no deadline of this
    process can interrupt it: :func:`check_master_answers` has checked that the master
    answers, and it takes tens of milliseconds then."""
    bound_rpc_waits(rpc_wait)
    store = store_class()
    code = await asyncio.to_thread(store.setup, settings)
    if code != 0:
        with contextlib.suppress(Exception):
            await asyncio.to_thread(store.close)
        raise BackendUnavailable(
            f"Mooncake's setup against the master at {settings['master_server_addr']} returned "
            f"{codes.describe(code)} (local_hostname {settings['local_hostname']}, metadata "
            f"{settings['metadata_server']}, protocol {settings['protocol']}). Its log on "
            "stderr names the cause; check that the master runs with this metadata setting."
        )
    return store


_rpc_timeout_set_here = False


def bound_rpc_waits(seconds: float) -> None:
    """Make the Mooncake clients set up from now on give up on an unanswered master call
    after ``seconds`` (``MC_RPC_TIMEOUT_MS``; Mooncake's own default is 30 s), so that a call
    that outlived its deadline does not hold a worker thread and the caller's memory long. A
    value the user exported is left alone."""
    global _rpc_timeout_set_here
    if RPC_TIMEOUT_VARIABLE in os.environ and not _rpc_timeout_set_here:
        return
    os.environ[RPC_TIMEOUT_VARIABLE] = str(max(1, round(seconds * 1000)))
    _rpc_timeout_set_here = True


__all__ = [
    "REQUIRED_CALLS",
    "check_master_answers",
    "check_metadata_server",
    "installed_version",
    "load_store_class",
    "set_up_client",
]
