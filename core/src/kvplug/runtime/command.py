"""The ``kvplug`` console script: the command line of :mod:`kvplug.runtime.cli` when the ``cli``
extra (click and rich) is installed, and otherwise one line saying how to install it.

The vendor surface (``pip install kvplug``) does not install click or rich; the command comes
with ``pip install 'kvplug[cli]'``.
"""

from __future__ import annotations

import sys

CLI_REQUIREMENTS = ("click", "rich")


def main() -> None:
    """Run ``kvplug`` with the process' arguments."""
    for module in CLI_REQUIREMENTS:
        try:
            __import__(module)
        except ModuleNotFoundError:
            sys.exit(
                f"kvplug: the command line needs {module}, which is not installed. It comes "
                "with kvplug's 'cli' extra: pip install 'kvplug[cli]'"
            )
    from kvplug.runtime.cli import main as cli

    cli()
