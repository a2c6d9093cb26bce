"""What the config loader says: the warning class, did-you-mean suggestions, and the texts of
errors about bad values, unknown keys and unknown ``KVPLUG_*`` variables."""

from __future__ import annotations

import difflib
import sys
import warnings
from collections.abc import Iterable, Sequence
from types import FrameType

from kvplug.env import ENV_PREFIX
from kvplug.errors import ConfigError
from kvplug.secrets import mask_repr


class ConfigWarning(UserWarning):
    """A configuration is usable but contains something kvplug ignores or that is deprecated."""


# Frames of these packages sit between the caller of load_config() and a warning raised while
# the configuration is validated; the warning points at the caller.
_LOADER_MODULES = ("kvplug.runtime.config", "pydantic", "pydantic_core", "pydantic_settings")


def warn(message: str) -> None:
    """Issue a :class:`ConfigWarning` that points at the code that asked for the config."""
    level = 2  # the caller of warn()
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_LOADER_MODULES):
        frame = frame.f_back
        level += 1
    warnings.warn(message, ConfigWarning, stacklevel=level)


def show(value: object) -> str:
    """``value`` for an error message: short, with secrets masked."""
    return mask_repr(value, limit=80)


def suggest(word: str, choices: Iterable[str]) -> str | None:
    """The choice closest to ``word`` (ignoring case), or ``None`` when none is close."""
    by_lower = {choice.lower(): choice for choice in choices}
    close = difflib.get_close_matches(word.lower(), list(by_lower), n=1, cutoff=0.6)
    return by_lower[close[0]] if close else None


def bad_value(key: str, source: str, expected: str, value: object, fix: str) -> ConfigError:
    """The error for config key ``key`` (set ``source``) holding ``value``, not ``expected``."""
    return ConfigError(f"config key {key!r} {source} must be {expected}, got {show(value)}. {fix}")


def valid_keys_text(config_keys: Sequence[str]) -> str:
    """The sentence listing the keys a config may set."""
    return (
        "Valid keys: " + ", ".join(config_keys) + ". LMCache's keys that are not about storage "
        "(enable_blending, enable_p2p, enable_nixl, nixl_*, use_layerwise, ...) are accepted "
        "and ignored."
    )


def unknown_keys_message(
    keys: Sequence[str], source: str, config_keys: Sequence[str], ignored_keys: Iterable[str]
) -> str:
    """The error for ``keys`` (set ``source``), none of them a config key, each with the
    closest of ``config_keys`` and the accepted-and-ignored ``ignored_keys``."""
    choices = [*config_keys, *ignored_keys]
    parts = []
    for key in keys:
        hint = suggest(key, choices)
        parts.append(f"{key!r}" + (f" (did you mean {hint!r}?)" if hint else ""))
    many = len(keys) > 1
    return (
        f"unknown config key{'s' if many else ''} {', '.join(parts)} {source}. "
        f"Fix or remove {'them' if many else 'it'}. {valid_keys_text(config_keys)}"
    )


def unknown_env_message(
    name: str,
    config_names: Sequence[str],
    other_names: Iterable[str],
    plugin_prefixes: Sequence[str],
) -> str:
    """The error for the variable ``name``, read by neither kvplug nor an installed plugin.

    ``config_names`` are the ``KVPLUG_<KEY>`` of the config keys, ``other_names`` the variables
    other parts of kvplug read, ``plugin_prefixes`` the installed plugins' ``KVPLUG_<PLUGIN>_``.
    """
    # A misspelled plugin prefix (KVPLUG_REDSI_TIMEOUT) is compared with the same setting under
    # each installed plugin's prefix.
    _, _, setting = name.removeprefix(ENV_PREFIX).partition("_")
    plugin_variables = [prefix + setting for prefix in plugin_prefixes] if setting else []
    hint = suggest(name, [*config_names, *other_names, *plugin_variables])
    did_you_mean = f" Did you mean {hint}?" if hint else ""
    prefixes = ", ".join(f"{prefix}*" for prefix in plugin_prefixes) or "none installed"
    return (
        f"environment variable {name} is not a kvplug setting.{did_you_mean} Rename or unset "
        f"it. kvplug reads KVPLUG_<KEY> for each config key ({', '.join(config_names)}) and "
        f"also uses {', '.join(sorted(other_names))}; each installed plugin reads its own "
        f"KVPLUG_<PLUGIN>_* ({prefixes})."
    )


def ignored_keys_warning(names: Iterable[str]) -> str:
    """The one warning naming every LMCache setting that kvplug accepts and ignores."""
    return (
        "these LMCache settings are not used by kvplug and are ignored: "
        + ", ".join(sorted(names))
        + ". They are not about storage; remove them to silence this warning."
    )
