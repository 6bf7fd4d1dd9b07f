"""Free local ports for the servers that tests, sweeps and benchmarks start as child processes."""

from __future__ import annotations

import socket

_handed_out: set[int] = set()


def free_port() -> int:
    """A port on 127.0.0.1 that is free now and that this process has not handed out before: the OS may offer a
    just-closed port again, so picking a deployment's ports one after another could repeat one (it did: a P/D test
    deployment's seven ports once held a repeat) before any server binds them."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
