"""One tier of a configuration: a backend URL (or a ``wrapper::...::url`` chain) and its
options."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from pydantic import Field
from pydantic.dataclasses import dataclass

from kvplug.errors import InvalidBackendURL
from kvplug.secrets import mask_repr, mask_url, remember_in
from kvplug.url import BackendURL, split_chain


def parse_url_chain(text: str) -> tuple[list[BackendURL], BackendURL]:
    """Wrappers (outermost first) and the innermost URL of ``wrapper::...::url``."""
    parts = split_chain(text)
    wrappers = [BackendURL.parse(p if "://" in p else f"{p}://") for p in parts[:-1]]
    return wrappers, BackendURL.parse(parts[-1])


def check_url(text: str, key: str, source: str) -> None:
    """Raise :class:`~kvplug.errors.InvalidBackendURL` naming config key ``key`` and where it
    was set when ``text`` is not a URL chain."""
    try:
        parse_url_chain(text)
    except InvalidBackendURL as error:
        raise InvalidBackendURL(f"config key {key!r} {source}: {error}") from None


@dataclass(frozen=True)
class TierConfig:
    """One tier: its URL (a ``wrapper::...::url`` chain is allowed) and its options.

    ``options`` go to the innermost backend, and override that URL's query parameters; a
    wrapper takes its options from its own query (``audit://?verify=true::redis://h:6379``).
    They are kept as given and validated by the backend when the tier is opened.
    """

    url: str
    options: Mapping[str, Any] = Field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))
        remember_in(self.options)

    @property
    def parsed(self) -> BackendURL:
        """The innermost URL, parsed: the backend that stores the data."""
        return parse_url_chain(self.url)[1]

    @property
    def wrappers(self) -> tuple[BackendURL, ...]:
        """The wrappers around the innermost backend, outermost first."""
        return tuple(parse_url_chain(self.url)[0])

    def to_dict(self) -> dict[str, Any]:
        """``{"url": ..., **options}``, the mapping form of a ``tiers:`` item."""
        return {"url": self.url, **self.options}

    def __hash__(self) -> int:
        return hash((self.url, tuple(sorted(self.options))))

    def __str__(self) -> str:
        return mask_url(self.url)

    def __repr__(self) -> str:
        return f"TierConfig(url={mask_url(self.url)!r}, options={mask_repr(self.options)})"
