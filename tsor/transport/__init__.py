"""How a TSoR connection is carried. Each transport hands the client sandbox one end and delivers
the other to the server sandbox's listener; none stays in the data path.

A transport is chosen per connection by the daemon: `local` when the listener is on this node,
otherwise the transport configured for node-to-node traffic (`tcp`; `rdma` plugs in here).
"""
from __future__ import annotations

import socket
from typing import Callable, Protocol

from tsor.addr import Endpoint
from tsor.routes import Node

# deliver(dst, peer, sock, path, greet) -> True if a sandbox listening on dst took the connection.
Deliver = Callable[[Endpoint, Endpoint, socket.socket, str, bool], bool]


class Transport(Protocol):
    name: str

    def connect(self, node: Node, src: Endpoint, dst: Endpoint) -> socket.socket | None:
        """The client sandbox's end of a new connection from src to dst on `node`; None when the
        far side has no taker (the client then connects natively)."""

    def close(self) -> None: ...
