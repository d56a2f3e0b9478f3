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
of their own; at most MAX_SETUPS checked set-ups are delivered at once, and the excess is closed:
the client then connects natively. A checked set-up is offered to the listening sandbox from the
gate's thread when the sandbox's socket takes the offer at once (its supervisor writes the answer
byte itself, so nobody here waits for it); a thread delivers it only when that socket is busy.

The first two steps (TCP handshake, the server's nonce) do not depend on the connection being set
up, so a client tsord does them ahead for the peer nodes it is using (WARM_PER_NODE each, at most
WARM_TTL old; a node unused for that long is no longer kept warm): a new connection to such a node
starts at the client's header. The proofs are unchanged (a fresh nonce each way per connection).
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import hmac
import json
import logging
import os
import socket
import struct
import threading
import time
from collections import deque
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
MAX_PENDING = 256    # connections waiting for their header and proof (peers' warm set-ups among them)
MAX_SETUPS = 64      # checked set-ups being delivered at once
WARM_PER_NODE = 1    # set-ups opened ahead per peer node in use: one pending slot each on that node's gate
WARM_TTL = SETUP_TIMEOUT / 2   # a warm set-up older than this is not used: the peer's gate drops it at SETUP_TIMEOUT


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
# offer(dst, peer, sock, path): deliver() for a thread that must not block (tsor/daemon.py's
# Daemon.offer): a future of the sandbox's answer, or None when its socket does not take it now
Offer = Callable[[Endpoint, Endpoint, socket.socket, str], "concurrent.futures.Future | None"]


def _mac(key: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, label + b"".join(parts), hashlib.sha256).digest()


Opened = tuple[socket.socket, bytes]   # a connection to a node's tsord and the nonce it sent


def open_setup(node: Node) -> Opened | None:
    """The set-up's first steps, which do not depend on what is set up: the connection to `node`'s
    tsord and its nonce. None if the node is unreachable."""
    try:
        s = socket.create_connection((node.address.host, node.address.port), timeout=SETUP_TIMEOUT)
    except OSError as e:
        log.info("node %s (%s) unreachable: %s", node.name, node.address, e)
        return None
    try:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return s, _recv_exact(s, NONCE)
    except OSError as e:
        log.info("set-up with node %s failed: %s", node.name, e)
        s.close()
        return None


def dial(node: Node, key: bytes, request: dict, opened: Opened | None = None) -> socket.socket | None:
    """A connection to `node`'s tsord on which both sides proved the cluster secret, `request`
    (JSON) being the client's header; None if the node is unreachable or failed its proof.
    `opened`: the first steps done ahead (open_setup), else they are done now."""
    opened = opened or open_setup(node)
    if opened is None:
        return None
    s, theirs = opened
    try:
        s.settimeout(SETUP_TIMEOUT)
        ours = os.urandom(NONCE)
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


class _Warm:
    """Set-ups opened ahead (open_setup) for the peer nodes this node connects to, made by one
    thread of their own so that no connection waits for them."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._ready: dict[tuple, deque[tuple[float, socket.socket, bytes]]] = {}
        self._used: dict[tuple, Node] = {}    # nodes to keep warm: used within the last WARM_TTL
        self._thread: threading.Thread | None = None
        self._closed = False
        self.taken = 0                         # connections that started from a warm set-up

    @staticmethod
    def _key(node: Node) -> tuple:
        return node.name, node.address.host, node.address.port

    def take(self, node: Node) -> Opened | None:
        """A warm set-up to `node`, if one is ready; either way `node` is kept warm from now on."""
        key, now, got = self._key(node), time.monotonic(), None
        with self._cv:
            if self._closed:
                return None
            q = self._ready.get(key)
            while q and got is None:
                t, s, nonce = q.popleft()
                if now - t < WARM_TTL:
                    got = (s, nonce)
                    self.taken += 1
                else:
                    s.close()
            self._used[key] = node
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tcp-warm", daemon=True)
                self._thread.start()
            self._cv.notify()
        return got

    def _wanted(self) -> tuple | None:
        """(Lock held) a node short of warm set-ups; drops the expired ones, and the nodes whose
        set-up expired unused (idle nodes are not kept warm)."""
        now, short = time.monotonic(), None
        for key in list(self._used):
            q = self._ready.setdefault(key, deque())
            if q and now - q[0][0] >= WARM_TTL:
                while q:
                    q.popleft()[1].close()
                del self._used[key]
            elif len(q) < WARM_PER_NODE and short is None:
                short = key
        return short

    def _run(self) -> None:
        while True:
            with self._cv:
                key = self._wanted()
                while key is None and not self._closed:
                    self._cv.wait(WARM_TTL / 2)
                    key = self._wanted()
                if self._closed:
                    return
                node = self._used[key]
            opened = open_setup(node)   # (outside the lock: connections take what is ready meanwhile)
            with self._cv:
                if opened is None:
                    self._used.pop(key, None)   # unreachable: connections dial it themselves again
                elif self._closed or key not in self._used:
                    opened[0].close()
                else:
                    self._ready.setdefault(key, deque()).append((time.monotonic(), *opened))

    def close(self) -> None:
        with self._cv:
            self._closed = True
            for q in self._ready.values():
                while q:
                    q.popleft()[1].close()
            self._cv.notify()


class _Setup:
    """A server-side set-up at the gate: our nonce and what the client sent so far."""

    def __init__(self) -> None:
        self.nonce = os.urandom(NONCE)
        self.buf = b""


class TcpTransport:
    name = "tcp"

    def __init__(self, deliver: Deliver, routes: RouteTable, listen: HostPort | None,
                 key: bytes | None, rdma_setup: RdmaSetup | None = None, offer: Offer | None = None) -> None:
        """`key`: the cluster secret (b"": insecure_no_auth); None: no node-to-node set-up at all.
        `rdma_setup`: takes over connections whose header asks for an rdma link (transport/rdma_link.py).
        `offer`: how the gate's thread offers a connection without waiting (else a thread delivers it)."""
        self.deliver, self.routes, self.key, self.rdma_setup = deliver, routes, key, rdma_setup
        self.offer = offer
        self.warm = _Warm()
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
    def serves(self, node: Node) -> bool:
        """Whether connections to `node`'s pods can be set up at all: it has an address, we a secret."""
        return node.address is not None and self.key is not None

    def connect(self, node: Node, src: Endpoint, dst: Endpoint) -> socket.socket | None:
        if not self.serves(node):
            return None
        request = {"src": list(src), "dst": list(dst)}
        warm = self.warm.take(node)
        s = dial(node, self.key, request, warm) if warm is not None else None
        if s is None:   # (a warm set-up the peer dropped meanwhile fails at once: start afresh)
            s = dial(node, self.key, request)
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
        try:
            proved = "rdma" not in header and self._offer(p.conn, header)
        except OSError as e:
            log.warning("tcp set-up from %s failed: %s", peer_ip, e)
            self._setups.release()
            return False
        if proved is True:   # no thread holds it: the semaphore bounds threads
            self._setups.release()
        else:
            threading.Thread(target=self._serve, args=(p.conn, header, peer_ip, proved is None),
                             name="tcp-setup", daemon=True).start()
        return True

    def _offer(self, s: socket.socket, header: dict) -> bool | None:
        """In the gate's thread: the proof, then the offer to the listening sandbox if its socket
        takes it at once. True: offered (the answer comes back in its own time); None: proof sent,
        not offered; False: nothing sent."""
        if self.offer is None:
            return False
        s.settimeout(None)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 0)
        # 32 bytes into a send buffer that holds only our nonce: never blocks, never goes in part
        if s.send(header["proof"], socket.MSG_DONTWAIT) != MAC:
            raise OSError("the proof did not go out whole")
        fut = self.offer(header["dst"], header["src"], s, self.name)
        if fut is None:
            return None

        def answered(f: concurrent.futures.Future) -> None:
            try:
                if not (f.result() and f.result().get("ok")):
                    s.send(REFUSED, socket.MSG_DONTWAIT)
            except OSError:
                pass
            finally:
                s.close()
        fut.add_done_callback(answered)
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

    def _serve(self, s: socket.socket, header: dict, peer_ip: str, proved: bool = False) -> None:
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
            if not proved:
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
        self.warm.close()
        if self._gate is not None:
            self._gate.close()
        if self._server is not None:
            try:
                self._server.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._server.close()
