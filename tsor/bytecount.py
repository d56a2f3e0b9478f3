"""Bytes carried by the tcp path, counted by the kernel: tsord is in no data path, so it asks
sock_diag (NETLINK_SOCK_DIAG) for the TCP_INFO of the sockets it handed out.

Every tcp-path socket tsord gives a sandbox (the client's end on the dialling node, the server's on
the other) is tracked by its socket cookie (SO_COOKIE, which sock_diag reports as idiag_cookie),
with its tcpi_bytes_acked / tcpi_bytes_received at hand-off as the baseline (the set-up's nonces,
header, proofs and answer byte are not the application's; set-up bytes still unacknowledged then
count as sent). Then:

* while the socket lives, a dump of tsord's network namespace (where those sockets were made) gives
  its current counters (on every metrics scrape);
* when it is destroyed, the kernel broadcasts its final TCP_INFO to the SKNLGRP_INET(6)_TCP_DESTROY
  groups (needs CAP_NET_ADMIN, which tsord as root has); those bytes move to the retired totals.

tsord is in those groups only while it tracks a socket. The kernel keeps one listener bitmap per
netlink protocol for all network namespaces, so while anyone on the host is in a destroy group,
*every* TCP socket of the host (every pod's, runc's too, the node's own) is freed through a kworker
that first builds and broadcasts its TCP_INFO (net/core/sock_diag.c): nginx with a connection per
request on the sockmap local path (which hands out no tcp-path socket) served fewer requests a
second with tsord in the groups than without (measured: bench/README.md, "The sockmap local path,
built", "A tax tsord put on every socket of the node, removed").

"sent" is what this node's pods sent (acknowledged by the peer), "received" what they received, as
TCP counts them: a FIN takes one sequence number, so a connection closed in a direction adds one
byte there (whether the socket saw the peer's FIN before it was freed depends on the close order).
Without the destroy groups (no CAP_NET_ADMIN) a socket's bytes after the last scrape before it
closed are not counted. The local path is not counted at all: Linux keeps no byte counters for
AF_UNIX sockets, and nothing of quark is in that data path to count them.
"""
from __future__ import annotations

import fcntl
import logging
import socket
import struct
import termios
import threading

log = logging.getLogger("tsor.bytes")

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
SOL_NETLINK, NETLINK_ADD_MEMBERSHIP, NETLINK_DROP_MEMBERSHIP = 270, 1, 2
SKNLGRP_INET_TCP_DESTROY, SKNLGRP_INET6_TCP_DESTROY = 1, 3
INET_DIAG_INFO = 2
SO_COOKIE = 57
_NLMSG = struct.Struct("=IHHII")
_DIAG_MSG_LEN = 72                  # struct inet_diag_msg
_COOKIE_AT = 4 + 4 + 16 + 16 + 4    # family..retrans, sport/dport, src, dst, if
_BYTES_ACKED_AT, _BYTES_RECEIVED_AT = 120, 128   # in struct tcp_info
_MISSES = 3   # scrapes a tracked socket may be absent from before it is taken as gone


def cookie_of(sock: socket.socket) -> int:
    return struct.unpack("=Q", sock.getsockopt(socket.SOL_SOCKET, SO_COOKIE, 8))[0]


def tcp_bytes(sock: socket.socket) -> tuple[int, int]:
    """(bytes acked, bytes received) of a TCP socket, from TCP_INFO."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    if len(info) < _BYTES_RECEIVED_AT + 8:
        return 0, 0
    return struct.unpack_from("=QQ", info, _BYTES_ACKED_AT)


def _unacked(sock: socket.socket) -> int:
    """Bytes written to a TCP socket that the peer has not acknowledged yet (SIOCOUTQ)."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]


def _parse(data: bytes):
    """Netlink messages -> [(type, payload)]."""
    out, off = [], 0
    while off + _NLMSG.size <= len(data):
        length, mtype, _, _, _ = _NLMSG.unpack_from(data, off)
        if length < _NLMSG.size:
            break
        out.append((mtype, data[off + _NLMSG.size: off + length]))
        off += (length + 3) & ~3
    return out


def _diag_entry(payload: bytes) -> tuple[int, tuple[int, int] | None] | None:
    """An inet_diag_msg -> (cookie, (acked, received) or None when it carries no TCP_INFO)."""
    if len(payload) < _DIAG_MSG_LEN:
        return None
    lo, hi = struct.unpack_from("=II", payload, _COOKIE_AT)
    cookie = lo | hi << 32
    off = _DIAG_MSG_LEN
    while off + 4 <= len(payload):
        alen, atype = struct.unpack_from("=HH", payload, off)
        if alen < 4:
            break
        if atype & 0x3FFF == INET_DIAG_INFO and alen - 4 >= _BYTES_RECEIVED_AT + 8:
            return cookie, struct.unpack_from("=QQ", payload, off + 4 + _BYTES_ACKED_AT)
        off += (alen + 3) & ~3
    return cookie, None


class TcpByteCounter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tracked: dict[int, list[int]] = {}   # cookie -> [base_acked, base_rcvd, acked, rcvd, misses]
        self.sent = self.received = 0                # of sockets gone
        self._events: socket.socket | None = None
        self._joined = False    # in the destroy groups: exactly while _tracked is not empty
        self._closed = False
        self._seq = 0

    def start(self) -> None:
        try:
            s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_SOCK_DIAG)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            s.settimeout(1.0)   # so that close() is noticed
            s.bind((0, 0))      # a port id: the kernel's broadcasts skip unbound sockets (port 0)
            self._membership(s, NETLINK_ADD_MEMBERSHIP)    # may we? (CAP_NET_ADMIN) then out until needed
            self._membership(s, NETLINK_DROP_MEMBERSHIP)
        except OSError as e:
            log.warning("tcp byte counters from scrapes only (no sock_diag destroy events: %s)", e)
            return
        self._events = s
        threading.Thread(target=self._event_loop, name="bytes", daemon=True).start()

    @staticmethod
    def _membership(s: socket.socket, op: int) -> None:
        for group in (SKNLGRP_INET_TCP_DESTROY, SKNLGRP_INET6_TCP_DESTROY):
            s.setsockopt(SOL_NETLINK, op, group)

    def _join_while_tracking(self) -> None:
        """(Lock held) be in the destroy groups if and only if a socket is tracked (module docstring)."""
        want = bool(self._tracked)
        if want == self._joined or self._events is None or self._closed:
            return
        try:
            self._membership(self._events, NETLINK_ADD_MEMBERSHIP if want else NETLINK_DROP_MEMBERSHIP)
            self._joined = want
        except OSError as e:   # (the socket closed under us: close() raced; nothing to count any more)
            log.debug("sock_diag destroy groups: %s", e)

    @property
    def joined(self) -> bool:
        """Whether tsord is in the destroy groups now (and so every host TCP socket's free pays for it)."""
        return self._joined

    def close(self) -> None:
        self._closed = True
        if self._events is not None:
            try:
                self._events.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._events.close()

    def track(self, sock: socket.socket, greeting: bool = False) -> None:
        """A tcp-path socket about to be handed to a sandbox. `greeting`: its supervisor will write
        the one-byte answer of the set-up (transport/tcp.py) before the application has it."""
        try:
            cookie = cookie_of(sock)
            acked, rcvd = tcp_bytes(sock)
            acked += _unacked(sock) + (1 if greeting else 0)
        except OSError as e:
            log.debug("cannot track %s: %s", sock, e)
            return
        with self._lock:
            self._tracked[cookie] = [acked, rcvd, acked, rcvd, 0]
            self._join_while_tracking()   # before the socket is handed out, so before it can be freed

    def untrack(self, sock: socket.socket) -> None:
        try:
            cookie = cookie_of(sock)
        except OSError:
            return
        with self._lock:
            self._tracked.pop(cookie, None)
            self._join_while_tracking()

    def _retire(self, cookie: int, counts: tuple[int, int] | None) -> None:
        entry = self._tracked.pop(cookie, None)
        if entry is None:
            return
        acked, rcvd = counts if counts is not None else (entry[2], entry[3])
        self.sent += max(0, acked - entry[0])
        self.received += max(0, rcvd - entry[1])
        self._join_while_tracking()

    def _event_loop(self) -> None:
        while not self._closed:
            try:
                data = self._events.recv(1 << 16)
            except TimeoutError:
                continue
            except OSError as e:
                if self._closed or e.errno not in (105,):   # ENOBUFS: events were lost; carry on
                    return
                log.warning("sock_diag destroy events lost (ENOBUFS); some bytes may be uncounted")
                continue
            if not data:
                return
            for mtype, payload in _parse(data):
                if mtype != SOCK_DIAG_BY_FAMILY:
                    continue
                entry = _diag_entry(payload)
                if entry is not None:
                    with self._lock:
                        if entry[0] in self._tracked:
                            self._retire(*entry)

    def _dump(self) -> dict[int, tuple[int, int] | None]:
        found: dict[int, tuple[int, int] | None] = {}
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_SOCK_DIAG) as s:
            s.settimeout(2)
            for family in (socket.AF_INET, socket.AF_INET6):
                self._seq += 1
                req = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 1 << (INET_DIAG_INFO - 1), 0,
                                  0xFFFFFFFF) + b"\0" * 48
                s.send(_NLMSG.pack(_NLMSG.size + len(req), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP,
                                   self._seq, 0) + req)
                done = False
                while not done:
                    for mtype, payload in _parse(s.recv(1 << 16)):
                        if mtype in (NLMSG_DONE, NLMSG_ERROR):
                            done = True
                        elif mtype == SOCK_DIAG_BY_FAMILY:
                            entry = _diag_entry(payload)
                            if entry is not None:
                                found[entry[0]] = entry[1]
        return found

    def totals(self) -> dict[tuple[str, str], int]:
        """{("tcp", "sent"): n, ("tcp", "received"): n}, live sockets included."""
        with self._lock:
            if not self._tracked:
                return {("tcp", "sent"): self.sent, ("tcp", "received"): self.received}
        try:
            live = self._dump()
        except OSError as e:
            log.warning("sock_diag dump failed: %s", e)
            live = None
        with self._lock:
            for cookie, entry in list(self._tracked.items()):
                counts = live.get(cookie) if live is not None else None
                if counts is not None:
                    entry[2], entry[3], entry[4] = counts[0], counts[1], 0
                elif live is not None and cookie not in live:
                    entry[4] += 1
                    if entry[4] >= _MISSES:   # gone, and its destroy event was lost or never came
                        self._retire(cookie, None)
            sent = self.sent + sum(max(0, e[2] - e[0]) for e in self._tracked.values())
            received = self.received + sum(max(0, e[3] - e[1]) for e in self._tracked.values())
            return {("tcp", "sent"): sent, ("tcp", "received"): received}
