"""The socket family: TSoR (tsor/) carries TCP between quark sandboxes behind these calls.

Only TCP (AF_INET/AF_INET6 SOCK_STREAM) sockets of a sandbox registered with tsord are touched, on a
platform that can install fds (seccomp: SECCOMP_IOCTL_NOTIF_ADDFD); everything else runs natively.

connect      asks tsord (SandboxNet.connect). When it answers with a path (local: an AF_UNIX
             socketpair end; tcp: a kernel TCP socket the two tsords set up) and an fd, that fd is
             installed over the application's fd number (ADDFD + SETFD: dup2 semantics, the unused
             TCP socket goes away) and the call returns 0, or EINPROGRESS on a non-blocking socket
             (the socket is then writable at once and SO_ERROR is 0). The socket's TCP addresses and
             options are recorded by socket inode (`Redirected`), which every dup, fork and
             SCM_RIGHTS copy shares. No tsord, no route, no TSoR listener there, any error: the
             connect continues natively (the fallback path).
getsockname  on a redirected socket: the recorded TCP addresses (the socket underneath may be
getpeername  AF_UNIX, or TCP between the nodes' addresses).
getsockopt   on a redirected socket: SO_DOMAIN/SO_TYPE/SO_PROTOCOL answer AF_INET(6)/SOCK_STREAM/
setsockopt   IPPROTO_TCP; TCP/IP options the socket underneath cannot hold (all of them on AF_UNIX:
             TCP_NODELAY, TCP_KEEP*, TCP_INFO, IP_TOS, ...; IPV6 ones on an AF_INET tcp-path socket;
             SO_REUSEPORT and the like on AF_UNIX) are checked against a real TCP socket, recorded
             and answered; everything else goes to the real socket.
listen       runs on the supervisor's duplicate of the socket, then announces a `Listener` to tsord
             (not for loopback-bound sockets: other pods cannot reach those).
accept(4)    on an announced listener: accepts on the supervisor's duplicate (waiting for readiness
             on the loop when the listener blocks); a connection from a doorbell's address
             (SandboxNet.take_bell) is swapped for the queued TSoR connection, anything else (a plain
             TCP peer) is installed as it is. SOCK_NONBLOCK/SOCK_CLOEXEC and the peer's sockaddr are
             honoured; the fd is installed and the call answered in one step (ADDFD_FLAG_SEND).
socket, bind, shutdown   native (trapped for symmetry; nothing to do).
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import select
import socket
import struct
import weakref

from qkernel.errors import MemoryFault, TaskGone
from qkernel.request import Continue, Deferred, Errno, InstallFd, Request, Return
from qlib import procfs

log = logging.getLogger("quark.qkernel")

TRAPPED = ("socket", "connect", "bind", "listen", "accept", "accept4", "getsockname",
           "getpeername", "setsockopt", "getsockopt", "shutdown")

SOL_SOCKET, SOL_IP, SOL_TCP, SOL_IPV6 = socket.SOL_SOCKET, socket.IPPROTO_IP, socket.IPPROTO_TCP, socket.IPPROTO_IPV6
SO_TYPE, SO_PROTOCOL, SO_DOMAIN = 3, 38, 39
TCP_INFO, TCP_ESTABLISHED, TCP_CLOSE = 11, 1, 7
_INET = (socket.AF_INET, socket.AF_INET6)
_MAX_OPT = 512
# The send buffer of a local-path (AF_UNIX) end. AF_UNIX stream flow control is the sender's
# SO_SNDBUF alone, and its default (wmem_default, ~208 KiB) halves bulk throughput; TCP autotunes
# its buffer up to tcp_wmem's maximum (4 MiB). 1 MiB (2 MiB once the kernel doubles it) gets most of
# the gain (bench/README.md) and bounds what one connection can pin in kernel memory. An
# application that sets SO_SNDBUF itself (before or after connect) gets its own value.
LOCAL_SNDBUF = 1 << 20
# SOL_SOCKET options Linux refuses on AF_UNIX (EOPNOTSUPP) but accepts on TCP.
_UNIX_REFUSES = {socket.SO_REUSEPORT, 60, 61}            # SO_REUSEPORT, SO_ZEROCOPY, SO_TXTIME
# Options set before connect() that travel to the socket that replaces the TCP one.
_CARRY = [(SOL_TCP, socket.TCP_NODELAY), (SOL_TCP, socket.TCP_KEEPIDLE), (SOL_TCP, socket.TCP_KEEPINTVL),
          (SOL_TCP, socket.TCP_KEEPCNT), (SOL_TCP, 18), (SOL_TCP, 25), (SOL_TCP, 13),
          (SOL_IP, socket.IP_TOS), (SOL_IP, socket.IP_TTL),
          (SOL_IPV6, 67), (SOL_IPV6, 16), (SOL_IPV6, socket.IPV6_V6ONLY),
          (SOL_SOCKET, socket.SO_KEEPALIVE), (SOL_SOCKET, socket.SO_LINGER), (SOL_SOCKET, socket.SO_PRIORITY),
          (SOL_SOCKET, socket.SO_RCVTIMEO), (SOL_SOCKET, socket.SO_SNDTIMEO), (SOL_SOCKET, socket.SO_OOBINLINE),
          (SOL_SOCKET, socket.SO_REUSEADDR), (SOL_SOCKET, socket.SO_REUSEPORT)]


def handle(req: Request):
    net = req.context.tsor
    if net is None or not req.kernel.can_install_fds:
        return Continue()   # no TSoR for this sandbox, or the ptrace platform: all native
    handler = _HANDLERS.get(req.name)
    return handler(req, net) if handler is not None else Continue()


# ---- the task's fds ---------------------------------------------------------------------------

def _fd(req: Request) -> int:
    return _s32(req.args[0])


def _s32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v & 0x80000000 else v


def _inode(req: Request, fd: int) -> int | None:
    from tsor import _sys
    return _sys.socket_inode(req.pid, fd) if fd >= 0 else None


def _checked(req: Request) -> None:
    """After reading anything of the task's through /proc: was it still the trapped task?"""
    if not req.is_valid():
        raise TaskGone(req.pid)


def _dup(req: Request, fd: int) -> socket.socket | None:
    """Our own duplicate of the task's fd (same open file), as a socket; None if it is not one."""
    from tsor import _sys
    if fd < 0:
        return None
    try:
        pidfd = _sys.pidfd_open(req.pid)
    except OSError as e:
        raise TaskGone(req.pid) from e
    try:
        _checked(req)   # the pidfd now names the trapped task for good
        try:
            dup = _sys.pidfd_getfd(pidfd, fd)
        except OSError:
            return None   # not an fd of the task: the native call answers EBADF
    finally:
        os.close(pidfd)
    try:
        return socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return None


def _is_tcp(s: socket.socket) -> bool:
    return s.family in _INET and s.type == socket.SOCK_STREAM and s.proto in (0, socket.IPPROTO_TCP)


def _cloexec(req: Request, fd: int) -> bool:
    try:
        flags = procfs.fdinfo(fd, req.pid).get("flags")
    except OSError:
        return False
    return flags is not None and bool(int(flags, 8) & os.O_CLOEXEC)


def _set_nonblock(fd: int, on: bool) -> None:
    fl = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, fl | os.O_NONBLOCK if on else fl & ~os.O_NONBLOCK)


def _write_sized(req: Request, buf: int, lenp: int, data: bytes) -> None:
    """Linux's move_addr_to_user / getsockopt convention: copy at most *lenp bytes, then store the
    full (sockaddr) or copied (option) length in *lenp."""
    have = struct.unpack("i", req.read(lenp, 4))[0]
    if have < 0:
        raise _Fail(errno.EINVAL)
    n = min(have, len(data))
    if n:
        req.write(buf, data[:n])
    return n


class _Fail(Exception):
    def __init__(self, err: int) -> None:
        self.errno = err


# ---- connect ----------------------------------------------------------------------------------

def _connect(req: Request, net):
    from tsor.addr import is_loopback, is_unspecified, parse_sockaddr, unmapped
    fd, addr, addrlen = _fd(req), req.args[1], req.args[2] & 0xFFFFFFFF
    if not 16 <= addrlen <= 128:
        return Continue()
    parsed = parse_sockaddr(req.read(addr, min(addrlen, 28)))
    if parsed is None:
        return Continue()
    fam, (ip, port) = parsed
    ip = unmapped(ip)
    if port == 0 or is_loopback(ip) or is_unspecified(ip) or _is_multicast(ip):
        return Continue()   # the pod's own loopback never leaves the pod
    ino = _inode(req, fd)
    if ino is None:
        return Continue()
    if ino in net.sockets:
        _checked(req)
        return Errno(errno.EISCONN)
    if not net.client.up or not net.addrs:
        # tsord is not there (yet, or any more), or the sandbox registered no address to connect
        # from (tsord would answer fallback): native, without a round trip
        return Continue()
    from tsor import _sys
    if _sys.held_elsewhere(req.pid, fd, ino):
        # dup'ed or already in an epoll set (nginx registers before connect): swapping the socket
        # would leave those references on the old one, so this connection stays native
        return Continue()
    s = _dup(req, fd)
    if s is None:
        return Continue()
    try:
        if not _is_tcp(s) or s.family != fam or _tcp_state(s) != TCP_CLOSE:
            raise _Native
        if s.family == socket.AF_INET6 and ":" not in ip and s.getsockopt(SOL_IPV6, socket.IPV6_V6ONLY):
            raise _Native
        src_port = s.getsockname()[1]
        if src_port == 0:   # the peer sees a real port: take an ephemeral one from the pod's kernel
            s.bind(("::" if s.family == socket.AF_INET6 else "0.0.0.0", 0))
            src_port = s.getsockname()[1]
        nonblock = bool(fcntl.fcntl(s.fileno(), fcntl.F_GETFL) & os.O_NONBLOCK)
        cloexec = _cloexec(req, fd)
        _checked(req)
    except (_Native, OSError):
        s.close()
        return Continue()
    d = req.defer()
    d.on_cancel(s.close)
    net.connect((ip, port), src_port, lambda reply, fds: _connected(req, d, net, s, fd, ino, (ip, port),
                                                                   nonblock, cloexec, reply, fds))
    return d


class _Native(Exception):
    pass


def _is_multicast(ip: str) -> bool:
    import ipaddress
    return ipaddress.ip_address(ip).is_multicast


def _tcp_state(s: socket.socket) -> int:
    return s.getsockopt(SOL_TCP, TCP_INFO, 8)[0]


def _connected(req: Request, d: Deferred, net, old: socket.socket, fd: int, ino: int, dst,
               nonblock: bool, cloexec: bool, reply: dict | None, fds: list[int]) -> None:
    from tsor import _sys
    from tsor.sandbox import Redirected
    for extra in fds[1:]:
        os.close(extra)
    new = fds[0] if fds else None
    try:
        if d.done:   # the task was interrupted or died meanwhile
            return
        if (not reply or reply.get("path") not in ("local", "tcp") or new is None
                or _sys.socket_inode(req.pid, fd) != ino):   # fd closed or reused meanwhile
            return d.complete(Continue())
        _set_nonblock(new, nonblock)
        sock = socket.socket(fileno=os.dup(new))
        with sock:
            state = Redirected(family=old.family, local=(reply["src"][0], reply["src"][1]), peer=dst,
                               path=reply["path"], real_family=sock.family)
            _carry_options(net, old, sock, state)
            net.redirected(os.fstat(new).st_ino, state)
        answer, new = InstallFd(new, target=fd, flags=os.O_CLOEXEC if cloexec else 0, value=0,
                                errno=errno.EINPROGRESS if nonblock else 0), None
        d.complete(answer)
    except Exception:
        log.exception("TSoR connect for pid %d", req.pid)
        if not d.done:
            d.complete(Continue())
    finally:
        if new is not None:
            os.close(new)
        old.close()


def _carry_options(net, old: socket.socket, new: socket.socket, state) -> None:
    """Options the application set before connect() hold on the socket that replaces its TCP one."""
    default = _template(net, old.family)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):   # set by the application, or TCP's default?
        own = old.getsockopt(SOL_SOCKET, opt)
        if own != default.getsockopt(SOL_SOCKET, opt):
            new.setsockopt(SOL_SOCKET, opt, own // 2)   # the kernel doubles what it is given
        elif opt == socket.SO_SNDBUF and new.family == socket.AF_UNIX:
            new.setsockopt(SOL_SOCKET, opt, LOCAL_SNDBUF)
    for level, opt in _CARRY:
        try:
            value = old.getsockopt(level, opt, 64)
        except OSError:
            continue   # e.g. IPV6 options of an AF_INET socket
        if _emulated(state, level, opt):
            state.opts[(level, opt)] = value
            continue
        try:
            if new.getsockopt(level, opt, 64) != value:
                new.setsockopt(level, opt, value)
        except OSError:
            state.opts[(level, opt)] = value


# ---- addresses and options of redirected sockets ----------------------------------------------

def _redirected(req: Request, net):
    if not net.sockets:
        return None
    ino = _inode(req, _fd(req))
    return net.sockets.get(ino) if ino is not None else None


def _getname(req: Request, net):
    from tsor.addr import sockaddr
    st = _redirected(req, net)
    if st is None:
        return Continue()
    ep = st.local if req.name == "getsockname" else st.peer
    data = sockaddr(st.family, ep)
    try:
        _write_sized(req, req.args[1], req.args[2], data)
    except _Fail as e:
        return Errno(e.errno)
    req.write(req.args[2], struct.pack("i", len(data)))
    return Return(0)


def _emulated(st, level: int, opt: int) -> bool:
    """Is (level, opt) answered from the record rather than by the socket underneath?"""
    if level == SOL_SOCKET:
        return opt in (SO_DOMAIN, SO_TYPE, SO_PROTOCOL) or (
            st.real_family == socket.AF_UNIX and opt in _UNIX_REFUSES)
    if st.real_family == socket.AF_UNIX:
        return level in (SOL_TCP, SOL_IP, SOL_IPV6)
    return level == SOL_IPV6 and st.family == socket.AF_INET6 and st.real_family != socket.AF_INET6


_templates: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _template(net, family: int) -> socket.socket:
    """A pristine TCP socket of `family` in the pod's network namespace: the defaults to answer."""
    from tsor import _sys
    per = _templates.setdefault(net, {})
    if family not in per:
        per[family] = _sys.socket_in_netns(net.netns_fd, family)
    return per[family]


def _getsockopt(req: Request, net):
    st = _redirected(req, net)
    if st is None:
        return Continue()
    level, opt = _s32(req.args[1]), _s32(req.args[2])
    if not _emulated(st, level, opt) and (level, opt) not in st.opts:
        return Continue()
    if level == SOL_SOCKET and opt in (SO_DOMAIN, SO_TYPE, SO_PROTOCOL):
        value = struct.pack("i", {SO_DOMAIN: st.family, SO_TYPE: socket.SOCK_STREAM,
                                  SO_PROTOCOL: socket.IPPROTO_TCP}[opt])
    elif (level, opt) in st.opts:
        value = st.opts[(level, opt)]
    else:
        try:
            value = _template(net, st.family).getsockopt(level, opt, _MAX_OPT)
        except OSError as e:
            return Errno(e.errno)
        if level == SOL_TCP and opt == TCP_INFO:
            value = bytes([TCP_ESTABLISHED]) + value[1:]
    try:
        n = _write_sized(req, req.args[3], req.args[4], value)
    except _Fail as e:
        return Errno(e.errno)
    req.write(req.args[4], struct.pack("i", n))
    return Return(0)


def _setsockopt(req: Request, net):
    st = _redirected(req, net)
    if st is None:
        return Continue()
    level, opt, optlen = _s32(req.args[1]), _s32(req.args[2]), req.args[4] & 0xFFFFFFFF
    if not _emulated(st, level, opt):
        st.opts.pop((level, opt), None)   # the real socket holds it from now on
        return Continue()
    if level == SOL_SOCKET and opt in (SO_DOMAIN, SO_TYPE, SO_PROTOCOL):
        return Errno(errno.ENOPROTOOPT)   # read-only, as on any socket
    value = req.read(req.args[3], min(optlen, _MAX_OPT)) if optlen else b""
    # A real TCP socket of the same family checks the value and normalises it (booleans to 0/1,
    # IP_TOS without its ECN bits, the congestion control's name, ...).
    scratch = socket.socket(st.family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    with scratch:
        try:
            scratch.setsockopt(level, opt, value)
        except OSError as e:
            return Errno(e.errno)
        try:
            value = scratch.getsockopt(level, opt, max(len(value), 64))
        except OSError:
            pass   # write-only options: keep what was given
    st.opts[(level, opt)] = value
    return Return(0)


# ---- listeners --------------------------------------------------------------------------------

def _listen(req: Request, net):
    from tsor.addr import is_loopback, unmapped
    from tsor.sandbox import Listener
    fd = _fd(req)
    ino = _inode(req, fd)
    if ino is None:
        return Continue()
    if ino in net.sockets:
        _checked(req)
        return Errno(errno.EINVAL)   # listen() on a connected TCP socket
    s = _dup(req, fd)
    if s is None:
        return Continue()
    with s:
        if not _is_tcp(s) or is_loopback(s.getsockname()[0]):
            return Continue()
        backlog = _s32(req.args[1])
        try:
            s.listen(max(backlog, 0))   # the socket the application holds: the call itself
        except OSError as e:
            return Errno(e.errno)
        ip, port = s.getsockname()[:2]
        v6only = s.family == socket.AF_INET6 and bool(s.getsockopt(SOL_IPV6, socket.IPV6_V6ONLY))
        net.listen(Listener(token=os.fstat(s.fileno()).st_ino, family=s.family, local=(unmapped(ip), port),
                            v6only=v6only, pid=req.pid, fd=fd))
    return Return(0)


def _accept(req: Request, net):
    fd = _fd(req)
    if not net.listeners:
        return Continue()
    ino = _inode(req, fd)
    lst = net.listeners.get(ino) if ino is not None else None
    if lst is None:
        return Continue()
    flags = _s32(req.args[3]) if req.name == "accept4" else 0
    if flags & ~(socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC):
        return Errno(errno.EINVAL)
    addr, lenp = req.args[1], req.args[2]
    if addr and lenp and struct.unpack("i", req.read(lenp, 4))[0] < 0:
        return Errno(errno.EINVAL)
    s = _dup(req, fd)
    if s is None:
        return Continue()
    if os.fstat(s.fileno()).st_ino != lst.token:
        s.close()
        return Continue()
    waiter = _Accept(req, net, lst, s, flags, addr, lenp)
    answer = waiter.try_accept()
    if answer is not None:
        return answer
    if fcntl.fcntl(s.fileno(), fcntl.F_GETFL) & os.O_NONBLOCK:
        s.close()
        return Errno(errno.EAGAIN)
    return waiter.wait()


class _Accept:
    """One accept() on an announced listener, answered now or when the listener becomes readable."""

    def __init__(self, req: Request, net, lst, sock: socket.socket, flags: int, addr: int, lenp: int) -> None:
        self.req, self.net, self.lst, self.sock = req, net, lst, sock
        self.flags, self.addr, self.lenp = flags, addr, lenp
        self.deferred: Deferred | None = None
        self._fd: int | None = None

    def wait(self) -> Deferred:
        d = self.deferred = self.req.defer()
        self._fd = self.sock.fileno()
        self.req.kernel.loop.add_reader(self._fd, self._ready)
        d.on_cancel(self._stop)
        sec, usec = struct.unpack("qq", self.sock.getsockopt(SOL_SOCKET, socket.SO_RCVTIMEO, 16))
        if sec or usec:   # the listener's SO_RCVTIMEO bounds a blocking accept (EAGAIN), as in Linux
            self.req.kernel.loop.call_later(sec + usec / 1e6, self._timeout)
        return d

    def _timeout(self) -> None:
        if not self.deferred.done:
            self._stop()
            self.deferred.complete(Errno(errno.EAGAIN))

    def _stop(self) -> None:
        if self._fd is not None:
            self.req.kernel.loop.remove_reader(self._fd)
            self._fd = None
        self.sock.close()

    def _ready(self) -> None:
        d = self.deferred
        if d.done or not self.req.is_valid():
            # Interrupted by a signal, or the task died: stop taking connections for it (the
            # kernel's poll of pending requests cancels the request itself).
            return self._stop()
        try:
            answer = self.try_accept()
        except TaskGone:
            return self._stop()
        except MemoryFault:
            answer = Errno(errno.EFAULT)
        except Exception:
            log.exception("TSoR accept for pid %d", self.req.pid)
            answer = Errno(errno.ECONNABORTED)
        if answer is None:
            return   # another accept took it first: keep waiting
        self._stop()
        d.complete(answer)

    def try_accept(self):
        """The answer for the next connection, or None when none is queued."""
        from tsor.addr import parse_sockaddr, sockaddr
        from tsor.sandbox import Redirected
        poller = select.poll()
        poller.register(self.sock.fileno(), select.POLLIN)
        if not poller.poll(0):
            return None
        # Only trapped accepts (all of them come here) take from this queue, so it cannot be empty.
        try:
            conn, raw = _accept4(self.sock.fileno())
        except BlockingIOError:
            return None
        except OSError as e:
            self._close_if_immediate()
            return Errno(e.errno)
        try:
            peer = parse_sockaddr(raw)
            queued = self.net.take_bell(peer[1]) if peer is not None else None
            if queued is not None:   # a doorbell: the application gets the TSoR connection
                os.close(conn)
                conn = queued.fd
                with socket.socket(fileno=os.dup(conn)) as real:
                    if real.family == socket.AF_UNIX:
                        real.setsockopt(SOL_SOCKET, socket.SO_SNDBUF, LOCAL_SNDBUF)
                    self.net.redirected(os.fstat(conn).st_ino, Redirected(
                        family=self.lst.family, local=queued.local, peer=queued.peer, path=queued.path,
                        real_family=real.family))
                raw = sockaddr(self.lst.family, queued.peer)
            _set_nonblock(conn, bool(self.flags & socket.SOCK_NONBLOCK))
            if self.addr and self.lenp:
                _write_sized(self.req, self.addr, self.lenp, raw)
                self.req.write(self.lenp, struct.pack("i", len(raw)))
        except BaseException as e:
            os.close(conn)
            self._close_if_immediate()
            if isinstance(e, _Fail):
                return Errno(e.errno)
            raise
        self._close_if_immediate()
        return InstallFd(conn, flags=os.O_CLOEXEC if self.flags & socket.SOCK_CLOEXEC else 0)

    def _close_if_immediate(self) -> None:
        if self.deferred is None:
            self.sock.close()


def _accept4(fd: int) -> tuple[int, bytes]:
    import ctypes
    buf = ctypes.create_string_buffer(128)
    size = ctypes.c_uint32(128)
    res = _libc().accept4(fd, buf, ctypes.byref(size), socket.SOCK_CLOEXEC)
    if res < 0:
        err = ctypes.get_errno()
        if err in (errno.EAGAIN, errno.EWOULDBLOCK):
            raise BlockingIOError(err, os.strerror(err))
        raise OSError(err, os.strerror(err))
    return res, buf.raw[:min(size.value, 128)]


_LIBC = None


def _libc():
    global _LIBC
    if _LIBC is None:
        import ctypes
        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC


_HANDLERS = {"connect": _connect, "listen": _listen, "accept": _accept, "accept4": _accept,
             "getsockname": _getname, "getpeername": _getname,
             "getsockopt": _getsockopt, "setsockopt": _setsockopt}
