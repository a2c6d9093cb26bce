import kvplug_client_library_that_is_not_installed  # noqa: F401  -- fails only on open
