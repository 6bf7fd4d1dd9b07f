"""serving.ports.free_port: distinct ports within a process, each free when handed out."""

import socket

from serving import ports


def test_free_ports_are_distinct_and_bindable(monkeypatch):
    """200 picks in a row are 200 different ports, each of which a server can bind; and a port the OS offers again
    after it was closed (forced here by a fake socket that offers 5001 twice, then 5002) is skipped, not repeated."""
    picked = [ports.free_port() for _ in range(200)]
    assert len(set(picked)) == 200
    for port in picked[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))

    offers = iter([5001, 5001, 5002])

    class Offering:
        def __init__(self):
            self.port = next(offers)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def bind(self, address):
            assert address == ("127.0.0.1", 0)

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(ports, "_handed_out", set())
    monkeypatch.setattr(ports.socket, "socket", Offering)
    assert [ports.free_port(), ports.free_port()] == [5001, 5002]
