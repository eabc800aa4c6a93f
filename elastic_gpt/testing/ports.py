"""Free loopback ports for servers and process groups started by tests and benchmarks."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing listens on right now (the OS picks it; a race with another process taking
    it before use is possible but harmless for tests: the caller fails loudly)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
