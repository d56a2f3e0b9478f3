"""The sandbox's side of TSoR: its connection to tsord and the state QKernel's socket handlers keep.

`SandboxNet` lives in the supervisor, on its single-threaded event loop. It knows, by socket inode
(the identity every dup, fork and SCM_RIGHTS copy shares), which of the application's sockets were
redirected and the TCP addresses and options they must answer with, and which sockets listen, so
that connections tsord offers reach the application's accept() (see `Listener`).

tsord may be absent, killed or restarted at any time: every request then gets `None` (the caller
connects natively), and the client reconnects and re-announces its listeners once tsord is back.
"""
from __future__ import annotations

import errno
import itertools
import logging
import os
import socket
import struct
from dataclasses import dataclass, field
from typing import Callable

from tsor import DEFAULT_SOCKET, SOCKET_ANNOTATION, kernel_sockets, local_path_marker, protocol, sockopt_offload
from tsor.addr import Endpoint, family_of, unmapped
from tsor.errors import ProtocolError
from tsor.peers import FULL, OVER, PeerLinks
from tsor.sockopt_offload import Offload

log = logging.getLogger("quark.tsor")
RECONNECT_S = 1.0
HELLO_TIMEOUT_S = 1.0
SWEEP_S = 5.0
SWEEP_BATCH = 256   # fds looked at per turn of the loop: a turn stays short however many the sandbox holds
_LINGER_RESET = struct.pack("ii", 1, 0)
BELL_BATCH = 16   # doorbell sockets made ahead per setns into the pod

Reply = Callable[[dict | None, list[int]], None]


class TsordClient:
    """The supervisor's connection to tsord, driven by the supervisor's event loop."""

    def __init__(self, loop, path: str, hello: protocol.Hello,
                 on_incoming: Callable[[protocol.Incoming, int], bool],
                 on_up: Callable[[], None],
                 on_peer: Callable[[protocol.Peer, int], bool] | None = None,
                 on_down: Callable[[], None] | None = None) -> None:
        self.loop, self.path, self.hello = loop, path, hello
        self.on_incoming, self.on_up, self.on_peer, self.on_down = on_incoming, on_up, on_peer, on_down
        self.generation_fd: int | None = None   # tsord's route generation page, from its hello answer
        self.sock: socket.socket | None = None
        self.node = ""
        self._ids = 0
        self._waiting: dict[int, Reply] = {}
        self._retrying = False
        self._closed = False
        self._hello: socket.socket | None = None   # registering: sent our hello, awaiting the answer
        self.refusal: str | None = None              # tsord's last answer refusing us

    @property
    def up(self) -> bool:
        return self.sock is not None

    def start(self) -> None:
        """Connect and register. Nothing here waits: the loop also answers the sandbox's trapped
        syscalls, so a tsord that is slow or wedged must never hold it. The answer to our hello comes
        through the loop (`_hello_answer`), or `_hello_timeout` gives up on it; either way requests
        get None (native connects) until we are registered, and we try again every RECONNECT_S."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        try:
            s.connect(self.path)   # AF_UNIX: done at once, or EAGAIN while tsord's backlog is full
            protocol.send(s, protocol.encode(0, self.hello))
        except OSError as e:
            s.close()
            log.debug("tsord at %s not reachable: %s", self.path, e)
            return self._retry_later()
        self._hello = s
        self.loop.add_reader(s.fileno(), lambda: self._hello_answer(s))
        self.loop.call_later(HELLO_TIMEOUT_S, lambda: self._hello_timeout(s))

    def _hello_answer(self, s: socket.socket) -> None:
        try:
            data, fds = protocol.recv(s)
        except BlockingIOError:
            return
        except (OSError, ProtocolError) as e:
            data, fds = b"", []
            log.debug("tsord at %s: %s", self.path, e)
        self._end_hello(s)
        try:
            _, answer = protocol.decode(data) if data else (0, {"error": "tsord closed the connection"})
        except ProtocolError as e:
            answer = {"error": f"malformed answer: {e}"}
        if isinstance(answer, dict) and answer.get("ok") and answer.get("direct") is True and fds:
            self.generation_fd = fds.pop(0)
        for fd in fds:
            os.close(fd)
        if not isinstance(answer, dict) or not answer.get("ok"):
            s.close()
            self.refusal = str(answer.get("error") if isinstance(answer, dict) else answer)
            log.warning("tsord refused sandbox %s: %s", self.hello.sandbox, self.refusal)
            return self._retry_later()
        self.sock, self.node, self.refusal = s, answer.get("node", ""), None
        self.loop.add_reader(s.fileno(), self._readable)
        log.info("sandbox %s registered with tsord (node %s)", self.hello.sandbox, self.node)
        self.on_up()

    def _hello_timeout(self, s: socket.socket) -> None:
        if self._hello is not s:
            return   # answered (or closed) in time
        self._end_hello(s)
        s.close()
        log.warning("tsord at %s did not answer sandbox %s's registration in %.0fs; connecting natively "
                    "meanwhile", self.path, self.hello.sandbox, HELLO_TIMEOUT_S)
        self._retry_later()

    def _end_hello(self, s: socket.socket) -> None:
        self.loop.remove_reader(s.fileno())
        self._hello = None

    def take_generation(self) -> int | None:
        """The route generation page tsord shared at registration (the caller closes it), or None."""
        fd, self.generation_fd = self.generation_fd, None
        return fd

    def close(self) -> None:
        self._closed = True
        if self._hello is not None:
            s = self._hello
            self._end_hello(s)
            s.close()
        self._down()

    def request(self, message: object, on_reply: Reply) -> None:
        """Send a request; `on_reply(reply, fds)` runs from the loop, with None if tsord went away."""
        if self.sock is None:
            return on_reply(None, [])
        self._ids += 1
        try:
            protocol.send(self.sock, protocol.encode(self._ids, message))
        except OSError:
            self._down()
            return on_reply(None, [])
        self._waiting[self._ids] = on_reply

    def notify(self, message: object) -> None:
        """Send a record tsord does not answer (a tally); dropped while tsord is away."""
        if self.sock is not None:
            try:
                protocol.send(self.sock, protocol.encode(0, message))
            except OSError:
                self._down()

    def _readable(self) -> None:
        try:
            for mid, msg, fds in protocol.received(self.sock, "tsord"):
                self._record(mid, msg, fds)
                if self.sock is None:   # the record's handling lost the connection
                    return
        except protocol.Closed as e:
            if str(e):
                log.warning("tsord connection: %s", e)
            else:
                log.info("tsord went away; connecting natively until it is back")
            self._down()

    def _record(self, mid: int, msg: object, fds: list[int]) -> None:
        if isinstance(msg, dict):
            cb = self._waiting.pop(mid, None)
            if cb is not None:
                return cb(msg, fds)
            for fd in fds:
                os.close(fd)
            return
        # tsord's requests: a connection for a listener of ours, a channel from another sandbox
        handler = {protocol.Incoming: self.on_incoming, protocol.Peer: self.on_peer}.get(type(msg))
        if handler is None or not fds:
            for fd in fds:
                os.close(fd)
            return self._send_reply(protocol.reply(mid, error="unexpected request"))
        for extra in fds[1:]:
            os.close(extra)
        ok = handler(msg, fds[0])
        os.close(fds[0])
        # FULL: the listener's backlog of queued connections is full (tsord counts it, then native)
        self._send_reply(protocol.reply(mid, ok=ok is True, **({"full": True} if ok == FULL else {})))

    def _send_reply(self, data: bytes) -> None:
        try:
            protocol.send(self.sock, data)
        except OSError:
            self._down()

    def _down(self) -> None:
        if self.sock is not None:
            self.loop.remove_reader(self.sock.fileno())
            self.sock.close()
            self.sock = None
        waiting, self._waiting = self._waiting, {}
        for cb in waiting.values():
            cb(None, [])
        if self.on_down is not None:
            self.on_down()
        self._retry_later()

    def _retry_later(self) -> None:
        if not self._closed and not self._retrying:
            self._retrying = True
            self.loop.call_later(RECONNECT_S, self._retry)

    def _retry(self) -> None:
        self._retrying = False
        if not (self._closed or self.sock is not None or self._hello is not None):
            self.start()


@dataclass
class Redirected:
    """A socket the application holds whose TCP connection TSoR carries."""
    family: int              # what the application created: AF_INET or AF_INET6
    local: Endpoint
    peer: Endpoint
    path: str                # local | tcp
    real_family: int         # of the socket underneath: AF_UNIX (local) or the nodes' AF_INET/6
    opts: dict[tuple[int, int], bytes] = field(default_factory=dict)   # recorded TCP/IP options


@dataclass
class Queued:
    fd: int                  # our end of the TSoR connection, until accept() installs it
    peer: Endpoint
    local: Endpoint
    path: str
    bell: socket.socket | None = None   # the doorbell connection that made the listener readable
    token: int = 0                      # the listener's


# past a listener's backlog, over a direct channel (whose client gave the application its
# connection already) an offer is still taken, up to DIRECT_SLACK more (OVER, tsor/peers.py)
DIRECT_SLACK = 1024


@dataclass
class Listener:
    """A listening TCP socket of the application. It stays a real socket on the pod's address, so
    plain TCP peers reach it; a TSoR connection is queued here and a *doorbell* (a real loopback-
    style connection to the listener from inside the pod's netns) makes it readable. The trapped
    accept() accepts on our dup, recognises a doorbell by its source address and installs the
    queued connection instead."""
    token: int               # inode
    family: int
    local: Endpoint
    v6only: bool
    pid: int                 # where it was seen, to check it is still open cheaply
    fd: int
    # the kernel's effective backlog (listen's, capped at the namespace's somaxconn): at most this
    # many + 1 TSoR connections wait in its queue, as the kernel holds its accept queue to
    backlog: int = 4096


def _local_path(tsord_socket: str) -> str:
    """What tsord says of its local path, in the file beside its socket (tsor/daemon.py)."""
    try:
        with open(local_path_marker(tsord_socket)) as f:
            return "sockmap" if f.read().strip() == "sockmap" else "socketpair"
    except FileNotFoundError:
        return "socketpair"


class SandboxNet:
    """TSoR state of one sandbox (the supervisor holds one, QKernel's handlers use it)."""

    def __init__(self, loop, sandbox: str, init_pid: int, pids: Callable[[], list[int]],
                 path: str = DEFAULT_SOCKET, offload: Offload | None = None, local_path: str = "socketpair") -> None:
        self.loop, self.init_pid, self.pids = loop, init_pid, pids
        # "sockmap": tsord runs the trap-free local path (tsor/sockmap.py); we only register, so that
        # tsord puts our addresses in the programs' map, and the filter traps no socket call
        self.local_path = local_path
        # the kernel answers TCP_NODELAY/TCP_CORK of our local-path ends (tsor/sockopt_offload.py);
        # tsord is told, so that it gives us only ends made where the program covers them
        self.offload = offload
        self.addrs = sorted(kernel_sockets.netns_addresses(init_pid))
        self.netns_fd = os.open(f"/proc/{init_pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        self.sockets: dict[int, Redirected] = {}
        self.listeners: dict[int, Listener] = {}
        self.bells: dict[Endpoint, Queued] = {}
        self._spare_bells: dict[int, list[socket.socket]] = {}   # by family: made ahead in the pod
        # blocking accepts waiting on a listener (by token), oldest first: they take a TSoR
        # connection directly, with no doorbell to ring and accept
        self._accepting: dict[int, list[Callable[[Queued], bool]]] = {}
        hello = protocol.Hello(sandbox, init_pid, self.addrs, direct=True, offload=offload is not None)
        self.client = TsordClient(loop, path, hello, self._incoming, self._up, self._serve_peer, self._tsord_down)
        # direct channels to the other sandboxes' listeners on this node (tsor/peers.py)
        self.peers = PeerLinks(loop, self.addrs, self._incoming_direct, self.client.notify)
        self._sweeping = False

    @classmethod
    def attach(cls, loop, sandbox: str, init_pid: int, pids: Callable[[], list[int]],
               annotations: dict[str, str]) -> "SandboxNet | None":
        """TSoR for a new sandbox, or None when it cannot apply (no tsord socket, host network)."""
        path = annotations.get(SOCKET_ANNOTATION, DEFAULT_SOCKET)
        if not os.path.exists(path):
            return None
        try:
            if kernel_sockets.netns_inode(init_pid) == kernel_sockets.netns_inode(os.getpid()):
                return None   # host network: nothing to redirect, and no identity to claim
            local_path = _local_path(path)
            offload = (sockopt_offload.join() if local_path == "socketpair" and sockopt_offload.wanted(annotations)
                       else None)
            net = cls(loop, sandbox, init_pid, pids, path, offload, local_path)
        except OSError as e:
            log.warning("TSoR off for %s: %s", sandbox, e)
            return None
        net.client.start()
        return net

    def close(self) -> None:
        self.peers.flush_tally()   # tsord's counts include what went over channels
        self.peers.reset()
        self.client.close()
        for q in self.bells.values():
            os.close(q.fd)
            if q.bell is not None:
                q.bell.close()
        self.bells.clear()
        for spare in self._spare_bells.values():
            for s in spare:
                s.close()
        self._spare_bells.clear()
        os.close(self.netns_fd)
        if self.offload is not None:
            self.offload.close()

    # ---- connect -------------------------------------------------------------------------------
    def connect(self, dst: Endpoint, src_port: int, on_reply: Reply) -> None:
        """Over a direct channel when a route holds for dst (answered at once), else by tsord."""
        dst = (unmapped(dst[0]), dst[1])

        if not self.peers.connect(dst, src_port, on_reply):
            self.client.request(protocol.Connect(dst, src_port),
                                lambda reply, fds: self._answered(dst, reply, fds, on_reply))

    def _answered(self, dst: Endpoint, reply: dict | None, fds: list[int], on_reply: Reply) -> None:
        if reply is not None and reply.get("direct") is not None and reply.get("path") == "local":
            self.peers.adopt(dst, reply, fds)   # takes (and closes) the channel end, fds[1]
            fds = fds[:1]
        elif reply is not None and reply.get("path") == "fallback" and "native" in reply:
            self.peers.remember_native(dst, reply["native"])
        on_reply(reply, fds)

    def known_native(self, dst: Endpoint) -> bool:
        """A connect to `dst` that tsord said goes native, its routes unchanged since: no need to ask."""
        return self.peers.known_native((unmapped(dst[0]), dst[1]))

    def _up(self) -> None:
        self.peers.registered(self.client.take_generation())
        self._announce_all()

    def _tsord_down(self) -> None:
        self.peers.flush_tally()
        self.peers.reset()

    def _serve_peer(self, msg: protocol.Peer, fd: int) -> bool:
        return self.peers.serve(msg, fd)

    # called with a socket inode whose state the sweep dropped (the intercept's option table)
    on_forget: Callable[[int], None] | None = None

    def redirected(self, inode: int, state: Redirected) -> None:
        self.sockets[inode] = state
        self._schedule_sweep()

    # ---- listeners -----------------------------------------------------------------------------
    def listen(self, listener: Listener) -> None:
        self.listeners[listener.token] = listener
        self._announce(listener)
        self._schedule_sweep()

    def _announce(self, lst: Listener) -> None:
        ip = unmapped(lst.local[0])
        if ip not in self.addrs and not _is_any(ip):
            return   # loopback-only (or foreign) listeners are not reachable from other pods
        msg = protocol.Listen(lst.token, ip, lst.local[1], lst.v6only)
        self.client.request(msg, lambda r, fds: r and r.get("error") and log.warning(
            "tsord refused listener %s:%d: %s", ip, lst.local[1], r["error"]))

    def _announce_all(self) -> None:
        for lst in list(self.listeners.values()):
            self._announce(lst)

    def _alive(self, lst: Listener) -> bool:
        if kernel_sockets.socket_inode(lst.pid, lst.fd) == lst.token:
            return True
        return lst.token in kernel_sockets.socket_inodes(self.pids())

    def _incoming(self, msg: protocol.Incoming, fd: int, direct: bool = False) -> bool | str:
        """Take an offered connection for a listener: True; False: not (the listener is gone, the
        doorbell failed); FULL: its backlog of connections the application has not accepted is full,
        so this one goes native, where the kernel's accept queue decides as it does for TCP; OVER
        (`direct`: over a peer channel): taken past the backlog (see FULL, OVER)."""
        lst = self.listeners.get(msg.token)
        if lst is None or not self._alive(lst):
            if lst is not None:
                self._forget_listener(lst)
            return False
        try:
            if msg.greet:
                os.write(fd, b"\x01")
            if self._hand_to_waiting(lst.token, msg, fd):
                return True
            queued = sum(1 for q in self.bells.values() if q.token == lst.token)
            if queued > lst.backlog + (DIRECT_SLACK if direct else 0):
                log.debug("listener %s:%d: backlog of %d full", *msg.local, lst.backlog)
                return FULL
            target = (msg.local[0], msg.local[1])
            bell = self._bell_socket(family_of(target[0]))
            err = bell.connect_ex(target)
            if err not in (0, errno.EINPROGRESS):
                bell.close()
                raise OSError(err, os.strerror(err))
            key = _ep(bell.getsockname())
        except OSError as e:
            log.warning("doorbell for %s:%d failed: %s", msg.local[0], msg.local[1], e)
            return False
        self.bells[key] = Queued(os.dup(fd), msg.peer, msg.local, msg.path, bell, lst.token)
        return OVER if direct and queued >= lst.backlog else True

    def accept_waiting(self, token: int, take: Callable[[Queued], bool]) -> Callable[[], None]:
        """A blocking accept waits on listener `token`: `take(queued)` hands it a connection (True:
        taken; False: it no longer waits, the fd stays ours). Returns the call that unregisters it."""
        waiting = self._accepting.setdefault(token, [])
        waiting.append(take)

        def unwait() -> None:
            if take in waiting:
                waiting.remove(take)
            if not waiting and self._accepting.get(token) is waiting:
                del self._accepting[token]
        return unwait

    def _hand_to_waiting(self, token: int, msg: protocol.Incoming, fd: int) -> bool:
        """Give the offered connection to an accept already waiting on the listener, if one does."""
        for take in list(self._accepting.get(token, ())):
            queued = Queued(os.dup(fd), msg.peer, msg.local, msg.path)
            if take(queued):
                return True
            os.close(queued.fd)
        return False

    def _bell_socket(self, family: int) -> socket.socket:
        """A fresh socket of the pod's for a doorbell; made BELL_BATCH at a time, each batch for one
        setns into the pod and one back (two per connection before)."""
        spare = self._spare_bells.setdefault(family, [])
        if not spare:
            spare.extend(kernel_sockets.sockets_in_netns(self.netns_fd, family, BELL_BATCH))
        bell = spare.pop()
        # closed with a reset once accepted (take_bell): one packet instead of TCP's four-way
        # close, and no TIME_WAIT entry holding a port of the pod's for a minute per connection
        bell.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
        return bell

    def _incoming_direct(self, msg: protocol.Incoming, fd: int) -> bool | str:
        """An offer over a direct channel: as tsord's, once the listener is checked to cover the
        address and port (tsord checked that itself for its offers)."""
        lst = self.listeners.get(msg.token)
        if lst is None or lst.local[1] != msg.local[1]:
            return False
        ip, dst = unmapped(lst.local[0]), unmapped(msg.local[0])
        if _is_any(ip):
            if family_of(dst) != lst.family and (lst.v6only or lst.family != socket.AF_INET6):
                return False
        elif ip != dst:
            return False
        return self._incoming(msg, fd, direct=True)

    def take_bell(self, peer: Endpoint) -> Queued | None:
        """The TSoR connection whose doorbell came from `peer`, if that accepted connection is one."""
        q = self.bells.pop(_ep(peer), None)
        if q is not None and q.bell is not None:
            q.bell.close()
        return q

    def _forget_listener(self, lst: Listener) -> None:
        self.listeners.pop(lst.token, None)
        self.client.request(protocol.Unlisten(lst.token), lambda r, fds: None)

    # ---- sweeping state of closed sockets ------------------------------------------------------
    def _schedule_sweep(self) -> None:
        if not self._sweeping:
            self._sweeping = True
            self.loop.call_later(SWEEP_S, self._sweep)

    def _sweep(self) -> None:
        """Forget the state of sockets no process of the sandbox holds any more. The scan reads
        every fd of every process of the sandbox, SWEEP_BATCH fds per turn of the loop, so trapped
        syscalls are answered in between however many fds there are. Only state that existed when
        the scan began may be dropped: a socket redirected meanwhile can sit in an fd already read."""
        if not self.sockets and not self.listeners:
            self._sweeping = False
            return
        self._sweep_step(kernel_sockets.held_sockets(self.pids()), set(self.sockets), set(self.listeners), set())

    def _sweep_step(self, scan, sockets: set[int], listeners: set[int], live: set[int | None]) -> None:
        batch = list(itertools.islice(scan, SWEEP_BATCH))
        live.update(batch)
        if len(batch) == SWEEP_BATCH:
            self.loop.call_later(0, lambda: self._sweep_step(scan, sockets, listeners, live))
            return
        for ino in sockets - live:
            if self.sockets.pop(ino, None) is not None and self.on_forget is not None:
                self.on_forget(ino)
        for ino in listeners - live:
            if ino in self.listeners:
                self._forget_listener(self.listeners[ino])
        self._sweeping = False
        self._schedule_sweep()


def _is_any(ip: str) -> bool:
    return ip in ("0.0.0.0", "::")


def _ep(addr: tuple) -> Endpoint:
    return (unmapped(addr[0]), addr[1])

