"""The tcp transport: node to node over one real TCP connection per application connection.

The client's tsord dials the server node's tsord (its `listen` address) and sends a header
(4-byte length + JSON {src, dst}); the server's tsord hands the accepted socket to the listening
sandbox, whose supervisor writes one byte b"\\x01" on it *before* the application can accept it
(so the byte always precedes application data); b"\\x00" or EOF means no taker. The client's tsord
reads exactly that byte and hands its socket to the client sandbox. From then on the two pods hold
the two ends of one kernel TCP connection: no process is in the data path.
"""
from __future__ import annotations

import json
import logging
import socket
import struct
import threading

from tsor.addr import Endpoint, unmapped, valid_ip
from tsor.config import HostPort
from tsor.routes import Node, RouteTable
from tsor.transport import Deliver

log = logging.getLogger("tsor.tcp")
SETUP_TIMEOUT = 5.0
_MAX_HEADER = 4096
ACCEPTED, REFUSED = b"\x01", b"\x00"


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed during set-up")
        buf += chunk
    return buf


class TcpTransport:
    name = "tcp"

    def __init__(self, deliver: Deliver, routes: RouteTable, listen: HostPort | None) -> None:
        self.deliver, self.routes = deliver, routes
        self._server: socket.socket | None = None
        if listen is not None:
            fam = socket.AF_INET6 if ":" in listen.host else socket.AF_INET
            s = socket.socket(fam, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((listen.host, listen.port))
            s.listen(1024)
            self._server = s
            threading.Thread(target=self._accept_loop, name="tcp-accept", daemon=True).start()

    # ---- client side ---------------------------------------------------------------------------
    def connect(self, node: Node, src: Endpoint, dst: Endpoint) -> socket.socket | None:
        if node.address is None:
            return None
        try:
            s = socket.create_connection((node.address.host, node.address.port), timeout=SETUP_TIMEOUT)
        except OSError as e:
            log.info("node %s (%s) unreachable: %s", node.name, node.address, e)
            return None
        try:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            header = json.dumps({"src": list(src), "dst": list(dst)}).encode()
            s.sendall(struct.pack("!I", len(header)) + header)
            status = _recv_exact(s, 1)
        except OSError as e:
            log.info("set-up with node %s failed: %s", node.name, e)
            s.close()
            return None
        if status != ACCEPTED:
            s.close()
            return None
        s.settimeout(None)
        # the application decides about Nagle; TCP's default is on
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 0)
        return s

    # ---- server side ---------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while True:
            try:
                s, peer = self._server.accept()
            except OSError:
                return   # closed
            threading.Thread(target=self._serve, args=(s, peer[0]), name="tcp-setup", daemon=True).start()

    def _serve(self, s: socket.socket, peer_ip: str) -> None:
        try:
            s.settimeout(SETUP_TIMEOUT)
            n, = struct.unpack("!I", _recv_exact(s, 4))
            if n > _MAX_HEADER:
                raise ValueError("header too long")
            h = json.loads(_recv_exact(s, n))
            src, dst = h["src"], h["dst"]
            if not (valid_ip(src[0]) and valid_ip(dst[0]) and 0 <= src[1] < 65536 and 0 < dst[1] < 65536):
                raise ValueError("bad endpoints")
            # A connection may only claim a source address of the node it comes from.
            node = self.routes.lookup(src[0])
            if node is None or node.address is None or unmapped(node.address.host) != unmapped(peer_ip):
                raise PermissionError(f"{peer_ip} is not the node of pod {src[0]}")
            s.settimeout(None)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 0)
            if not self.deliver((dst[0], dst[1]), (src[0], src[1]), s, self.name, True):
                s.send(REFUSED)
        except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
            log.warning("tcp set-up from %s refused: %s", peer_ip, e)
        finally:
            s.close()

    def close(self) -> None:
        if self._server is not None:
            try:
                self._server.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._server.close()
