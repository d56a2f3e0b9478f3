"""The wire between the pair lane's guests carries TCP."""
from __future__ import annotations

import socket

from tests.pair.peer import ECHO_PORT


def test_the_wire_carries_tcp(peer):
    with socket.create_connection((peer, ECHO_PORT), timeout=30) as s:
        s.sendall(b"over the wire")
        assert s.recv(100) == b"over the wire"
