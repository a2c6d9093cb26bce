from kvplug import BackendSpec, hookimpl


@hookimpl
def kvplug_backends():
    # the failure under test: '_' is not allowed in a URL scheme
    return [BackendSpec("badscheme", ("bad_scheme",), "kvplug_cpu.backend:CpuBackend")]
