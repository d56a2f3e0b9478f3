"""personality(2): the default personas only. The argument is a register, so checking it and
letting the call continue natively is race-free."""
from __future__ import annotations

import errno

from qkernel.request import Continue, Errno, Request

# PER_LINUX, PER_LINUX32, UNAME26 and their combination, and the 0xffffffff query (Docker's set).
ALLOWED = frozenset({0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF})


def handle(req: Request) -> Continue | Errno:
    persona = req.args[0] & 0xFFFFFFFF   # the kernel takes an unsigned int
    return Continue() if persona in ALLOWED else Errno(errno.EPERM)
