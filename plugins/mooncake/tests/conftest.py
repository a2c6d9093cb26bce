"""The Mooncake tests start a real ``mooncake_master`` and Mooncake clients, which listen on
all interfaces whatever they are told (kvplug_testing.mooncake). They run only where nothing
beyond loopback can reach those ports: in a network namespace of their own
(scripts/isolated.sh, which scripts/test.sh runs them under), or where
``KVPLUG_MOONCAKE_ANY_NETWORK=1`` says the host is isolated otherwise.
``KVPLUG_MOONCAKE_REQUIRE=1`` turns every reason to skip into a failure, so that the step
meant to run them cannot pass by skipping."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvplug_testing.mooncake import isolated_network, master_binary


def _reason_to_skip() -> str | None:
    try:
        import mooncake.store  # noqa: F401
    except ImportError as error:
        return (
            f"Mooncake's client does not import ({error}); scripts/setup.sh installs "
            "mooncake-transfer-engine-non-cuda and Debian's libibverbs1"
        )
    if master_binary() is None:
        return "mooncake_master is not installed (scripts/setup.sh installs it)"
    if not isolated_network() and os.environ.get("KVPLUG_MOONCAKE_ANY_NETWORK") != "1":
        return (
            "Mooncake's master and clients bind all interfaces; these tests run in a network "
            "namespace of their own (scripts/isolated.sh .venv/bin/python -m pytest "
            "plugins/mooncake/tests, as scripts/test.sh does), or set "
            "KVPLUG_MOONCAKE_ANY_NETWORK=1 on an isolated host"
        )
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = _reason_to_skip()
    if reason is None:
        return
    here = Path(__file__).parent
    mine = [item for item in items if item.path.is_relative_to(here)]
    if os.environ.get("KVPLUG_MOONCAKE_REQUIRE") == "1":
        raise pytest.UsageError(
            f"KVPLUG_MOONCAKE_REQUIRE=1 but the Mooncake tests cannot run: {reason}"
        )
    for item in mine:
        item.add_marker(pytest.mark.skip(reason=reason))
