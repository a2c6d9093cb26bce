from kvplug import BackendSpec, hookimpl


@hookimpl
def kvplug_backend():  # the failure under test: kvplug_backends
    return [BackendSpec("misspelled", ("misspelled",), "kvplug_cpu.backend:CpuBackend")]
