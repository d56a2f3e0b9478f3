"""The socket family: the ABI side of the calls the sandbox's socket hooks (qkernel/sockets.py;
TSoR's tsor/intercept.py) may take over: TCP between quark sandboxes is carried by tsord.

The handlers read what the task passed (fds, sockaddrs, option values), ask the hooks what to do,
and write the answer back: sockaddrs and options with Linux's length conventions, an fd installed
(ADDFD, or ADDFD_FLAG_SEND: installed and answered in one step). Only on a platform that can
install fds (seccomp: SECCOMP_IOCTL_NOTIF_ADDFD) and for a sandbox with hooks; everything else
runs natively.

accept(4)    on a listener the hooks announced: accepts on the supervisor's duplicate (waiting for
             readiness on the loop when the listener blocks); the hooks hand the connection to
             install (a queued TSoR connection for a doorbell, anything else as it is).
             SOCK_NONBLOCK/SOCK_CLOEXEC and the peer's sockaddr are honoured; the fd is installed
             and the call answered in one step (ADDFD_FLAG_SEND).
getsockopt   only the levels the hooks may emulate are trapped (qkernel/table.py's _SOCKOPTS).
setsockopt
sendmsg      the bytes without the control buffer on a local-path end (sys_sendmsg.py); the compiled
sendmmsg     fast path lets every other call through before it reaches Python
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import struct
from collections.abc import Callable

from qkernel.errors import MemoryFault, TaskGone
from qkernel.request import Continue, Deferred, Errno, InstallFd, Request, Return
from qkernel.sockets import SocketHooks
from qkernel.syscalls import sys_sendmsg
from qlib import procfs

log = logging.getLogger("quark.qkernel")

# Only the calls that may have to answer differently for a TSoR socket; socket, bind, shutdown,
# sendmsg/recvmsg and friends always run natively (the socket underneath does the right thing).
TRAPPED = ("connect", "listen", "accept", "accept4", "getsockname", "getpeername", "setsockopt", "getsockopt",
           "sendmsg", "sendmmsg")

_MAX_OPT = 512   # the most of an option value read from the task


def handle(req: Request):
    hooks = req.context.tsor
    if hooks is None or not req.kernel.can_install_fds:
        return Continue()   # no TSoR for this sandbox, or the ptrace platform: all native
    handler = _HANDLERS.get(req.name)
    return handler(req, hooks) if handler is not None else Continue()


# ---- the task's fds ---------------------------------------------------------------------------

def _fd(req: Request) -> int:
    return _s32(req.args[0])


def _s32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v & 0x80000000 else v


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


def _errno_or_return(result: int | None):
    """A hook's int answer: 0 the call succeeded, else its errno; None: native."""
    if result is None:
        return Continue()
    return Errno(result) if result else Return(0)


class _Call:
    """The trapped call as the hooks see it (qkernel/sockets.py's TrappedCall)."""

    def __init__(self, req: Request) -> None:
        self.req = req
        self.pid = req.pid

    def check(self) -> None:
        if not self.req.is_valid():
            raise TaskGone(self.req.pid)

    def gone(self) -> Exception:
        return TaskGone(self.req.pid)

    def cloexec(self, fd: int) -> bool:
        try:
            flags = procfs.fdinfo(fd, self.req.pid).get("flags")
        except OSError:
            return False
        return flags is not None and bool(int(flags, 8) & os.O_CLOEXEC)

    def defer(self, on_cancel: Callable[[], None]) -> _ConnectReply:
        d = self.req.defer()
        d.on_cancel(on_cancel)
        return _ConnectReply(d, self.req.args[0])


class _ConnectReply:
    """A deferred connect's answer (qkernel/sockets.py's ConnectReply)."""

    def __init__(self, deferred: Deferred, fd_arg: int) -> None:
        self.deferred, self.fd = deferred, _s32(fd_arg)

    @property
    def done(self) -> bool:
        return self.deferred.done

    def native(self) -> None:
        self.deferred.complete(Continue())

    def answer(self, err: int) -> None:
        self.deferred.complete(Errno(err) if err else Return(0))

    def install(self, fd: int, cloexec: bool, in_progress: bool) -> None:
        self.deferred.complete(InstallFd(fd, target=self.fd, flags=os.O_CLOEXEC if cloexec else 0, value=0,
                                         errno=errno.EINPROGRESS if in_progress else 0))


# ---- connect ----------------------------------------------------------------------------------

def _connect(req: Request, hooks: SocketHooks):
    fd, addr, addrlen = _fd(req), req.args[1], req.args[2] & 0xFFFFFFFF
    if not 16 <= addrlen <= 128:
        return Continue()
    result = hooks.connect(_Call(req), fd, req.read(addr, min(addrlen, 28)))
    if isinstance(result, _ConnectReply):
        return result.deferred
    return Continue() if result is None else Errno(result)


# ---- addresses and options --------------------------------------------------------------------

def _getname(req: Request, hooks: SocketHooks):
    data = hooks.sockname(_Call(req), _fd(req), peer=req.name == "getpeername")
    if data is None:
        return Continue()
    try:
        _write_sized(req, req.args[1], req.args[2], data)
    except _Fail as e:
        return Errno(e.errno)
    req.write(req.args[2], struct.pack("i", len(data)))
    return Return(0)


def _getsockopt(req: Request, hooks: SocketHooks):
    value = hooks.getsockopt(_Call(req), _fd(req), _s32(req.args[1]), _s32(req.args[2]))
    if value is None:
        return Continue()
    if isinstance(value, int):
        return Errno(value)
    try:
        n = _write_sized(req, req.args[3], req.args[4], value)
    except _Fail as e:
        return Errno(e.errno)
    req.write(req.args[4], struct.pack("i", n))
    return Return(0)


def _setsockopt(req: Request, hooks: SocketHooks):
    level, opt, optlen = _s32(req.args[1]), _s32(req.args[2]), req.args[4] & 0xFFFFFFFF

    def value() -> bytes:
        return req.read(req.args[3], min(optlen, _MAX_OPT)) if optlen else b""

    return _errno_or_return(hooks.setsockopt(_Call(req), _fd(req), level, opt, value))


# ---- listeners --------------------------------------------------------------------------------

def _listen(req: Request, hooks: SocketHooks):
    return _errno_or_return(hooks.listen(_Call(req), _fd(req), _s32(req.args[1])))


def _shutdown(req: Request, hooks: SocketHooks):
    """Trapped only with tsord's sockmap path (qkernel/table.py): the hooks may shut the socket down
    themselves and answer once its FIN is acknowledged (a ConnectReply's `answer`)."""
    result = hooks.shutdown(_Call(req), _fd(req), _s32(req.args[1]))
    return result.deferred if isinstance(result, _ConnectReply) else _errno_or_return(result)


def _accept(req: Request, hooks: SocketHooks):
    fd = _fd(req)
    call = _Call(req)
    lst = hooks.listener(call, fd)
    if lst is None:
        return Continue()
    flags = _s32(req.args[3]) if req.name == "accept4" else 0
    if flags & ~(socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC):
        return Errno(errno.EINVAL)
    addr, lenp = req.args[1], req.args[2]
    if addr and lenp and struct.unpack("i", req.read(lenp, 4))[0] < 0:
        return Errno(errno.EINVAL)
    s = hooks.listener_socket(call, fd, lst)
    if s is None:
        return Continue()
    waiter = _Accept(req, hooks, lst, s, flags, addr, lenp)
    answer = waiter.try_accept()
    if answer is not None:
        return answer
    if fcntl.fcntl(s.fileno(), fcntl.F_GETFL) & os.O_NONBLOCK:
        s.close()
        return Errno(errno.EAGAIN)
    return waiter.wait()


class _Accept:
    """One accept() on an announced listener, answered now or when the listener becomes readable."""

    def __init__(self, req: Request, hooks: SocketHooks, lst: object, sock: socket.socket, flags: int,
                 addr: int, lenp: int) -> None:
        self.req, self.hooks, self.lst, self.sock = req, hooks, lst, sock
        self.flags, self.addr, self.lenp = flags, addr, lenp
        self.deferred: Deferred | None = None
        self._fd: int | None = None
        self._unwait: Callable[[], None] | None = None

    def wait(self) -> Deferred:
        d = self.deferred = self.req.defer()
        self._fd = self.sock.fileno()
        self.req.kernel.loop.add_reader(self._fd, self._ready)
        # a TSoR connection for this listener comes straight here, without a doorbell to accept
        self._unwait = self.hooks.accept_waiting(self.lst, self._deliver)
        d.on_cancel(self._stop)
        sec, usec = struct.unpack("qq", self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16))
        if sec or usec:   # the listener's SO_RCVTIMEO bounds a blocking accept (EAGAIN), as in Linux
            self.req.kernel.loop.call_later(sec + usec / 1e6, self._timeout)
        return d

    def _timeout(self) -> None:
        if not self.deferred.done:
            self._stop()
            self.deferred.complete(Errno(errno.EAGAIN))

    def _stop(self) -> None:
        if self._unwait is not None:
            self._unwait()
            self._unwait = None
        if self._fd is not None:
            self.req.kernel.loop.remove_reader(self._fd)
            self._fd = None
        self.sock.close()

    def _deliver(self, conn: int, raw: bytes) -> bool:
        """The hooks' connection for this waiting accept (see SocketHooks.accept_waiting)."""
        d = self.deferred
        if d.done or not self.req.is_valid():
            self._stop()
            return False
        try:
            answer = self._answer(conn, raw)   # owns conn from here, whatever happens
        except TaskGone:
            self._stop()
            return True   # gone meanwhile: the connection went with it
        except MemoryFault:
            answer = Errno(errno.EFAULT)
        except Exception:
            log.exception("TSoR accept for pid %d", self.req.pid)
            answer = Errno(errno.ECONNABORTED)
        self._stop()
        d.complete(answer)
        return True

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
        try:
            got = self.hooks.accept_next(self.lst, self.sock)
        except BaseException:
            self._close_if_immediate()
            raise
        if got is None:
            return None
        if isinstance(got, int):   # accept(2) failed
            self._close_if_immediate()
            return Errno(got)
        try:
            answer = self._answer(*got)
        finally:
            self._close_if_immediate()
        return answer

    def _answer(self, conn: int, raw: bytes):
        """Install `conn` (ours) for this accept, the peer's sockaddr written where the task asked."""
        try:
            os.set_blocking(conn, not bool(self.flags & socket.SOCK_NONBLOCK))
            if self.addr and self.lenp:
                _write_sized(self.req, self.addr, self.lenp, raw)
                self.req.write(self.lenp, struct.pack("i", len(raw)))
        except BaseException as e:
            os.close(conn)
            if isinstance(e, _Fail):
                return Errno(e.errno)
            raise
        return InstallFd(conn, flags=os.O_CLOEXEC if self.flags & socket.SOCK_CLOEXEC else 0)

    def _close_if_immediate(self) -> None:
        if self.deferred is None:
            self.sock.close()


_HANDLERS = {"connect": _connect, "listen": _listen, "accept": _accept, "accept4": _accept,
             "getsockname": _getname, "getpeername": _getname,
             "getsockopt": _getsockopt, "setsockopt": _setsockopt, "shutdown": _shutdown,
             "sendmsg": lambda req, hooks: sys_sendmsg.handle(req, hooks, _Call(req)),
             "sendmmsg": lambda req, hooks: sys_sendmsg.handle(req, hooks, _Call(req))}
