"""Free TCP ports on the loopback interface, for servers a test starts.

Every server of :mod:`kvplug_testing` binds :data:`HOST` only, on a port from
:func:`free_port`, never on a fixed one, so tests run side by side and next to real services.
"""

from __future__ import annotations

import socket
import threading

HOST = "127.0.0.1"
"""Every server binds here only."""

_handed_out: set[int] = set()
_lock = threading.Lock()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now and this process has not handed
    out before (two servers started in a row never get the same one)."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((HOST, 0))
            port: int = probe.getsockname()[1]
        with _lock:
            if port not in _handed_out:
                _handed_out.add(port)
                return port
    raise RuntimeError("no free TCP port found on 127.0.0.1 after 100 tries")


__all__ = ["HOST", "free_port"]
