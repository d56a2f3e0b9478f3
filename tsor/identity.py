"""Who a sandbox is, as the kernel tells it: tsord never takes a sandbox's word for its addresses.

A supervisor says "I am sandbox S, my container's init is pid P, my addresses are A". tsord checks
that P descends from the supervisor on the other end of the socket (SO_PEERCRED), that every
address in A is configured in P's network namespace, and that the namespace is not the node's own.

Under a runc-compatible manager (containerd's runc shim with quark as its BinaryName, conmon) the
manager reaps the init, as it does runc's: it is a child subreaper, so the init and the supervisor
both end up its children. There P is accepted when it is the supervisor's sibling under such a
manager (qlib.procfs.RUNC_MANAGERS, by the program the kernel says it runs): a manager serves one
pod, whose containers share its network namespace, and pid 1 or any other parent never counts.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

from qlib.procfs import RUNC_MANAGERS, exe_name, parent_pid
from tsor import kernel_sockets
from tsor.addr import unmapped
from tsor.errors import NotAllowed
from tsor.protocol import Hello

_MAX_DEPTH = 4   # supervisor -> stage 1 -> init, with room for an intermediate


@dataclass(frozen=True)
class Identity:
    sandbox: str
    pid: int
    netns: int
    addrs: frozenset[str]


class Verifier(Protocol):
    def verify(self, peer_pid: int, hello: Hello) -> Identity: ...


class ProcVerifier:
    """Checks claims against /proc (the real one)."""

    def __init__(self) -> None:
        self.own_netns = os.stat("/proc/self/ns/net").st_ino

    def verify(self, peer_pid: int, hello: Hello) -> Identity:
        pid, depth = hello.pid, 0
        while pid not in (peer_pid, 0, 1) and depth < _MAX_DEPTH:
            pid, depth = parent_pid(pid) or 0, depth + 1
        if pid != peer_pid and not _adopted_by_one_manager(hello.pid, peer_pid):
            raise NotAllowed(f"pid {hello.pid} is not a process of the sandbox connected (pid {peer_pid})")
        try:
            netns = kernel_sockets.netns_inode(hello.pid)
        except OSError:
            raise NotAllowed(f"pid {hello.pid} is gone") from None
        if netns == self.own_netns:
            raise NotAllowed("the sandbox shares the node's network namespace")
        owned = kernel_sockets.netns_addresses(hello.pid)
        claimed = {unmapped(a) for a in hello.addrs}
        foreign = claimed - {unmapped(a) for a in owned}
        if foreign:
            raise NotAllowed(f"addresses not in the sandbox's network namespace: {sorted(foreign)}")
        return Identity(hello.sandbox, hello.pid, netns, frozenset(claimed))


def _adopted_by_one_manager(init: int, supervisor: int) -> bool:
    """Both children of one runc-compatible manager (see the module's docstring)."""
    manager = parent_pid(init)
    if manager in (None, 0, 1) or parent_pid(supervisor) != manager:
        return False
    name = exe_name(manager)
    return name is not None and name.startswith(RUNC_MANAGERS)
