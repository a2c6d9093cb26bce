from kvplug import BackendSpec, hookimpl


@hookimpl
def kvplug_backends():
    return [
        BackendSpec(
            name="tiny",
            schemes=("tiny",),
            factory="kvplug_tinyplug.backend:TinyBackend",
            description="an in-memory byte store installed by the registry tests",
        )
    ]
