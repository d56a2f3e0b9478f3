"""The seccomp platform serving a real listener: from a receiver thread where the kernel has
SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP (6.6+), from the event loop where it has not; either way every
trapped call is answered and the listener is let go once no task uses the filter. No root needed."""
from __future__ import annotations

import os
import socket
import threading
import time

import pytest
import seccomp

from qkernel import seccomp_notify as sn
from qkernel.kernel import Kernel, SandboxContext
from qlib.eventloop import Loop

CALLS = 200


def _child(chan: socket.socket) -> None:
    s = socket.socket()
    f = seccomp.SyscallFilter(seccomp.ALLOW)
    f.add_rule(seccomp.NOTIFY, "getsockopt")
    f.load()
    socket.send_fds(chan, [b"L"], [f.get_notify_fd()])
    chan.recv(1)
    ok = all(s.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE) == socket.SOCK_STREAM for _ in range(CALLS))
    os._exit(0 if ok else 1)


def _is_listener(fd: int) -> bool:
    try:
        return "seccomp" in os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return False


@pytest.mark.parametrize("receiver", ["thread", "loop"])
def test_every_trapped_call_is_answered_and_the_listener_let_go(receiver, monkeypatch):
    parent, child = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        parent.close()
        try:
            _child(child)
        finally:
            os._exit(2)
    child.close()
    status = None
    try:
        _, fds, _, _ = socket.recv_fds(parent, 1, 1)
        listener = fds[0]
        if receiver == "thread" and not sn.sync_wake_up(listener):
            pytest.skip("kernel before 6.6 (no SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP): the event loop serves listeners")
        if receiver == "loop":   # as on a kernel before 6.6
            monkeypatch.setattr(sn, "sync_wake_up", lambda fd: False)
        loop = Loop()
        loop.add_reader(parent.fileno(), lambda: None)   # the supervisor always waits on some fd
        kernel = Kernel(loop, "seccomp", SandboxContext("c1", pid))   # no socket hooks: every call native
        kernel.serve_listener(listener)
        receivers = [t for t in threading.enumerate() if t.name == f"qkernel-recv-{listener}"]
        assert len(receivers) == (1 if receiver == "thread" else 0)
        parent.send(b"g")
        deadline = time.monotonic() + 20
        while status is None and time.monotonic() < deadline:
            loop.run_once(max_wait=0.05)
            done, st = os.waitpid(pid, os.WNOHANG)
            status = st if done else None
        assert status is not None and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        while _is_listener(listener) and time.monotonic() < deadline:
            loop.run_once(max_wait=0.05)
        assert not _is_listener(listener), "the listener was not let go after its last task exited"
        kernel.close()
        loop.remove_reader(parent.fileno())
    finally:
        if status is None:   # never leave the child behind, held in a trapped call
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        parent.close()
