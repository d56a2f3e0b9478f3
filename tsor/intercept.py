"""TSoR's interception policy: what QKernel's trapped socket calls do for a sandbox registered with
tsord. `SocketIntercept` implements qkernel/sockets.py's `SocketHooks` (by shape: tsor imports
nothing of qkernel); the handlers (qkernel/syscalls/sys_socket.py) decode the ABI and answer.

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
accept(4)    on an announced listener: accepts on the supervisor's duplicate; a connection from a
             doorbell's address (SandboxNet.take_bell) is swapped for the queued TSoR connection,
             anything else (a plain TCP peer) is installed as it is.
"""
from __future__ import annotations

import errno
import fcntl
import ipaddress
import logging
import os
import select
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

from qlib.linux import accept4, pidfd_getfd, pidfd_open_thread
from qlib.sockopts import EMULATED_LEVELS, RECORDED_SOCKET_OPTS, UNIX_REFUSED_SOCKET_OPTS
from tsor import kernel_sockets, protocol, sockmap
from tsor.addr import is_loopback, is_unspecified, parse_sockaddr, sockaddr, unmapped
from tsor.sandbox import Listener, Queued, Redirected, SandboxNet

log = logging.getLogger("quark.qkernel")

SOL_SOCKET, SOL_IP, SOL_TCP, SOL_IPV6 = socket.SOL_SOCKET, socket.IPPROTO_IP, socket.IPPROTO_TCP, socket.IPPROTO_IPV6
SO_TYPE, SO_PROTOCOL, SO_DOMAIN = 3, 38, 39
TCP_INFO, TCP_ESTABLISHED, TCP_FIN_WAIT1, TCP_CLOSE = 11, 1, 4, 7
# How long a sockmap-path shutdown waits for its FIN's acknowledgement at most: past a delayed ACK
# (40 ms, the kernel's minimum) with room to spare; how long it takes between two pods is measured in
# bench/README.md ("Half-close on the sockmap path"). Past this the call returns anyway
FIN_ACK_WAIT_S = 0.2
_INET = (socket.AF_INET, socket.AF_INET6)
_MAX_OPT = 512   # as much of an option as is ever read (the handlers read at most as much)
# The send buffer of a local-path (AF_UNIX) end. AF_UNIX stream flow control is the sender's
# SO_SNDBUF alone, and its default (wmem_default, ~208 KiB) holds bulk throughput well below TCP's;
# TCP autotunes its buffer up to tcp_wmem's maximum (4 MiB). 1 MiB (2 MiB once the kernel doubles
# it) gets most of the gain and bounds what one connection can pin in kernel memory. An
# application that sets SO_SNDBUF itself (before or after connect) gets its own value.
LOCAL_SNDBUF = 1 << 20
# SOL_SOCKET options Linux refuses on AF_UNIX (EOPNOTSUPP) but accepts on TCP.
_UNIX_REFUSES = set(UNIX_REFUSED_SOCKET_OPTS)
# Options set before connect() that travel to the socket that replaces the TCP one.
_CARRY = [(SOL_TCP, socket.TCP_NODELAY), (SOL_TCP, socket.TCP_KEEPIDLE), (SOL_TCP, socket.TCP_KEEPINTVL),
          (SOL_TCP, socket.TCP_KEEPCNT), (SOL_TCP, 18), (SOL_TCP, 25), (SOL_TCP, 13),
          (SOL_IP, socket.IP_TOS), (SOL_IP, socket.IP_TTL),
          (SOL_IPV6, 67), (SOL_IPV6, 16), (SOL_IPV6, socket.IPV6_V6ONLY),
          (SOL_SOCKET, socket.SO_KEEPALIVE), (SOL_SOCKET, socket.SO_LINGER), (SOL_SOCKET, socket.SO_PRIORITY),
          (SOL_SOCKET, socket.SO_RCVTIMEO), (SOL_SOCKET, socket.SO_SNDTIMEO), (SOL_SOCKET, socket.SO_OOBINLINE),
          (SOL_SOCKET, socket.SO_REUSEADDR), (SOL_SOCKET, socket.SO_REUSEPORT)]

_CARRY_ALL = ((SOL_SOCKET, socket.SO_SNDBUF), (SOL_SOCKET, socket.SO_RCVBUF), *_CARRY)


# TCP options whose value is an int read back as 0/1 (tcp_setsockopt/tcp_getsockopt): TCP_NODELAY, TCP_CORK.
_BOOLEAN_KEYS = ((SOL_TCP, socket.TCP_NODELAY), (SOL_TCP, socket.TCP_CORK))   # the order qfp_add takes
_BOOLEAN = set(_BOOLEAN_KEYS)

# The trapped call and the deferred connect answer, as qkernel/sockets.py describes them
# (TrappedCall, ConnectReply); typed loosely here so that tsor runs without qkernel.
Call = Any
Reply = Any


class _Native(Exception):
    pass


class SocketIntercept:
    """The socket hooks of one sandbox registered with tsord (its `SandboxNet`)."""

    def __init__(self, net: SandboxNet) -> None:
        self.net = net
        self._templates: dict[int, socket.socket] = {}
        self._default_opts: dict[int, dict[tuple[int, int], bytes | int]] = {}
        self._unix_same: frozenset[tuple[int, int]] | None = None
        # QKernel's compiled option table (qkernel/fastpath.py), when it has one: TCP_NODELAY and
        # TCP_CORK of local-path sockets live there, so the per-request calls never reach Python
        self.fast: Any = None
        self._tabled: set[int] = set()
        # AF_UNIX ends whose TCP_NODELAY/TCP_CORK the kernel answers (tsor/sockopt_offload.py): the
        # values live in each socket's own BPF storage
        self._offloaded: set[int] = set()
        self._ends: set[int] = set()   # local-path ends in the fast path's table of ends
        net.on_forget = self._forget

    @property
    def offload(self) -> Any:
        return self.net.offload

    @property
    def traps_sockets(self) -> bool:
        """False with tsord's sockmap local path: the kernel carries the sandbox's connections and
        nothing of the socket family is trapped (tsor/sockmap.py)."""
        return self.net.local_path != "sockmap"

    def use_option_table(self, table: Any) -> None:
        self.fast = table
        for ino, st in self.net.sockets.items():
            self._to_table(ino, st)

    def _to_table(self, ino: int, st: Redirected, sock: socket.socket | None = None) -> None:
        """Where TCP_NODELAY/TCP_CORK of a new local-path end live from now on: the kernel's map
        (offload), QKernel's compiled table, or (neither) the record."""
        if st.real_family != socket.AF_UNIX:
            return
        if self.fast is not None and self.fast.end_add(ino):
            self._ends.add(ino)   # its sendmsg calls with a control buffer reach Python (the rest: not)
        nodelay, cork = (struct.unpack_from("i", st.opts.get(key, b"\0\0\0\0"))[0] for key in _BOOLEAN_KEYS)
        if self.net.offload is not None and sock is not None:
            # the kernel's programs answer these on this end (the filter traps neither any more)
            self.net.offload.carry(sock, bool(nodelay), bool(cork))
            self._offloaded.add(ino)
        elif not (self.fast is not None and self.fast.add(ino, nodelay, cork)):
            return
        else:
            self._tabled.add(ino)
        for key in _BOOLEAN_KEYS:
            st.opts.pop(key, None)

    def _forget(self, ino: int) -> None:
        if ino in self._ends:
            self._ends.discard(ino)
            self.fast.end_remove(ino)
        if ino in self._tabled:
            self._tabled.discard(ino)
            self.fast.remove(ino)
        self._offloaded.discard(ino)   # (the values went with the socket's own storage)

    @classmethod
    def attach(cls, loop, sandbox: str, init_pid: int, pids: Callable[[], list[int]],
               annotations: dict[str, str]) -> SocketIntercept | None:
        """TSoR for a new sandbox, or None when it cannot apply (no tsord socket, host network)."""
        net = SandboxNet.attach(loop, sandbox, init_pid, pids, annotations)
        return cls(net) if net is not None else None

    def close(self) -> None:
        self.net.close()

    # ---- sendmsg (qkernel/syscalls/sys_sendmsg.py) ----------------------------------------------
    @property
    def ends_refuse_rights(self) -> bool:
        return kernel_sockets.passrights_supported()

    def local_end(self, call: Call, fd: int) -> socket.socket | None:
        ino, st = self._redirected(call, fd)
        if st is None or st.real_family != socket.AF_UNIX:
            return None
        return _dup(call, fd, socket.AF_UNIX)

    # ---- shutdown (the sockmap path only) -----------------------------------------------------
    def shutdown(self, call: Call, fd: int, how: int) -> int | Reply | None:
        """shutdown(SHUT_WR/SHUT_RDWR) of a connection the sockmap path carries returns once the
        peer has acknowledged its FIN: that acknowledgement wakes the socket's readers, and the
        kernel's sockmap receive path answers a reader it wakes with no data EAGAIN, even a blocking
        one (tsor/sockmap.py, "Half-close"). Waiting here moves the wake-up before the next read.
        Whether the end is carried only tsord can say (the supervisor has no bpf(2)): asked only
        when the FIN is still unacknowledged once the socket is shut down."""
        if self.traps_sockets:
            return None
        s = _dup(call, fd)
        if s is None:
            return None
        try:
            if not _is_tcp(s):
                return None
            try:
                s.shutdown(how)
            except OSError as e:
                return e.errno
            end = sockmap.end_of(s)
            if _tcp_state(s) != TCP_FIN_WAIT1 or end is None or not self.net.client.up:
                return 0
            waiter = _FinAcked(self.net.loop, s)
            s = None                               # the waiter owns it now
            reply = waiter.start(call)
            self.net.client.request(protocol.Carried(*end), waiter.carried)
            return reply
        finally:
            if s is not None:
                s.close()

    # ---- connect ------------------------------------------------------------------------------
    def connect(self, call: Call, fd: int, addr: bytes) -> int | Reply | None:
        net = self.net
        parsed = parse_sockaddr(addr)
        if parsed is None:
            return None
        fam, (ip, port) = parsed
        ip = unmapped(ip)
        if port == 0 or is_loopback(ip) or is_unspecified(ip) or _is_multicast(ip):
            return None   # the pod's own loopback never leaves the pod
        ino = _inode(call, fd) if net.sockets else None
        if ino is not None and ino in net.sockets:
            call.check()
            return errno.EISCONN   # a redirected socket is connected (the AF_UNIX end would say EINVAL)
        if not net.client.up or not net.addrs:
            # tsord is not there (yet, or any more), or the sandbox registered no address to connect
            # from (tsord would answer fallback): native, without a round trip
            return None
        if net.known_native((ip, port)):
            return None   # tsord said so for this address, and nothing it decides by has changed
        if ino is None:
            ino = _inode(call, fd)
            if ino is None:
                return None
        s = _dup(call, fd)
        if s is None:
            return None
        try:
            if not _is_tcp(s) or s.family != fam or _tcp_state(s) != TCP_CLOSE:
                raise _Native   # UDP (DNS), a connected socket, ...: native, before any /proc scan
            if s.family == socket.AF_INET6 and ":" not in ip and s.getsockopt(SOL_IPV6, socket.IPV6_V6ONLY):
                raise _Native
            if (self.fast.held_elsewhere(call.pid, fd, ino) if self.fast is not None
                    else kernel_sockets.held_elsewhere(call.pid, fd, ino)):
                # dup'ed or already in an epoll set (nginx registers before connect): swapping the
                # socket would leave those references on the old one, so this connection stays native
                raise _Native
            src_port = s.getsockname()[1]
            if src_port == 0:   # the peer sees a real port: take an ephemeral one from the pod's kernel
                s.bind(("::" if s.family == socket.AF_INET6 else "0.0.0.0", 0))
                src_port = s.getsockname()[1]
            nonblock = bool(fcntl.fcntl(s.fileno(), fcntl.F_GETFL) & os.O_NONBLOCK)
            cloexec = call.cloexec(fd)
            call.check()
        except (_Native, OSError):
            s.close()
            return None
        d = call.defer(s.close)
        net.connect((ip, port), src_port, lambda reply, fds: self._connected(call, d, s, fd, ino, (ip, port),
                                                                             nonblock, cloexec, reply, fds))
        return d

    def _connected(self, call: Call, d: Reply, old: socket.socket, fd: int, ino: int, dst,
                   nonblock: bool, cloexec: bool, reply: dict | None, fds: list[int]) -> bool:
        """Install the connection tsord (or a direct channel) gave; False when the task does not get it."""
        for extra in fds[1:]:
            os.close(extra)
        new = fds[0] if fds else None
        try:
            if d.done:   # the task was interrupted or died meanwhile
                return False
            if (not reply or reply.get("path") not in ("local", "tcp", "rdma") or new is None
                    or kernel_sockets.socket_inode(call.pid, fd) != ino):   # fd closed or reused meanwhile
                d.native()
                return False
            os.set_blocking(new, not nonblock)
            # a local-path end is known to be AF_UNIX: saying so spares the three getsockopt calls
            # with which socket() finds out (a connection costs the supervisor a few dozen syscalls;
            # each counts: bench/README.md, "Set-up path trimmed")
            sock = (socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, 0, new) if reply["path"] == "local"
                    else socket.socket(fileno=new))
            try:
                state = Redirected(family=old.family, local=(reply["src"][0], reply["src"][1]), peer=dst,
                                   path=reply["path"], real_family=sock.family)
                self._carry_options(old, sock, state)
                ino_new = os.fstat(new).st_ino
                self._to_table(ino_new, state, sock)
                self.net.redirected(ino_new, state)
            finally:
                sock.detach()
            new, handed = None, new
            d.install(handed, cloexec, nonblock)
            return True
        except Exception:
            log.exception("TSoR connect for pid %d", call.pid)
            if not d.done:
                d.native()
            return False
        finally:
            if new is not None:
                os.close(new)
            old.close()

    def _carry_options(self, old: socket.socket, new: socket.socket, state: Redirected) -> None:
        """Options the application set before connect() hold on the socket that replaces its TCP one.
        On the local path an option still at TCP's default needs nothing: the record answers it from
        the template, and a fresh AF_UNIX end already holds the same value (`_same_on_unix`)."""
        default = self._defaults(old.family)
        values = self._read_carried(old)
        for opt, own in zip((socket.SO_SNDBUF, socket.SO_RCVBUF), values):   # the application's, or TCP's default?
            own = struct.unpack("i", own)[0]
            if own != default[(SOL_SOCKET, opt)]:
                new.setsockopt(SOL_SOCKET, opt, own // 2)   # the kernel doubles what it is given
            elif opt == socket.SO_SNDBUF and new.family == socket.AF_UNIX:
                new.setsockopt(SOL_SOCKET, opt, LOCAL_SNDBUF)
        local = new.family == socket.AF_UNIX
        for (level, opt), value in zip(_CARRY, values[2:]):
            if value is None:
                continue   # e.g. IPV6 options of an AF_INET socket
            emulated = _emulated(state, level, opt)
            if local and value == default.get((level, opt)) and (emulated or (level, opt) in self._same_on_unix()):
                continue
            if emulated:
                state.opts[(level, opt)] = value
                continue
            try:
                if new.getsockopt(level, opt, 64) != value:
                    new.setsockopt(level, opt, value)
            except OSError:
                state.opts[(level, opt)] = value

    def _read_carried(self, old: socket.socket) -> list[bytes | None]:
        """SO_SNDBUF, SO_RCVBUF, then every option of _CARRY, of the connecting socket: in one call
        of the compiled fast path when there is one (22 getsockopt calls through Python were a
        noticeable share of a connect's supervisor time; measured with other cuts: bench/README.md,
        "Set-up path trimmed")."""
        if self.fast is not None:
            return self.fast.sockopts(old.fileno(), _CARRY_ALL)
        values = []
        for level, opt in _CARRY_ALL:
            try:
                values.append(old.getsockopt(level, opt, 64))
            except OSError:
                values.append(None)
        return values

    # ---- addresses and options of redirected sockets ------------------------------------------
    def _redirected(self, call: Call, fd: int) -> tuple[int | None, Redirected | None]:
        """The socket inode at the task's fd and its TSoR state (None: not a redirected socket)."""
        if not self.net.sockets:
            return None, None
        ino = _inode(call, fd)
        return ino, self.net.sockets.get(ino) if ino is not None else None

    def sockname(self, call: Call, fd: int, peer: bool) -> bytes | None:
        _, st = self._redirected(call, fd)
        if st is None:
            return None
        return sockaddr(st.family, st.peer if peer else st.local)

    def _defaults(self, family: int) -> dict[tuple[int, int], bytes | int]:
        """TCP's default of every option connect() carries over, for `family` (read once)."""
        if family not in self._default_opts:
            t, found = self._template(family), {}
            for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                found[(SOL_SOCKET, opt)] = t.getsockopt(SOL_SOCKET, opt)
            for level, opt in _CARRY:
                try:
                    found[(level, opt)] = t.getsockopt(level, opt, 64)
                except OSError:
                    pass
            self._default_opts[family] = found
        return self._default_opts[family]

    def _same_on_unix(self) -> frozenset[tuple[int, int]]:
        """The carried SOL_SOCKET options whose default on a fresh AF_UNIX stream end is TCP's."""
        if self._unix_same is None:
            a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            with a, b:
                tcp = self._defaults(socket.AF_INET)
                same = set()
                for level, opt in _CARRY:
                    try:
                        if level == SOL_SOCKET and a.getsockopt(level, opt, 64) == tcp.get((level, opt)):
                            same.add((level, opt))
                    except OSError:
                        pass
            self._unix_same = frozenset(same)
        return self._unix_same

    def _template(self, family: int) -> socket.socket:
        """A pristine TCP socket of `family` in the pod's network namespace: the defaults to answer."""
        if family not in self._templates:
            self._templates[family] = kernel_sockets.socket_in_netns(self.net.netns_fd, family)
        return self._templates[family]

    def getsockopt(self, call: Call, fd: int, level: int, opt: int) -> bytes | int | None:
        ino, st = self._redirected(call, fd)
        if st is None:
            return None
        if (level, opt) in _BOOLEAN:
            if ino in self._offloaded:
                return None   # the kernel's program answers (a filter without the offload traps it)
            value = self.fast.get(ino, opt) if ino in self._tabled else None
            if value is not None:
                return struct.pack("i", value)
        if not _emulated(st, level, opt) and (level, opt) not in st.opts:
            return None
        if level == SOL_SOCKET and opt in (SO_DOMAIN, SO_TYPE, SO_PROTOCOL):
            return struct.pack("i", {SO_DOMAIN: st.family, SO_TYPE: socket.SOCK_STREAM,
                                     SO_PROTOCOL: socket.IPPROTO_TCP}[opt])
        if (level, opt) in st.opts:
            return st.opts[(level, opt)]
        try:
            value = self._template(st.family).getsockopt(level, opt, _MAX_OPT)
        except OSError as e:
            return e.errno
        if level == SOL_TCP and opt == TCP_INFO:
            value = bytes([TCP_ESTABLISHED]) + value[1:]
        return value

    def setsockopt(self, call: Call, fd: int, level: int, opt: int, value: Callable[[], bytes]) -> int | None:
        ino, st = self._redirected(call, fd)
        if st is None:
            return None
        if not _emulated(st, level, opt):
            st.opts.pop((level, opt), None)   # the real socket holds it from now on
            return None
        if level == SOL_SOCKET and opt in (SO_DOMAIN, SO_TYPE, SO_PROTOCOL):
            return errno.ENOPROTOOPT   # read-only, as on any socket
        given = value()
        if (level, opt) in _BOOLEAN:
            # the per-request ones (nginx corks and uncorks around every response): TCP's own check
            # and normalisation, without a scratch socket
            if len(given) < 4:
                return errno.EINVAL
            on = bool(struct.unpack_from("i", given)[0])
            if ino in self._offloaded:
                return None   # the kernel's program records it (trapped only for a short optlen: EINVAL above)
            if not (ino in self._tabled and self.fast.set(ino, opt, on)):
                st.opts[(level, opt)] = struct.pack("i", int(on))
            return 0
        # A real TCP socket of the same family checks the value and normalises it (booleans to 0/1,
        # IP_TOS without its ECN bits, the congestion control's name, ...).
        scratch = socket.socket(st.family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        with scratch:
            try:
                scratch.setsockopt(level, opt, given)
            except OSError as e:
                return e.errno
            try:
                given = scratch.getsockopt(level, opt, max(len(given), 64))
            except OSError:
                pass   # write-only options: keep what was given
        st.opts[(level, opt)] = given
        return 0

    # ---- listeners ----------------------------------------------------------------------------
    def listen(self, call: Call, fd: int, backlog: int) -> int | None:
        ino = _inode(call, fd)
        if ino is None:
            return None
        if ino in self.net.sockets:
            call.check()
            return errno.EINVAL   # listen() on a connected TCP socket
        s = _dup(call, fd)
        if s is None:
            return None
        with s:
            if not _is_tcp(s) or is_loopback(s.getsockname()[0]):
                return None
            try:
                s.listen(max(backlog, 0))   # the socket the application holds: the call itself
            except OSError as e:
                return e.errno
            ip, port = s.getsockname()[:2]
            v6only = s.family == socket.AF_INET6 and bool(s.getsockopt(SOL_IPV6, socket.IPV6_V6ONLY))
            # a listener's TCP_INFO says its effective backlog in tcpi_sacked (sk_max_ack_backlog)
            backlog = struct.unpack_from("I", s.getsockopt(SOL_TCP, TCP_INFO, 32), 28)[0]
            self.net.listen(Listener(token=os.fstat(s.fileno()).st_ino, family=s.family,
                                     local=(unmapped(ip), port), v6only=v6only, pid=call.pid, fd=fd,
                                     backlog=backlog))
        return 0

    def listener(self, call: Call, fd: int) -> Listener | None:
        if not self.net.listeners:
            return None
        ino = _inode(call, fd)
        return self.net.listeners.get(ino) if ino is not None else None

    def listener_socket(self, call: Call, fd: int, listener: Listener) -> socket.socket | None:
        s = _dup(call, fd, listener.family)
        if s is None:
            return None
        if os.fstat(s.fileno()).st_ino != listener.token:
            s.close()
            return None
        return s

    def accept_next(self, listener: Listener, sock: socket.socket) -> tuple[int, bytes] | int | None:
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        if not poller.poll(0):
            return None
        # Only trapped accepts (all of them come here) take from this queue, so it cannot be empty.
        try:
            conn, raw = accept4(sock.fileno())
        except BlockingIOError:
            return None
        except OSError as e:
            return e.errno
        try:
            peer = parse_sockaddr(raw)
            queued = self.net.take_bell(peer[1]) if peer is not None else None
            if queued is not None:   # a doorbell: the application gets the TSoR connection
                os.close(conn)
                conn = queued.fd
                raw = self._adopt(listener, queued)
        except BaseException:
            os.close(conn)
            raise
        return conn, raw

    def accept_waiting(self, listener: Listener, deliver: Callable[[int, bytes], bool]) -> Callable[[], None]:
        def take(queued: Queued) -> bool:
            try:
                raw = self._adopt(listener, queued)
            except OSError:
                return False
            return deliver(queued.fd, raw)
        return self.net.accept_waiting(listener.token, take)

    def _adopt(self, listener: Listener, queued: Queued) -> bytes:
        """Make the queued TSoR connection one of the application's redirected sockets; the
        sockaddr its accept() answers."""
        real = (socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, 0, queued.fd) if queued.path == "local"
                else socket.socket(fileno=queued.fd))
        try:
            if real.family == socket.AF_UNIX:
                real.setsockopt(SOL_SOCKET, socket.SO_SNDBUF, LOCAL_SNDBUF)
            state = Redirected(family=listener.family, local=queued.local, peer=queued.peer,
                               path=queued.path, real_family=real.family)
            ino_new = os.fstat(queued.fd).st_ino
            self._to_table(ino_new, state, real)
            self.net.redirected(ino_new, state)
        finally:
            real.detach()
        return sockaddr(listener.family, queued.peer)


class _FinAcked:
    """Answers a deferred shutdown once `sock` leaves FIN_WAIT1 (its FIN acknowledged) — polling
    TCP_INFO on the loop, from 0.1 ms doubling to 10 ms, as the state change has no poll event —
    or after FIN_ACK_WAIT_S; at once when tsord says the end is not carried (or is away). A signal
    meanwhile interrupts the wait as it would any blocking call: the socket is already shut down,
    and shutdown again (a restart) is a no-op that returns 0."""

    def __init__(self, loop, sock: socket.socket) -> None:
        self.loop, self.sock, self.reply = loop, sock, None
        self.deadline = time.monotonic() + FIN_ACK_WAIT_S
        self.delay = 1e-4

    def start(self, call: Call) -> Reply:
        self.reply = call.defer(self.sock.close)
        return self.reply

    def carried(self, answer: dict | None, fds: list[int]) -> None:
        for fd in fds:
            os.close(fd)
        if answer is not None and answer.get("carried") is True:
            self._check()
        elif not self.reply.done:
            self._finish()

    def _check(self) -> None:
        if self.reply.done:
            return
        try:
            waiting = _tcp_state(self.sock) == TCP_FIN_WAIT1
        except OSError:
            waiting = False
        if waiting and time.monotonic() < self.deadline:
            self.loop.call_later(self.delay, self._check)
            self.delay = min(self.delay * 2, 0.01)
            return
        self._finish()

    def _finish(self) -> None:
        self.sock.close()
        self.reply.answer(0)


# ---- the task's sockets -----------------------------------------------------------------------

def _inode(call: Call, fd: int) -> int | None:
    return kernel_sockets.socket_inode(call.pid, fd) if fd >= 0 else None


def _dup(call: Call, fd: int, family: int | None = None) -> socket.socket | None:
    """Our own duplicate of the task's fd (same open file), as a socket; None if it is not one.
    `family`: what the caller knows it to be (a TCP socket of that family, checked by the caller),
    which spares socket()'s own three getsockopt calls."""
    if fd < 0:
        return None
    try:
        pidfd = pidfd_open_thread(call.pid)
    except OSError as e:
        raise call.gone() from e
    try:
        call.check()   # the pidfd now names the trapped task for good
        try:
            dup = pidfd_getfd(pidfd, fd)
        except OSError:
            return None   # not an fd of the task: the native call answers EBADF
    finally:
        os.close(pidfd)
    try:
        return socket.socket(family, socket.SOCK_STREAM, 0, dup) if family is not None else socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return None


def _is_tcp(s: socket.socket) -> bool:
    return s.family in _INET and s.type == socket.SOCK_STREAM and s.proto in (0, socket.IPPROTO_TCP)


def _is_multicast(ip: str) -> bool:
    return ipaddress.ip_address(ip).is_multicast


def _tcp_state(s: socket.socket) -> int:
    return s.getsockopt(SOL_TCP, TCP_INFO, 8)[0]


def _emulated(st: Redirected, level: int, opt: int) -> bool:
    """Is (level, opt) answered from the record rather than by the socket underneath?"""
    if level == SOL_SOCKET:
        return opt in RECORDED_SOCKET_OPTS or (st.real_family == socket.AF_UNIX and opt in _UNIX_REFUSES)
    if st.real_family == socket.AF_UNIX:
        return level in EMULATED_LEVELS
    return level == SOL_IPV6 and st.family == socket.AF_INET6 and st.real_family != socket.AF_INET6
