"""QKernel's compiled fast path (qkernel/fastpath.c) against a real seccomp listener: the per-request
TCP_CORK/TCP_NODELAY calls on a registered local-path socket are answered without Python, and so is
every sendmsg that carries nothing TCP would drop; every other notification still reaches Python. No root needed (the child sets no_new_privs)."""
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
    names, arch = table.by_name(), table.native_arch()
    fp.init(names["setsockopt"].nr(arch), AUDIT_ARCH[arch], names["sendmsg"].nr(arch), names["sendmmsg"].nr(arch))
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


def _serve_child(fast, child_main, register, unregister, error: int):
    """Fork `child_main(chan)`, which sends a JSON line naming its socket (`a`: its inode) and its
    seccomp listener, then waits for b"g"; register `a` (`register(inode)`), serve the listener through
    the fast path until the child is gone, answering what reaches Python with -`error`. Returns the
    child's first message, its last (its results), the (nr, arg0, arg1, arg2) of each notification
    Python saw, and how many the fast path answered."""
    # SEQPACKET: each send is one message (a stream could join the inode and the fd message)
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        try:
            parent.close()
            child_main(child)
        finally:
            os._exit(0)
    child.close()
    ino = listener = None
    try:
        first = json.loads(parent.recv(100))
        ino = first["a"]
        _, fds, _, _ = socket.recv_fds(parent, 1, 1)
        listener = fds[0]
        before = fast.answered
        assert register(ino)
        parent.send(b"g")
        seen = []
        while True:
            try:
                notif = fast.serve(listener)   # returns only what Python must answer
            except OSError as e:
                assert e.errno == errno.ENOENT
                break
            seen.append((notif.data.nr, *notif.data.args[:3]))
            sn.send(listener, notif.id, error=-error)
        return first, json.loads(parent.recv(200)), seen, fast.answered - before
    finally:
        if os.waitpid(pid, os.WNOHANG)[0] == 0:   # never leave the child held in a trapped call
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        if ino is not None:
            unregister(ino)
        if listener is not None:
            os.close(listener)
        parent.close()


def test_option_calls_on_registered_sockets_never_reach_python(fast):
    _, result, seen, answered = _serve_child(fast, _child, lambda ino: fast.add(ino, False, False), fast.remove,
                                             errno.EOPNOTSUPP)
    seen = [(level, opt) for _, _, level, opt in seen]
    assert result == {"errors": 0, "other": errno.EOPNOTSUPP}
    assert seen == [(socket.IPPROTO_TCP, socket.TCP_NODELAY)]   # only the unregistered socket's call
    assert answered == CALLS + 1


def _sending_child(chan: socket.socket) -> None:
    """Registered end `a`: CALLS x sendmsg without a control buffer, one with SCM_RIGHTS, one sendmmsg;
    `c`, no end (say a UDP or another unix socket): a sendmsg with SCM_RIGHTS."""
    import array
    a, peer = socket.socketpair()
    c, c_peer = socket.socketpair()
    chan.send(json.dumps({"a": os.fstat(a.fileno()).st_ino, "fd": a.fileno()}).encode())
    f = seccomp.SyscallFilter(seccomp.ALLOW)
    f.add_rule(seccomp.NOTIFY, "sendmsg", seccomp.Arg(0, seccomp.NE, chan.fileno()))   # as qkernel's policy
    f.add_rule(seccomp.NOTIFY, "sendmmsg")
    f.load()
    socket.send_fds(chan, [b"L"], [f.get_notify_fd()])
    chan.recv(1)
    sent = 0
    for i in range(CALLS):
        sent += a.sendmsg([b"x"])
        if i % 50 == 49:
            peer.recv(65536)   # (one-byte messages fill a unix socket's buffer in a few hundred)
    rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0]))]
    results = []
    for call in (lambda: a.sendmsg([b"y"], rights), lambda: c.sendmsg([b"z"], rights)):
        try:
            results.append(call())
        except OSError as e:
            results.append(-e.errno)
    import ctypes   # (Python has no sendmmsg: libc's)
    libc = ctypes.CDLL(None, use_errno=True)
    results.append(libc.sendmmsg(a.fileno(), None, 0, 0))
    results.append(-ctypes.get_errno() if results[-1] < 0 else 0)
    chan.send(json.dumps({"sent": sent, "results": results}).encode())


def test_sendmsg_without_a_control_buffer_or_not_on_an_end_never_reaches_python(fast):
    first, result, seen, answered = _serve_child(fast, _sending_child, fast.end_add, fast.end_remove, errno.EPERM)
    a_fd = first["fd"]
    seen = [(nr, fd) for nr, fd, _, _ in seen]
    names, arch = table.by_name(), table.native_arch()
    # only the end's sendmsg with a control buffer, and its sendmmsg, reached Python
    assert seen == [(names["sendmsg"].nr(arch), a_fd), (names["sendmmsg"].nr(arch), a_fd)]
    assert result["sent"] == CALLS and result["results"][:2] == [-errno.EPERM, 1]   # (Python answered EPERM)
    assert result["results"][2:] == [-1, -errno.EPERM]
    assert answered == CALLS + 1


def test_the_table_keeps_what_was_set_and_forgets_removed_sockets(fast):
    assert fast.add(12345, True, False)
    assert (fast.get(12345, fastpath.TCP_NODELAY), fast.get(12345, fastpath.TCP_CORK)) == (1, 0)
    assert fast.set(12345, fastpath.TCP_CORK, True) and fast.get(12345, fastpath.TCP_CORK) == 1
    fast.remove(12345)
    assert fast.get(12345, fastpath.TCP_CORK) is None and not fast.set(12345, fastpath.TCP_CORK, True)


@pytest.mark.parametrize("how", ["alone", "dup", "epoll", "epoll of another socket", "many fds and epolls"])
def test_held_elsewhere_compiled_agrees_with_python(fast, how):
    """TSoR's check before it swaps a connecting socket: a socket also reachable by another fd or
    from an epoll set must not be swapped. The compiled check answers as tsor/kernel_sockets.py's does."""
    import select

    from tsor import kernel_sockets
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
        assert kernel_sockets.held_elsewhere(os.getpid(), s.fileno(), ino) is expected
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


def _plain_sending_child(chan: socket.socket) -> None:
    """Three sendmsg without a control buffer on registered end `a`, one on `c` (no end)."""
    a, peer = socket.socketpair()
    c, c_peer = socket.socketpair()
    chan.send(json.dumps({"a": os.fstat(a.fileno()).st_ino, "fd": a.fileno()}).encode())
    f = seccomp.SyscallFilter(seccomp.ALLOW)
    f.add_rule(seccomp.NOTIFY, "sendmsg", seccomp.Arg(0, seccomp.NE, chan.fileno()))
    f.load()
    socket.send_fds(chan, [b"L"], [f.get_notify_fd()])
    chan.recv(1)
    results = []
    for s in (a, a, a, c):
        try:
            results.append(s.sendmsg([b"x"]))
        except OSError as e:
            results.append(-e.errno)
    chan.send(json.dumps({"results": results}).encode())


def test_where_ends_cannot_refuse_fds_every_sendmsg_on_an_end_reaches_python(fast):
    """Without SO_PASSRIGHTS (kernels before 6.16) a call let through could have its msghdr given a
    control buffer by another thread before the kernel reads it: every sendmsg on an end goes to
    Python, which sends it itself."""
    names, arch = table.by_name(), table.native_arch()
    fast.init(names["setsockopt"].nr(arch), AUDIT_ARCH[arch], names["sendmsg"].nr(arch), names["sendmmsg"].nr(arch),
              strict=True)
    try:
        first, result, seen, answered = _serve_child(fast, _plain_sending_child, fast.end_add, fast.end_remove,
                                                     errno.EPERM)
    finally:
        fast.init(names["setsockopt"].nr(arch), AUDIT_ARCH[arch], names["sendmsg"].nr(arch), names["sendmmsg"].nr(arch))
    assert [fd for _, fd, _, _ in seen] == [first["fd"]] * 3
    assert result["results"] == [-errno.EPERM] * 3 + [1] and answered == 1
