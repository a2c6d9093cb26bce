"""The contract classes, one per group of clauses (the contract: docs/concepts.md, "Backends")."""

from kvplug_contracts.suite.basic import (
    BatchedContract,
    MissContract,
    OverwriteContract,
    OwnershipContract,
    RemoveContract,
    RoundTripContract,
)
from kvplug_contracts.suite.cancellation import CancellationContract
from kvplug_contracts.suite.concurrency import ConcurrencyContract
from kvplug_contracts.suite.isolation import IsolationContract
from kvplug_contracts.suite.lifecycle import (
    CapabilityContract,
    CloseContract,
    DeadlineContract,
    ServerControl,
)
from kvplug_contracts.suite.model import ModelContract
from kvplug_contracts.suite.storage import (
    CapacityContract,
    CorruptionContract,
    PersistenceContract,
    PinContract,
)
from kvplug_contracts.suite.tenancy import TenancyContract


class BackendContract(
    MissContract,
    RoundTripContract,
    OverwriteContract,
    BatchedContract,
    OwnershipContract,
    CorruptionContract,
    RemoveContract,
    PinContract,
    CapacityContract,
    DeadlineContract,
    CloseContract,
    IsolationContract,
    TenancyContract,
    CapabilityContract,
    CancellationContract,
    PersistenceContract,
    ConcurrencyContract,
    ModelContract,
):
    """Every clause of the backend contract: subclass it as ``Test<Name>`` to run it."""


__all__ = [
    "BackendContract",
    "BatchedContract",
    "CancellationContract",
    "CapabilityContract",
    "CapacityContract",
    "CloseContract",
    "ConcurrencyContract",
    "CorruptionContract",
    "DeadlineContract",
    "IsolationContract",
    "MissContract",
    "ModelContract",
    "OverwriteContract",
    "OwnershipContract",
    "PersistenceContract",
    "PinContract",
    "RemoveContract",
    "RoundTripContract",
    "ServerControl",
    "TenancyContract",
]
