"""The socket family: trapped so TSoR can redirect TCP (its own issue); until then, pass-through."""
from __future__ import annotations

from qkernel.request import Continue, Request

TRAPPED = ("socket", "connect", "bind", "listen", "accept", "accept4", "getsockname",
           "getpeername", "setsockopt", "getsockopt", "shutdown")


def handle(req: Request) -> Continue:
    return Continue()
