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

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from kvplug.errors import ConfigError
from kvplug.eviction import DEFAULT_PIN_TTL, DEFAULT_POLICY, check_policy_name
from kvplug.keys import tenant_tag_value
from kvplug.quotas import REPORT_NAMES, TenantQuotas
from kvplug.units import format_size, parse_size


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
    :class:`~kvplug.index.EvictableIndex` is built from); the tier adds its ``max_size``.

    Per-tenant byte quotas (see :class:`~kvplug.quotas.TenantQuotas` and ``docs/config.md``,
    "Quotas"): ``tenant_quotas`` gives named tenants theirs, as a mapping or, in a URL, as
    ``tenant:size`` items separated by commas; ``default_tenant_quota`` gives every other
    tenant one. A quota larger than the tier's ``max_size`` is an error; quotas that add up
    to more than ``max_size`` are allowed (their guarantees then hold as far as the room
    goes).

    Example::

        >>> options = EvictionOptions.model_validate(
        ...     {"tenant_quotas": "team-a:2GiB,team-b:512MiB", "default_tenant_quota": "1GiB"}
        ... )
        >>> options.quotas.quota_of("team-b"), options.quotas.quota_of("team-z")
        (536870912, 1073741824)
    """

    eviction: str = Field(DEFAULT_POLICY, description="eviction policy: lru, lfu or fifo")
    pin_ttl: float = Field(
        DEFAULT_PIN_TTL, gt=0, description="seconds a pin lasts before it expires"
    )
    tenant_quotas: dict[str, int] = Field(
        default_factory=dict,
        description="bytes each named tenant may hold and keeps: {team-a: 2GiB} in YAML, "
        "team-a:2GiB,team-b:1GiB in a URL",
    )
    default_tenant_quota: int | None = Field(
        None, description="bytes every other tenant may hold and keeps; unset: no quota"
    )

    @field_validator("eviction", mode="before")
    @classmethod
    def _check_eviction(cls, value: object) -> str:
        if not isinstance(value, str):
            raise ConfigError(f"eviction must be a policy name such as 'lru', got {value!r}.")
        return check_policy_name(value)

    @field_validator("tenant_quotas", mode="before")
    @classmethod
    def _parse_tenant_quotas(cls, value: object) -> dict[str, int]:
        return parse_tenant_quotas(value)

    @field_validator("default_tenant_quota", mode="before")
    @classmethod
    def _parse_default_tenant_quota(cls, value: object) -> int | None:
        if value is None or value == "":
            return None
        return parse_size(value, what="default_tenant_quota")

    # The tier declares max_size after these fields, so its value is checked against them.
    @field_validator("max_size", mode="after", check_fields=False)
    @classmethod
    def _check_quotas_fit(cls, max_size: int, info: ValidationInfo) -> int:
        quotas = {
            f"tenant {name!r}": size for name, size in info.data.get("tenant_quotas", {}).items()
        }
        default = info.data.get("default_tenant_quota")
        if default is not None:
            quotas["default_tenant_quota"] = default
        for what, size in quotas.items():
            if size > max_size:
                raise ConfigError(
                    f"the quota of {what}, {format_size(size)}, is larger than the tier's "
                    f"max_size of {format_size(max_size)}: no tenant can hold more than the "
                    "tier, so the quota could never be reached. Lower the quota, or raise "
                    "max_size."
                )
        return max_size

    @property
    def quotas(self) -> TenantQuotas | None:
        """The tenants' quotas; None when no tenant has one."""
        quotas = TenantQuotas(self.tenant_quotas, self.default_tenant_quota)
        return quotas if quotas.enabled else None


def parse_tenant_quotas(value: object) -> dict[str, int]:
    """Quotas in bytes by tenant from a mapping (``{"team-a": "2GiB"}``) or the URL form
    ``team-a:2GiB,team-b:1GiB`` (a name ends at its last ``:``, and is stripped of spaces;
    names with a ``,`` need the mapping form). ``None`` or ``""``: none. Raises
    :class:`~kvplug.errors.ConfigError` naming the item at fault.

    >>> parse_tenant_quotas("team-a:2GiB, team:b:1024")
    {'team-a': 2147483648, 'team:b': 1024}
    """
    if value is None or value == "":
        return {}
    items: list[tuple[object, object]]
    if isinstance(value, str):
        items = []
        for item in value.split(","):
            written, colon, quota = item.rpartition(":")
            tenant = written.strip()
            if not colon or not tenant:
                raise ConfigError(
                    f"tenant_quotas item {item!r} is not 'tenant:size': write each quota as a "
                    "tenant name, ':' and a size, separated by commas, e.g. "
                    "tenant_quotas=team-a:2GiB,team-b:1GiB."
                )
            if any(tenant == seen for seen, _ in items):
                raise ConfigError(
                    f"tenant_quotas names tenant {tenant!r} twice; give each tenant one quota."
                )
            items.append((tenant, quota))
    elif isinstance(value, Mapping):
        items = list(value.items())
    else:
        raise ConfigError(
            f"tenant_quotas must be a mapping of tenant to size ({{team-a: 2GiB}}) or a "
            f"string 'team-a:2GiB,team-b:1GiB', got {value!r}."
        )
    quotas: dict[str, int] = {}
    for name, size in items:
        if not isinstance(name, str):
            raise ConfigError(
                f"tenant_quotas has the key {name!r}, which is not a tenant name; quote it in "
                "YAML so that it is read as a string."
            )
        tenant_tag_value(name)  # raises InvalidKey naming what is wrong with the name
        if name in REPORT_NAMES:
            raise ConfigError(
                f"tenant_quotas cannot name {name!r}: stats report the keys without a tenant "
                f"and the tenants without a quota of their own under {' and '.join(REPORT_NAMES)}."
                " Use default_tenant_quota for every tenant not named."
            )
        quotas[name] = parse_size(size, what=f"the quota of tenant {name!r} in tenant_quotas")
    return quotas


__all__ = ["BackendOptions", "BytesBackendOptions", "EvictionOptions", "parse_tenant_quotas"]
