from kvplug import BackendSpec, hookimpl


@hookimpl
def kvplug_backends():
    return [BackendSpec(name="dup-b", schemes=("dup", "onlyb"), factory="kvplug_tinyplug.backend:TinyBackend")]
