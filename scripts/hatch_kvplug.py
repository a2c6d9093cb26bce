"""Hatchling metadata hook shared by every distribution of this repository: one version for all.

The version is the repository's ``VERSION`` file. A distribution lists its requirements under
``[tool.hatch.metadata.hooks.custom]`` instead of ``[project]``; a requirement on a sibling
distribution (a name starting with ``kvplug``) written without a version, such as ``"kvplug"``
or ``"kvplug-disk[gds]"``, is pinned to the same release series: ``kvplug~=0.2.0`` while
``VERSION`` says 0.2.0. So a release changes one file, and the distributions of one checkout
always require each other at the version they were built with.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hatchling.metadata.plugin.interface import MetadataHookInterface
from packaging.requirements import Requirement

VERSION_FILE = Path(__file__).resolve().parents[1] / "VERSION"


def read_version() -> str:
    return VERSION_FILE.read_text(encoding="utf-8").strip()


def pin_siblings(requirements: list[str], version: str) -> list[str]:
    """``requirements`` with every unversioned kvplug distribution pinned to ``~=version``."""
    pinned = []
    for text in requirements:
        requirement = Requirement(text)
        if requirement.name.startswith("kvplug") and not requirement.specifier:
            if requirement.url:
                raise ValueError(f"{text!r}: a sibling distribution is required by name")
            requirement.specifier &= f"~={version}"
            text = str(requirement)
        pinned.append(text)
    return pinned


class KvplugMetadataHook(MetadataHookInterface):
    PLUGIN_NAME = "custom"

    def update(self, metadata: dict[str, Any]) -> None:
        version = read_version()
        metadata["version"] = version
        metadata["dependencies"] = pin_siblings(self.config.get("dependencies", []), version)
        metadata["optional-dependencies"] = {
            extra: pin_siblings(requirements, version)
            for extra, requirements in self.config.get("optional-dependencies", {}).items()
        }
