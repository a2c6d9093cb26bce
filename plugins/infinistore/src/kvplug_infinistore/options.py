"""The options of ``infinistore://host:port?name=value&...``: how values move (RDMA or TCP, which
device and link), how much memory transfers may use, and the client's deadlines and back-off."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from kvplug.options import BytesBackendOptions
from kvplug.units import format_size, parse_size

MAX_RDMA_BLOCK = (1 << 31) - 1
"""InfiniStore's RDMA requests carry the block size as a C ``int``."""

LINK_TYPES = {"ETHERNET": "Ethernet", "LINK_ETHERNET": "Ethernet", "IB": "IB", "LINK_IB": "IB"}


class InfiniStoreOptions(BytesBackendOptions):
    """Options of ``infinistore://host:port?name=value&...``.

    * ``connection_type`` (``rdma`` or ``tcp``; default ``rdma``, as LMCache): how values move.
    * ``device`` (default ``mlx5_0``, LMCache's default): the RDMA device (``ibv_devices``).
    * ``ib_port`` (default 1): the port of that device.
    * ``link_type`` (``Ethernet`` for RoCE or ``IB``; default ``Ethernet``, as LMCache):
      the device port's link layer. LMCache's name ``infinistore_link_type`` (with its values
      ``LINK_ETHERNET`` / ``LINK_IB``) is accepted too.
    * ``max_value_size`` (default ``128MiB``): the largest value a read accepts, so the room
      an RDMA read reserves in staging; a larger object is refused at put with
      :class:`~kvplug.errors.CapacityExceeded` (it could not be read back).
    * ``staging_size`` (default ``1GiB``): registered memory for RDMA transfers; at least
      ``max_value_size``. Transfers wait (within their deadline) while it is all in use.
    * ``timeout`` (seconds, default 10): the deadline of one operation.
    * ``connect_timeout`` (seconds, default 5): the limit of the port probe and of the
      client's connect.
    * ``workers`` (default 4): threads for the client's blocking calls, per connection.
    * ``reconnect_delay`` (seconds, default 0.05) and ``reconnect_max_delay`` (default 2):
      after a failed connect, operations fail at once for this long, doubling up to the
      maximum until the server answers again.
    * ``exact_contains`` (default true): ``batched_contains`` checks every key of the prefix
      that InfiniStore's ``get_match_last_index`` reports. That call binary-searches, so it
      is exact only when the present keys form a prefix; ``false`` trusts it (one round
      trip, LMCache's behaviour).
    * ``log_level`` (``error``, ``warning``, ``info``, ``debug``; default ``warning``): the
      client library's log level (its environment variable ``INFINISTORE_LOG_LEVEL`` wins).
    * ``key_prefix``, ``serde``: as for every byte store.
    """

    connection_type: Literal["rdma", "tcp"] = Field("rdma", description="rdma or tcp")
    device: str = Field("mlx5_0", min_length=1, description="RDMA device name")
    ib_port: int = Field(1, ge=1, le=255, description="port of the RDMA device")
    link_type: Literal["Ethernet", "IB"] | None = Field(
        None, description="link layer of the device port: Ethernet (RoCE) or IB"
    )
    infinistore_link_type: Literal["Ethernet", "IB"] | None = Field(
        None, description="LMCache's name for link_type"
    )
    max_value_size: int = Field(128 << 20, description="largest value a read accepts")
    staging_size: int = Field(1 << 30, description="registered memory for RDMA transfers")
    connect_timeout: float = Field(5.0, gt=0, description="seconds of the probe and connect")
    workers: int = Field(4, ge=1, le=64, description="threads for blocking client calls")
    reconnect_delay: float = Field(0.05, gt=0, description="first back-off after a failure")
    reconnect_max_delay: float = Field(2.0, gt=0, description="longest back-off")
    exact_contains: bool = Field(True, description="verify get_match_last_index's prefix")
    log_level: Literal["error", "warning", "info", "debug"] = Field(
        "warning", description="the InfiniStore client's log level"
    )

    @field_validator("connection_type", mode="before")
    @classmethod
    def _lower_connection_type(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower_log_level(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    @field_validator("link_type", "infinistore_link_type", mode="before")
    @classmethod
    def _link_type(cls, value: object) -> object:
        if isinstance(value, str):
            known = LINK_TYPES.get(value.strip().upper())
            if known is None:
                raise ValueError(
                    f"link type {value!r} is not one of Ethernet (RoCE) or IB (LMCache's "
                    "LINK_ETHERNET, LINK_IB); use the link layer of the device port "
                    "(ibv_devinfo shows it)"
                )
            return known
        return value

    @field_validator("max_value_size", "staging_size", mode="before")
    @classmethod
    def _size(cls, value: object) -> int:
        return parse_size(value, what="an infinistore:// size")

    @model_validator(mode="after")
    def _check(self) -> InfiniStoreOptions:
        if (
            self.link_type is not None
            and self.infinistore_link_type is not None
            and self.link_type != self.infinistore_link_type
        ):
            raise ValueError(
                f"link_type={self.link_type} and infinistore_link_type="
                f"{self.infinistore_link_type} disagree; give one of them"
            )
        if not 4096 <= self.max_value_size <= MAX_RDMA_BLOCK:
            raise ValueError(
                f"max_value_size must be between 4KiB and 2GiB - 1 byte (InfiniStore's RDMA "
                f"block size is a C int), got {self.max_value_size}"
            )
        if self.staging_size < self.max_value_size:
            raise ValueError(
                f"staging_size ({format_size(self.staging_size)}) must hold at least one value "
                f"of max_value_size ({format_size(self.max_value_size)}); raise staging_size"
            )
        return self

    @property
    def effective_link_type(self) -> str:
        """The link type the client is configured with (LMCache's default: Ethernet)."""
        return self.link_type or self.infinistore_link_type or "Ethernet"


__all__ = ["LINK_TYPES", "MAX_RDMA_BLOCK", "InfiniStoreOptions"]
