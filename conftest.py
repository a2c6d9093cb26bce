"""Settings every test run in this repository shares, the engine integrations' venvs included."""

from collections.abc import Iterator

import pytest

from kvplug.secrets import remembered_only_inside


@pytest.fixture(autouse=True)
def secrets_remembered_by_one_test_stay_in_it() -> Iterator[None]:
    # The registry of secrets is process-wide; without this, a property test's random
    # password (drawn from the code's own strings, such as "kvplug-disk") masks that word in
    # the output of every test after it.
    with remembered_only_inside():
        yield
