"""The whole suite, collected by ``pytest --pyargs kvplug_contracts --kvplug-url URL``."""

from kvplug_contracts import BackendContract


class TestConformance(BackendContract):
    """Every clause of the contract against the backend named by ``--kvplug-url``."""
