from kvplug import BackendSpec, hookimpl


@hookimpl
def kvplug_backends():
    return [BackendSpec(name="dup-a", schemes=("dup", "onlya"), factory="kvplug_tinyplug.backend:TinyBackend")]
