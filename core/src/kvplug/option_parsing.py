"""A backend's options from its URL's query and its keyword arguments, validated against its
options model, with errors that name the valid options and never show a secret.

The models live in :mod:`kvplug.options` (pydantic); neither is imported until a backend is
constructed, so importing the backend contract stays light.
"""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING, Any, cast

from kvplug.errors import UnknownOption
from kvplug.secrets import MASK, is_secret_name, mask_repr, mask_text, remember
from kvplug.url import BackendURL

if TYPE_CHECKING:
    from pydantic import ValidationError

    from kvplug.options import BackendOptions

SERDE_OPTIONS = "serde_options"
"""The field of a byte store's options that holds its serde's options, gathered from the
``serde_``-prefixed names of its URL and config."""


class DefaultOptions:
    """``Backend.Options`` until a subclass names its own: the options model ``name`` of
    :mod:`kvplug.options`, imported on first use so that importing the contract does not
    import pydantic."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, instance: object, owner: type) -> type[BackendOptions]:
        import kvplug.options

        return cast("type[BackendOptions]", getattr(kvplug.options, self.name))


def parse_backend_options(
    backend: type, model: type[BackendOptions], url: BackendURL, explicit: dict[str, Any]
) -> BackendOptions:
    """The options of a ``backend`` class: ``url``'s query merged with ``explicit`` (explicit
    wins), validated by ``model``; unknown or bad values raise
    :class:`~kvplug.errors.UnknownOption` with the valid names listed."""
    from pydantic import ValidationError

    from kvplug.serde import SERDE_OPTION_PREFIX

    merged: dict[str, Any] = {**url.options, **explicit}
    remember(*(value for name, value in merged.items() if is_secret_name(name)))
    if SERDE_OPTIONS in model.model_fields:
        prefixed = [name for name in merged if name.startswith(SERDE_OPTION_PREFIX)]
        gathered = dict(merged.pop(SERDE_OPTIONS, None) or {})
        gathered.update((name[len(SERDE_OPTION_PREFIX) :], merged.pop(name)) for name in prefixed)
        if gathered:
            merged[SERDE_OPTIONS] = gathered
    known = sorted(model.model_fields)
    for name in merged:
        if name == "serde" and name not in model.model_fields:
            raise UnknownOption(
                f"{backend.__name__} ({url.scheme}://) stores each object's own bytes and has "
                f"no 'serde' option, so serde {merged[name]!r} cannot apply. Leave it out "
                "(in an LMCache config: remote_serde: naive)."
            )
        if name not in model.model_fields:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise UnknownOption(
                f"{backend.__name__} ({url.scheme}://) has no option {name!r}.{hint} "
                f"Valid options: {', '.join(known)}."
            )
    try:
        return model.model_validate(merged)
    except ValidationError as error:
        raise UnknownOption(
            f"{backend.__name__} ({url}) got an invalid option: "
            f"{describe_validation_error(error)}. Fix the value in the URL query or the config."
        ) from None


def describe_validation_error(error: ValidationError, prefix: str = "") -> str:
    """Each problem pydantic found, as ``option=value: why`` (each option's name after
    ``prefix``, as the user wrote it); secret values masked."""
    return "; ".join(
        f"{prefix}{'.'.join(str(p) for p in e['loc'])}="
        f"{_shown_input(e['loc'], e.get('input'))}: " + mask_text(e["msg"]).rstrip(".")
        for e in error.errors()
    )


def _shown_input(location: tuple[int | str, ...], value: object) -> str:
    """An option's rejected value as an error shows it: masked when any name on its path
    looks secret, whatever its type."""
    if any(is_secret_name(name) for name in location):
        return MASK
    return mask_repr(value)


__all__ = ["DefaultOptions", "parse_backend_options"]
