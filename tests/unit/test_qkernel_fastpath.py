"""QKernel's compiled fast path (qkernel/fastpath.c) against a real seccomp listener: the per-request
TCP_CORK/TCP_NODELAY calls on a registered local-path socket are answered without Python; every
other notification still reaches Python. No root needed (the child sets no_new_privs)."""
from __future__ import annotations

import errno
import json
import os
import socket

import pytest
import seccomp

from qkernel import fastpath, table
from qkernel import seccomp_notify as sn
from qkernel.seccomp_platform import AUDIT_ARCH

CALLS = 1000


@pytest.fixture(scope="module")
def fast():
    fp = fastpath.load()
    if fp is None:
        pytest.skip(f"{fastpath.LIBRARY} is not built (make install builds it with gcc)")
    fp.init(table.by_name()["setsockopt"].nr(table.native_arch()), AUDIT_ARCH[table.native_arch()])
    return fp


def _child(chan: socket.socket) -> None:
    """Registered socket `a` (an AF_UNIX end, as on the local path): CALLS x TCP_CORK on/off and one
    TCP_NODELAY; unregistered `b`: one TCP_NODELAY, which Python answers (EOPNOTSUPP here)."""
    a, b = socket.socketpair()
    chan.send(json.dumps({"a": os.fstat(a.fileno()).st_ino}).encode())
    f = seccomp.SyscallFilter(seccomp.ALLOW)
    f.add_rule(seccomp.NOTIFY, "setsockopt")
    f.load()
    socket.send_fds(chan, [b"L"], [f.get_notify_fd()])
    chan.recv(1)   # the parent registered `a`
    errors = 0
    for i in range(CALLS):
        try:
            a.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, i % 2)
        except OSError:
            errors += 1
    a.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        b.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        other = 0
    except OSError as e:
        other = e.errno
    chan.send(json.dumps({"errors": errors, "other": other}).encode())


def test_option_calls_on_registered_sockets_never_reach_python(fast):
    # SEQPACKET: each send is one message (a stream could join the inode and the fd message)
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        try:
            parent.close()
            _child(child)
        finally:
            os._exit(0)
    child.close()
    ino = None
    try:
        ino = json.loads(parent.recv(100))["a"]
        _, fds, _, _ = socket.recv_fds(parent, 1, 1)
        listener = fds[0]
        before = fast.answered
        assert fast.add(ino, False, False)
        parent.send(b"g")
        seen = []
        while True:
            try:
                notif = fast.serve(listener)   # returns only what Python must answer
            except OSError as e:
                assert e.errno == errno.ENOENT
                break
            seen.append((notif.data.args[1], notif.data.args[2]))
            sn.send(listener, notif.id, error=-errno.EOPNOTSUPP)
        result = json.loads(parent.recv(100))
    finally:
        if os.waitpid(pid, os.WNOHANG)[0] == 0:   # never leave the child held in a trapped call
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        if ino is not None:
            fast.remove(ino)
        parent.close()
    assert result == {"errors": 0, "other": errno.EOPNOTSUPP}
    assert seen == [(socket.IPPROTO_TCP, socket.TCP_NODELAY)]   # only the unregistered socket's call
    assert fast.answered - before == CALLS + 1
    os.close(listener)


def test_the_table_keeps_what_was_set_and_forgets_removed_sockets(fast):
    assert fast.add(12345, True, False)
    assert (fast.get(12345, fastpath.TCP_NODELAY), fast.get(12345, fastpath.TCP_CORK)) == (1, 0)
    assert fast.set(12345, fastpath.TCP_CORK, True) and fast.get(12345, fastpath.TCP_CORK) == 1
    fast.remove(12345)
    assert fast.get(12345, fastpath.TCP_CORK) is None and not fast.set(12345, fastpath.TCP_CORK, True)


@pytest.mark.parametrize("how", ["alone", "dup", "epoll", "epoll of another socket", "many fds and epolls"])
def test_held_elsewhere_compiled_agrees_with_python(fast, how):
    """TSoR's check before it swaps a connecting socket: a socket also reachable by another fd or
    from an epoll set must not be swapped. The compiled check answers as tsor/_sys.py's does."""
    import select

    from tsor import _sys
    keep = []
    s = socket.socket()
    other = socket.socket()
    keep += [s, other]
    if how == "dup":
        keep.append(s.dup())
    elif how.startswith("epoll"):
        ep = select.epoll()
        keep.append(ep)
        ep.register(other if how == "epoll of another socket" else s, select.EPOLLIN)
    elif how == "many fds and epolls":
        for _ in range(5):
            ep = select.epoll()
            keep.append(ep)
            for _ in range(40):
                x = socket.socket()
                keep.append(x)
                ep.register(x, select.EPOLLIN)
        ep.register(s, select.EPOLLOUT)   # in the last one
    ino = os.fstat(s.fileno()).st_ino
    try:
        expected = how in ("dup", "epoll", "many fds and epolls")
        assert _sys.held_elsewhere(os.getpid(), s.fileno(), ino) is expected
        assert fast.held_elsewhere(os.getpid(), s.fileno(), ino) is expected
        assert fast.held_elsewhere(2 ** 22 + 7, 3, ino) is True   # no such task: cannot tell, so not swapped
    finally:
        for x in keep:
            x.close()


def test_sockopts_in_one_call_agree_with_getsockopt(fast):
    """TSoR reads the options a connecting socket carries in one compiled call: the same bytes as
    getsockopt, the application's values included, None where the socket refuses the option."""
    keys = ((socket.SOL_SOCKET, socket.SO_SNDBUF), (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
            (socket.IPPROTO_TCP, 13),   # TCP_CONGESTION: a string
            (socket.SOL_SOCKET, socket.SO_LINGER), (socket.IPPROTO_IPV6, socket.IPV6_V6ONLY))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 33)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, (1).to_bytes(4, "little") + (7).to_bytes(4, "little"))
        got = fast.sockopts(s.fileno(), keys)
        assert got[:4] == [s.getsockopt(level, opt, 64) for level, opt in keys[:4]]
        assert int.from_bytes(got[1], "little") == 33
        assert got[4] is None   # an IPv6 option of an AF_INET socket: EOPNOTSUPP
        assert fast.sockopts(s.fileno(), keys) == got   # the buffers are reused per key list
