from kvplug import BackendSpec, hookimpl


@hookimpl
def kvplug_backends():
    return [
        BackendSpec(name="lazy", schemes=("lazy",), factory="kvplug_lazyfail.backend:Missing"),
        BackendSpec(name="notabackend", schemes=("notabackend",), factory="kvplug_lazyfail.plugin:kvplug_backends"),
    ]
