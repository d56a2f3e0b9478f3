"""The tcp transport: node to node over one real TCP connection per application connection.

The client's tsord dials the server node's tsord (its `listen` address). Both know the cluster
secret K (tsor/config.py), and each proves it over a fresh nonce of the other before anything is
believed:

    server -> client   NONCE_S (16 random bytes), at once
    client -> server   4-byte length + JSON {src, dst, nonce: hex NONCE_C}
                       + HMAC-SHA256(K, "tsor-client" NONCE_S header)
    server -> client   HMAC-SHA256(K, "tsor-server" NONCE_C NONCE_S), once the client's proof checks
    server -> client   one byte: b"\x01" written by the listening sandbox's supervisor *before* the
                       application can accept (so it precedes application data); b"\x00" or EOF: no
                       taker

A host without K can neither inject a connection into a pod nor pose as a peer tsord to a client
pod (the client checks the server's proof before the answer byte), and a recorded set-up does not
replay (the other side's nonce is new each time). The server also checks that the claimed source
pod belongs to the node the connection comes from. The client's tsord then hands its socket to the
client sandbox: the two pods hold the two ends of one kernel TCP connection, no process is in the
data path.

New connections wait at a Gate (tsor/gate.py) until their header and proof are in, with no thread
of their own; at most MAX_SETUPS checked set-ups are delivered at once (each waits for a supervisor
to take it), and the excess is closed: the client then connects natively.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable

from tsor.addr import Endpoint, unmapped, valid_ip
from tsor.config import HostPort
from tsor.gate import Gate, Pending
from tsor.routes import Node, RouteTable
from tsor.transport import Deliver

log = logging.getLogger("tsor.tcp")
SETUP_TIMEOUT = 5.0
_MAX_HEADER = 4096
ACCEPTED, REFUSED = b"\x01", b"\x00"
NONCE, MAC = 16, 32
CLIENT, SERVER = b"tsor-client", b"tsor-server"
MAX_PENDING = 128    # connections waiting for their header and proof
MAX_SETUPS = 64      # checked set-ups being delivered at once (a thread each)


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed during set-up")
        buf += chunk
    return buf


# rdma_setup(sock, node, request): a peer tsord asked, on an authenticated connection, for an rdma link
RdmaSetup = Callable[[socket.socket, Node, object], None]


def _mac(key: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, label + b"".join(parts), hashlib.sha256).digest()


def dial(node: Node, key: bytes, request: dict) -> socket.socket | None:
    """A connection to `node`'s tsord on which both sides proved the cluster secret, `request`
    (JSON) being the client's header; None if the node is unreachable or failed its proof."""
    try:
        s = socket.create_connection((node.address.host, node.address.port), timeout=SETUP_TIMEOUT)
    except OSError as e:
        log.info("node %s (%s) unreachable: %s", node.name, node.address, e)
        return None
    try:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        theirs, ours = _recv_exact(s, NONCE), os.urandom(NONCE)
        header = json.dumps({**request, "nonce": ours.hex()}).encode()
        s.sendall(struct.pack("!I", len(header)) + header + _mac(key, CLIENT, theirs, header))
        proof = _recv_exact(s, MAC)
    except OSError as e:
        log.info("set-up with node %s failed: %s", node.name, e)
        s.close()
        return None
    if not hmac.compare_digest(proof, _mac(key, SERVER, ours, theirs)):
        log.warning("node %s (%s) did not prove the cluster secret", node.name, node.address)
        s.close()
        return None
    return s


class _Setup:
    """A server-side set-up at the gate: our nonce and what the client sent so far."""

    def __init__(self) -> None:
        self.nonce = os.urandom(NONCE)
        self.buf = b""


class TcpTransport:
    name = "tcp"

    def __init__(self, deliver: Deliver, routes: RouteTable, listen: HostPort | None,
                 key: bytes | None, rdma_setup: RdmaSetup | None = None) -> None:
        """`key`: the cluster secret (b"": insecure_no_auth); None: no node-to-node set-up at all.
        `rdma_setup`: takes over connections whose header asks for an rdma link (transport/rdma_link.py)."""
        self.deliver, self.routes, self.key, self.rdma_setup = deliver, routes, key, rdma_setup
        self._server: socket.socket | None = None
        self._gate: Gate | None = None
        self._setups = threading.BoundedSemaphore(MAX_SETUPS)
        if listen is not None and key is None:
            log.warning("listen %s ignored: node-to-node set-up needs cluster_secret_file", listen)
        elif listen is not None:
            fam = socket.AF_INET6 if ":" in listen.host else socket.AF_INET
            s = socket.socket(fam, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((listen.host, listen.port))
            s.listen(1024)
            self._server = s
            self._gate = Gate(s, "tcp", self._opened, self._readable, MAX_PENDING, SETUP_TIMEOUT)

    # ---- client side ---------------------------------------------------------------------------
    def connect(self, node: Node, src: Endpoint, dst: Endpoint) -> socket.socket | None:
        if node.address is None or self.key is None:
            return None
        s = dial(node, self.key, {"src": list(src), "dst": list(dst)})
        if s is None:
            return None
        try:
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
    def _opened(self, p: Pending) -> bool:
        p.state = _Setup()
        p.conn.sendall(p.state.nonce)   # 16 bytes into an empty send buffer: never blocks
        return True

    def _readable(self, p: Pending) -> bool | None:
        """The gate's check: None until header and proof are in; then refuse, or hand over."""
        setup: _Setup = p.state
        peer_ip = p.peer[0]
        try:
            data = p.conn.recv(_MAX_HEADER + 4 + MAC, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return None
        except OSError:
            return False
        if not data:
            return False
        setup.buf += data
        try:
            header = self._check(setup, peer_ip)
        except (ValueError, KeyError, TypeError, IndexError, PermissionError) as e:
            log.warning("tcp set-up from %s refused: %s", peer_ip, e)
            return False
        if header is None:
            return None
        if not self._setups.acquire(blocking=False):
            log.warning("tcp set-up from %s refused: %d set-ups already in progress", peer_ip, MAX_SETUPS)
            return False
        threading.Thread(target=self._serve, args=(p.conn, header, peer_ip), name="tcp-setup",
                         daemon=True).start()
        return True

    def _check(self, setup: _Setup, peer_ip: str) -> dict | None:
        """The client's header once it and its proof are complete (None before); raises if bad."""
        buf = setup.buf
        if len(buf) < 4:
            return None
        n, = struct.unpack("!I", buf[:4])
        if n > _MAX_HEADER:
            raise ValueError("header too long")
        if len(buf) < 4 + n + MAC:
            return None
        if len(buf) > 4 + n + MAC:
            raise ValueError("data before the set-up was answered")
        raw, proof = buf[4:4 + n], buf[4 + n:]
        if not hmac.compare_digest(proof, _mac(self.key, CLIENT, setup.nonce, raw)):
            raise PermissionError("no valid proof of the cluster secret")
        h = json.loads(raw)
        if "rdma" in h:
            return self._check_rdma(h, setup, peer_ip)
        src, dst, nonce = h["src"], h["dst"], bytes.fromhex(h["nonce"])
        if not (valid_ip(src[0]) and valid_ip(dst[0]) and 0 <= src[1] < 65536 and 0 < dst[1] < 65536
                and len(nonce) == NONCE):
            raise ValueError("bad endpoints")
        # A connection may only claim a source address of the node it comes from.
        node = self.routes.lookup(src[0])
        if node is None or node.address is None or unmapped(node.address.host) != unmapped(peer_ip):
            raise PermissionError(f"{peer_ip} is not the node of pod {src[0]}")
        return {"src": (src[0], src[1]), "dst": (dst[0], dst[1]), "proof": _mac(self.key, SERVER, nonce, setup.nonce)}

    def _check_rdma(self, h: dict, setup: _Setup, peer_ip: str) -> dict:
        """A peer tsord asks for an rdma link: it must be the node it names, from that node's address."""
        nonce = bytes.fromhex(h["nonce"])
        node = self.routes.nodes.get(h["node"])
        if self.rdma_setup is None or len(nonce) != NONCE:
            raise ValueError("no rdma set-up here")
        if node is None or node.address is None or unmapped(node.address.host) != unmapped(peer_ip):
            raise PermissionError(f"{peer_ip} is not the address of node {h['node']!r}")
        return {"rdma": h["rdma"], "node": node, "proof": _mac(self.key, SERVER, nonce, setup.nonce)}

    def _serve(self, s: socket.socket, header: dict, peer_ip: str) -> None:
        if "rdma" in header:
            try:
                s.settimeout(SETUP_TIMEOUT)
                s.sendall(header["proof"])
                self.rdma_setup(s, header["node"], header["rdma"])   # the socket is its own now
            except OSError as e:
                log.warning("rdma set-up from %s failed: %s", peer_ip, e)
                s.close()
            finally:
                self._setups.release()
            return
        try:
            s.settimeout(SETUP_TIMEOUT)
            s.sendall(header["proof"])
            s.settimeout(None)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 0)
            if not self.deliver(header["dst"], header["src"], s, self.name, True):
                s.send(REFUSED)
        except OSError as e:
            log.warning("tcp set-up from %s failed: %s", peer_ip, e)
        finally:
            s.close()
            self._setups.release()

    def close(self) -> None:
        if self._gate is not None:
            self._gate.close()
        if self._server is not None:
            try:
                self._server.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._server.close()
