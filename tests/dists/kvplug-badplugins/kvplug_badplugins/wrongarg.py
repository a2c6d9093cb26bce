from kvplug import BackendSpec, hookimpl


@hookimpl
def kvplug_backends(config):  # the failure under test: the hook passes no argument
    return [BackendSpec("wrongarg", ("wrongarg",), "kvplug_cpu.backend:CpuBackend")]
