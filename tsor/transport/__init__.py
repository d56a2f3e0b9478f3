"""How a TSoR connection is carried. Each transport hands the client sandbox one end and delivers
the other to the server sandbox's listener; local and tcp stay out of the data path, rdma pumps
each connection's bytes between its socketpair and the queue pair (transport/rdma_pump.c, or
transport/rdma.py's engine).

A transport is chosen per connection by the daemon: `local` when the listener is on this node,
otherwise the transport configured for the peer node (tsor.yaml `transport`): `rdma` (over an
RDMA device, transport/rdma_link.py) where it is set up, else `tcp`.
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
