"""Options of ``mooncakestore://master-host:port?name=value&...``: kvplug's names, Mooncake's
own ``setup`` keys and LMCache's Mooncake config keys (``MOONCAKE_CONFIG_PATH``), one model."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from kvplug.errors import ConfigError
from kvplug.options import BackendOptions
from kvplug.units import parse_size

CONFIG_PATH_VARIABLE = "MOONCAKE_CONFIG_PATH"
"""LMCache's variable naming a JSON file of Mooncake settings (read when no ``config_file``
option is given)."""

LMCACHE_DEFAULT_SEGMENT = 3355443200
"""LMCache's default ``global_segment_size`` (3.125 GiB), kept so that its configs behave alike."""

ALIASES = {
    "master_server_address": "master_server_addr",
    "device_name": "device",
    "rdma_devices": "device",
    "transfer_timeout": "timeout",
}
"""Names of the same setting in LMCache's config (``master_server_address``, ``device_name``,
``transfer_timeout``) and in Mooncake's ``setup`` dict (``rdma_devices``), to kvplug's."""

REFUSED = {
    "storage_root_dir": (
        "LMCache exports it as MOONCAKE_STORAGE_ROOT_DIR, which turns on Mooncake's SSD "
        "offload; kvplug does not run that mode. Put a file:// tier below this one instead"
    ),
}


class MooncakeOptions(BackendOptions):
    """Options of ``mooncakestore://master-host:port``.

    * ``metadata_server`` (default ``P2PHANDSHAKE``): where transfer endpoints are found:
      ``P2PHANDSHAKE`` (no server: peers exchange them on connect), or the master's HTTP
      metadata server, ``http://host:port/metadata`` (``mooncake_master
      --enable_http_metadata_server``), or an etcd address.
    * ``protocol`` (``tcp`` or ``rdma``; default ``tcp``) and ``device`` (RDMA devices, comma
      separated, such as ``mlx5_0``; LMCache's ``device_name`` and the URL's ``device`` too).
    * ``local_hostname``: the address other Mooncake clients reach this one at (its segment
      and transfer endpoint); default: the local address this host uses to reach the master.
    * ``global_segment_size`` (default 3.125 GiB, LMCache's): memory this process lends to the
      store; 0 lends none (a pure client of segments other processes mount).
    * ``local_buffer_size`` (default 16 MiB): Mooncake's own transfer buffer; kvplug moves
      objects from and into registered memory, so it needs little.
    * ``replica_num`` (default 1): copies of each object, on different segments.
    * ``connect_timeout`` (seconds, default 10): how long ``open`` waits for the master (and
      the HTTP metadata server) to answer before Mooncake's ``setup``, which would otherwise
      stall the process 60-90 s against a master that does not answer.
    * ``timeout`` (seconds, default 10; LMCache's ``transfer_timeout``): deadline of one
      operation.
    * ``threads`` (default 8): worker threads running Mooncake's blocking calls.
    * ``leased_remove`` (``force`` or ``wait``; default ``force``): a ``remove`` the store
      refuses because a reader holds the key's lease (code -706) is forced at once, or retried
      until the lease ends (within ``timeout``, else :class:`~kvplug.errors.BackendTimeout`).
    * ``key_prefix`` (default empty): prepended to every stored key.
    * ``probe`` (default false): read once more, into a header slot, each key that
      ``batch_is_exist`` (in ``contains``) or the replica query (in a ``get`` of a key family
      not seen yet) calls absent. Mooncake calls a key absent for as long as another client
      overwrites it; with the probe such a key reads as present (and a ``get`` waits for the
      overwrite), at the cost of one more call whenever an answer has an absent key. Without
      it, a key being overwritten at that moment can read as a miss (never as a wrong value).
    * ``config_file``: a JSON file of these settings in LMCache's form (``local_hostname``,
      ``metadata_server``, ``master_server_address``, ``global_segment_size``,
      ``local_buffer_size``, ``protocol``, ``device_name``, ``transfer_timeout``); by default
      the file ``MOONCAKE_CONFIG_PATH`` names, if set. The URL and explicit options win.
    """

    master_server_addr: str | None = Field(
        None, description="master host:port when the URL has none (LMCache's key)"
    )
    metadata_server: str = Field("P2PHANDSHAKE", description="P2PHANDSHAKE or http://.../metadata")
    protocol: Literal["tcp", "rdma"] = Field("tcp", description="tcp or rdma")
    device: str = Field("", description="RDMA devices, comma separated")
    local_hostname: str | None = Field(None, description="address peers reach this client at")
    global_segment_size: int = Field(
        LMCACHE_DEFAULT_SEGMENT, ge=0, description="memory lent to the store: int or '4GiB'"
    )
    local_buffer_size: int = Field(16 << 20, ge=0, description="Mooncake's own buffer")
    replica_num: int = Field(1, ge=1, le=64, description="copies of each object")
    connect_timeout: float = Field(10.0, gt=0, description="seconds open waits for the master")
    threads: int = Field(8, ge=1, le=256, description="threads running Mooncake's calls")
    leased_remove: Literal["force", "wait"] = Field("force", description="force or wait")
    key_prefix: str = Field("", description="prepended to every stored key")
    probe: bool = Field(False, description="read absent answers once more (keys being overwritten)")
    config_file: str | None = Field(None, description="LMCache's Mooncake JSON config")

    @field_validator("global_segment_size", "local_buffer_size", mode="before")
    @classmethod
    def _size(cls, value: object) -> int:
        return parse_size(value, what="a Mooncake size")

    @field_validator("protocol", mode="before")
    @classmethod
    def _lower(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value


def merged_settings(url_options: dict[str, Any], explicit: dict[str, Any]) -> dict[str, Any]:
    """The settings of one backend: those of the JSON config file (``config_file``, else
    ``MOONCAKE_CONFIG_PATH``), under the URL's query, under the explicit options; every name in
    kvplug's spelling."""
    given = {**url_options, **explicit}
    path = given.get("config_file") or os.environ.get(CONFIG_PATH_VARIABLE)
    from_file = _read_config_file(path) if path else {}
    merged: dict[str, Any] = {}
    for layer in (from_file, url_options, explicit):
        for name, value in layer.items():
            if name in REFUSED:
                raise ConfigError(
                    f"the Mooncake setting {name!r} is not supported: {REFUSED[name]}."
                )
            merged[ALIASES.get(name, name)] = value
    if path and "config_file" not in merged:
        merged["config_file"] = str(path)
    return merged


def _read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as error:
        raise ConfigError(
            f"cannot read the Mooncake config file {str(path)!r} ({error.strerror}); fix the "
            f"path in config_file or {CONFIG_PATH_VARIABLE}."
        ) from None
    except json.JSONDecodeError as error:
        raise ConfigError(
            f"the Mooncake config file {str(path)!r} is not valid JSON ({error.msg} at line "
            f"{error.lineno}); it must be one object of settings."
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"the Mooncake config file {str(path)!r} holds a {type(data).__name__}; it must be "
            'one JSON object of settings such as {"metadata_server": "P2PHANDSHAKE"}.'
        )
    return data


__all__ = ["ALIASES", "CONFIG_PATH_VARIABLE", "MooncakeOptions", "merged_settings"]
