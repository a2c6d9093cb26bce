"""Options every backend accepts, as pydantic models a backend extends with its own fields.

Kept apart from :mod:`kvplug.backend` so that importing the contract does not import pydantic;
``from kvplug.backend import BackendOptions`` still works (it loads this module on first use).

Example::

    >>> from pydantic import Field
    >>> from kvplug.options import BackendOptions
    >>> class AcmeOptions(BackendOptions):
    ...     shards: int = Field(4, ge=1, description="how many shards keys spread over")
    >>> AcmeOptions.model_validate({"shards": "8", "timeout": "2.5"}).shards
    8
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvplug.errors import ConfigError
from kvplug.eviction import DEFAULT_PIN_TTL, DEFAULT_POLICY, check_policy_name


class BackendOptions(BaseModel):
    """Options every backend accepts. A backend extends this model with its own fields.

    Values arrive as URL query strings or config values and are converted by the model
    (``"2.5"`` becomes ``2.5``, ``"true"`` becomes ``True``); unknown names are rejected.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    timeout: float = Field(10.0, gt=0, description="deadline of one operation, in seconds")


class BytesBackendOptions(BackendOptions):
    """Options of every :class:`~kvplug.backend.BytesBackend`."""

    serde: str = Field("naive", description="serde that turns objects into payload bytes")
    serde_options: dict[str, Any] = Field(
        default_factory=dict,
        description="options of the serde (in a URL or config: each with the serde_ prefix)",
    )
    key_prefix: str = Field("", description="prepended to every stored key")


class EvictionOptions(BackendOptions):
    """Options of a tier that evicts by policy and takes pins (what
    :class:`~kvplug.index.EvictableIndex` is built from); the tier adds its ``max_size``."""

    eviction: str = Field(DEFAULT_POLICY, description="eviction policy: lru, lfu or fifo")
    pin_ttl: float = Field(
        DEFAULT_PIN_TTL, gt=0, description="seconds a pin lasts before it expires"
    )

    @field_validator("eviction", mode="before")
    @classmethod
    def _check_eviction(cls, value: object) -> str:
        if not isinstance(value, str):
            raise ConfigError(f"eviction must be a policy name such as 'lru', got {value!r}.")
        return check_policy_name(value)


__all__ = ["BackendOptions", "BytesBackendOptions", "EvictionOptions"]
