"""tsord's rdma transport: which peer nodes get an rdma link, the link's set-up over the
authenticated tsord-to-tsord connection, and connections over it (transport/rdma.py moves the bytes).

The node that first has a connection for a peer sets the link up (tcp.py's dial: both tsords prove
the cluster secret first):

    client -> server   header {"rdma": "rdma" | a cabled provider's name, "node": its name}, the proofs (tcp.py:
                       the named node's route-table address must be where the connection comes from)
    client -> server   4-byte length + JSON SetupInfo: QP number, PSN, GID, LID, ring region, sizes
    server -> client   4-byte length + JSON SetupInfo, or {"error": why} (then the client uses tcp)

Each side brings its QP to RTR before the other may write: the server before its answer, the
client before it signals readiness. With `rdma` the client sends b"R" and the connection stays open
as the link's lifeline: when it ends, the link is retired. With a cabled provider (a software one
whose wire is that same TCP connection: the host tests' softverbs, tests/support/softverbs.py, which
tsord has only where a test's entry point gives it) the connection becomes the cable (readiness:
each device's hello, sent once its QP is in RTR).
A new set-up from a peer replaces its old link (its connections are reset: the peer restarted).
"""
from __future__ import annotations

import collections
import concurrent.futures
import json
import logging
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from tsor.addr import Endpoint
from tsor.config import RdmaPort
from tsor.errors import ProtocolError
from tsor.routes import Node
from tsor.transport import Deliver
from tsor.transport import rdma_pump
from tsor.transport.rdma import Link, RdmaEngine, RingConfig, SetupInfo
from tsor.transport.rdma_pump import PumpEngine, PumpLink
from tsor.transport.tcp import SETUP_TIMEOUT, dial
from tsor.verbs import Device, NoDevice, VerbsError

log = logging.getLogger("tsor.rdma")
AnyLink = Link | PumpLink   # a link of the Python engine or of the compiled pump
# offer(dst, peer, app_end, path): deliver() for a thread that must not block (tsor/daemon.py's
# Daemon.offer): the offer, with the greeting asked for, is sent now or not at all; the future gets
# the listening sandbox's reply (None: no reply). None: not sent, deliver() it instead.
Offer = Callable[[Endpoint, Endpoint, socket.socket, str], "concurrent.futures.Future | None"]
OPEN_TIMEOUT = 5.0       # the peer's sandbox takes a connection within this
RETRY_AFTER = 10.0       # a peer whose set-up failed is tried again after this (tcp meanwhile)
_MAX_INFO = 4096


def send_json(s: socket.socket, obj: object) -> None:
    data = json.dumps(obj).encode()
    s.sendall(struct.pack("!I", len(data)) + data)


def recv_json(s: socket.socket) -> object:
    head = s.recv(4, socket.MSG_WAITALL)
    if len(head) != 4:
        raise ConnectionError("peer closed during the rdma set-up")
    n, = struct.unpack("!I", head)
    if n > _MAX_INFO:
        raise ProtocolError(f"rdma set-up message of {n} bytes")
    data = s.recv(n, socket.MSG_WAITALL)
    if len(data) != n:
        raise ConnectionError("peer closed during the rdma set-up")
    return json.loads(data)


@dataclass(frozen=True)
class Cabled:
    """A software verbs provider whose wire is the tsords' set-up connection itself: the host tests'
    softverbs (tests/support/softverbs.py), for machines with no RDMA at all. Production tsord has
    none; tests/support/softverbs_tsord.py starts one with it. Its devices have start() (send the
    hello), `down`, and a port that turns active once the peer's hello came."""
    name: str                                      # its tsor.yaml `transport` value
    open: Callable[[socket.socket, str], Device]   # (the set-up connection, a name) -> a device, not started
    ring: RingConfig                               # its links' rings (a longer round trip needs longer rings)


def choose(configured: str, rdma_here: Callable[[], bool], cabled: str | None = None) -> str:
    """What this node's side uses with a peer whose configured transport (tsor/config.py) is
    `configured`: "rdma", "tcp", or `cabled` (the name of tsord's cabled provider, if it has one).
    rdma_here() says whether this host has an active RDMA port; it is asked only when the answer
    depends on it (opening a device is not free). The peer decides the same on its side: a set-up
    it does not agree with ends in tcp."""
    if cabled is not None and configured == cabled:
        return cabled
    if configured in ("rdma", "auto") and rdma_here():
        return "rdma"
    return "tcp"


def pump_for(configured: str) -> tuple[str, str | None]:
    """The pump rdma links get for tsor.yaml's `rdma.pump`: ("compiled", None), or ("python", why not
    compiled: asked for, or transport/rdma_pump.c not built here)."""
    if configured != "compiled":
        return "python", "rdma.pump: python in tsor.yaml"
    why = rdma_pump.unavailable()
    return ("compiled", None) if why is None else ("python", why)


def open_active(open_rdma: Callable[[], Device]) -> Device:
    """The device open_rdma() gives when its port is active; NoDevice (saying why) otherwise."""
    dev = open_rdma()
    try:
        active = dev.port().active
    except BaseException:
        dev.close()
        raise
    if not active:
        dev.close()
        raise NoDevice(f"{dev.name}: port not active")
    return dev


class RdmaTransport:
    name = "rdma"

    def __init__(self, node: str, deliver: Deliver, key: bytes | None, transport_for: Callable[[str], str],
                 ring: RingConfig | None = None, open_rdma: Callable[[], Device] | None = None,
                 offer: Offer | None = None, pump: str = "compiled", cabled: Cabled | None = None) -> None:
        """node: this node's name; transport_for(peer node) -> auto|rdma|tcp (tsor/config.py);
        open_rdma() -> the host's RDMA device or NoDevice (default: the pyverbs provider's first);
        offer: how the engine's thread offers a connection without waiting (else a thread delivers it);
        pump: what moves an rdma link's bytes, "compiled" (transport/rdma_pump.c; the Python pump where
        it is not built) or "python" (transport/rdma.py's engine, as cabled links always use);
        cabled: a software provider for the host's tests (Cabled), none in production."""
        self.node, self.deliver, self.key, self.transport_for = node, deliver, key, transport_for
        self.offer = offer
        self.engine = RdmaEngine(self._accept, ring or RingConfig(), self._down)
        self._pump_setting = pump
        self._pump: PumpEngine | None = None
        self._ring = ring or RingConfig()
        self.cabled = cabled
        self.links: dict[str, AnyLink] = {}
        self._lifelines: dict[AnyLink, socket.socket] = {}
        self._retired: weakref.WeakSet[AnyLink] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._node_locks: dict[str, threading.Lock] = {}
        self._failed: dict[str, float] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(16, thread_name_prefix="rdma-deliver")
        self._open_rdma = open_rdma or open_pyverbs
        self._device: Device | None = None
        self._no_device: str | None = None
        self.on_change: Callable[[], None] | None = None   # a link came up or went

    # ---- which provider and which pump for which peer -------------------------------------------
    def _engine_for(self, kind: str) -> RdmaEngine | PumpEngine:
        """The compiled pump for rdma links (where built and asked for), the Python one otherwise."""
        if kind != "rdma" or self._pump_setting != "compiled":
            return self.engine
        with self._lock:
            if self._pump is None and self._pump_setting == "compiled":
                chosen, why = pump_for(self._pump_setting)
                if chosen == "compiled":
                    self._pump = PumpEngine(self._accept, self._ring, self._down)
                else:
                    self._pump_setting = chosen
                    log.warning("rdma links use the Python pump: %s", why)
            return self._pump or self.engine

    def compiled_pump(self) -> PumpEngine | None:
        """The compiled pump rdma links use (started now), or None where they use the Python one."""
        engine = self._engine_for("rdma")
        return engine if isinstance(engine, PumpEngine) else None

    @property
    def bytes_sent(self) -> int:
        return sum(e.bytes_sent for e in self._engines())

    @property
    def bytes_received(self) -> int:
        return sum(e.bytes_received for e in self._engines())

    @property
    def resets(self) -> dict[str, int]:
        """Links reset, by reason (tsor_rdma_link_resets_total)."""
        total: collections.Counter[str] = collections.Counter()
        for e in self._engines():
            total.update(e.resets)
        return dict(total)

    def _engines(self) -> list:
        return [self.engine] + ([self._pump] if self._pump is not None else [])

    def rdma_device(self) -> Device | None:
        with self._lock:
            if self._device is None and self._no_device is None:
                try:
                    self._device = open_active(self._open_rdma)
                except (NoDevice, VerbsError) as e:
                    self._no_device = str(e)
                    log.info("%s: node-to-node connections use tcp where rdma was asked for", e)
            return self._device

    def kind(self, node: str) -> str | None:
        """The provider this node's side wants for peer `node`: "rdma", the cabled provider's name, or
        None (tcp)."""
        chosen = choose(self.transport_for(node), lambda: self.rdma_device() is not None,
                        self.cabled.name if self.cabled else None)
        return None if chosen == "tcp" else chosen

    # ---- client side ---------------------------------------------------------------------------
    def usable(self, node: Node) -> bool:
        """Whether connections to `node` go over rdma: a link is up, or could be set up now."""
        return self._link(node) is not None

    def connect(self, node: Node, src: Endpoint, dst: Endpoint) -> socket.socket | None:
        link = self._link(node)
        return None if link is None else link.engine.open(link, src, dst, OPEN_TIMEOUT)

    def _link(self, node: Node) -> AnyLink | None:
        kind = self.kind(node.name) if node.address is not None and self.key is not None else None
        if kind is None:
            return None
        with self._lock:
            lock = self._node_locks.setdefault(node.name, threading.Lock())
        with lock:
            link = self.links.get(node.name)
            if link is not None and link.up:
                return link
            if time.monotonic() - self._failed.get(node.name, -RETRY_AFTER) < RETRY_AFTER:
                return None
            try:
                link = self._dial(node, kind)
            except (OSError, ProtocolError, ValueError) as e:
                log.warning("rdma link to node %s (%s) not set up: %s; using tcp", node.name, kind, e)
                link = None
            if link is None:
                self._failed[node.name] = time.monotonic()
            return link

    def _dial(self, node: Node, kind: str) -> AnyLink | None:
        s = dial(node, self.key, {"rdma": kind, "node": self.node})
        if s is None:
            return None
        s.settimeout(SETUP_TIMEOUT)
        dev, ring = self._device_for(kind, s, node.name)
        link = self._engine_for(kind).add_link(node.name, dev, ring)
        try:
            send_json(s, link.info.to_dict())
            answer = recv_json(s)
            if isinstance(answer, dict) and "error" in answer:
                raise ProtocolError(f"node {node.name} said: {answer['error']}")
            link.engine.connect(link, SetupInfo.from_dict(answer))
            self._ready(link, dev, s, kind, client=True)
        except BaseException:
            self._retire(link)
            if kind != "rdma":
                dev.close()   # a cabled device: its cable, s, goes with it
            else:
                s.close()
            raise
        self._install(node.name, link, s if kind == "rdma" else None)
        return link

    def _device_for(self, kind: str, s: socket.socket, peer: str) -> tuple[Device, RingConfig | None]:
        """The device of a link of this kind, and its rings (None: the engine's): the host's RDMA
        device, or a new device of the cabled provider on the set-up connection `s`."""
        if kind == "rdma":
            return self.rdma_device(), None
        return self.cabled.open(s, f"{kind}-{peer}"), self.cabled.ring

    def _ready(self, link: AnyLink, dev: Device, s: socket.socket, kind: str, client: bool) -> None:
        """Both QPs are in RTR once this returns: the link may carry connections."""
        if kind != "rdma":   # a cabled device: each side's hello says its QP is ready
            dev.start()
            deadline = time.monotonic() + SETUP_TIMEOUT
            while not dev.port().active:
                if time.monotonic() > deadline or dev.down:
                    raise ConnectionError(f"no {kind} hello from the peer")
                time.sleep(0.001)
        elif client:
            s.sendall(b"R")
        elif s.recv(1, socket.MSG_WAITALL) != b"R":
            raise ConnectionError("the peer did not finish the rdma set-up")

    # ---- server side (called by tcp.py once the peer proved the cluster secret) -----------------
    def serve(self, s: socket.socket, node: Node, request: object) -> None:
        kind = self.kind(node.name)
        dev: Device | None = None
        link: AnyLink | None = None
        try:
            if request != kind:
                mine = self.transport_for(node.name)
                why = "no RDMA device here" if kind is None and mine in ("rdma", "auto") else \
                    f"this node uses {mine} with {node.name}, not {request}"
                send_json(s, {"error": why})
                s.close()
                return
            remote = SetupInfo.from_dict(recv_json(s))
            dev, ring = self._device_for(kind, s, node.name)
            link = self._engine_for(kind).add_link(node.name, dev, ring)
            link.engine.connect(link, remote)
            send_json(s, link.info.to_dict())
            self._ready(link, dev, s, kind, client=False)
        except (OSError, ProtocolError, ValueError) as e:
            log.warning("rdma set-up from node %s failed: %s", node.name, e)
            if link is not None:
                self._retire(link)
            if kind != "rdma" and dev is not None:
                dev.close()
            else:
                s.close()
            return
        self._install(node.name, link, s if kind == "rdma" else None)

    def _install(self, node: str, link: AnyLink, lifeline: socket.socket | None) -> None:
        with self._lock:
            old = self.links.get(node)
            self.links[node] = link
            self._failed.pop(node, None)
            if lifeline is not None:
                self._lifelines[link] = lifeline
                threading.Thread(target=self._watch, args=(link, lifeline), name="rdma-lifeline", daemon=True).start()
        if old is not None and old is not link:
            self._retire(old)
        if self.on_change is not None:
            self.on_change()

    def _watch(self, link: AnyLink, lifeline: socket.socket) -> None:
        lifeline.settimeout(None)
        try:
            lifeline.recv(1)
        except OSError:
            pass
        self._retire(link)

    # ---- connections from the peer -------------------------------------------------------------
    def _accept(self, link: AnyLink, src: Endpoint, dst: Endpoint, app: socket.socket, answer) -> bool:
        """In the engine's thread. The offer goes out from here when the sandbox's socket takes it at
        once, its supervisor's greeting accepting it in the pump (no thread of ours waits for the
        answer: one opener with no taker is reset by its OPEN_TIMEOUT); else a thread delivers it.
        (A pod of the kernel-chosen path's never comes here: the compiled pump connects to it.)"""
        if self.offer is not None:
            fut = self.offer(dst, src, app, self.name)
            if fut is not None:
                app.close()   # the offer in flight holds it
                fut.add_done_callback(lambda f: answer(bool(f.result() and f.result().get("ok"))))
                return True

        def deliver() -> None:
            try:
                ok = self.deliver(dst, src, app, self.name, False)
            finally:
                app.close()
            answer(ok)
        self._pool.submit(deliver)
        return False

    # ---- the end of links ----------------------------------------------------------------------
    def _down(self, link: AnyLink) -> None:
        """The link's QP failed (in the engine's thread): new connections set up a new one."""
        threading.Thread(target=self._retire, args=(link,), name="rdma-retire", daemon=True).start()

    def _retire(self, link: AnyLink) -> None:
        with self._lock:
            if self.links.get(link.name) is link:
                del self.links[link.name]
            lifeline = self._lifelines.pop(link, None)
            if link in self._retired:
                return
            self._retired.add(link)
        if self.on_change is not None:   # (before the link closes: no connect is sent to it from now on)
            self.on_change()
        try:
            link.engine.close_link(link)
        except (OSError, concurrent.futures.TimeoutError):
            pass
        if link.device is not self._device:   # a cabled link's own device
            link.device.close()
        if lifeline is not None:
            lifeline.close()

    def status(self) -> dict[str, dict]:
        """Per peer node: provider, device, QP number and open connections."""
        with self._lock:
            links = dict(self.links)
        return {n: {"provider": link.device.provider, "pump": link.engine.provider, "device": link.device.name,
                    "qpn": link.info.qpn, "connections": link.connections, "up": link.up}
                for n, link in links.items()}

    def close(self) -> None:
        with self._lock:
            links = list(self.links.values())
        for link in links:
            self._retire(link)
        self.engine.close()
        if self._pump is not None:
            self._pump.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._device is not None:
            self._device.close()


def open_pyverbs(port: RdmaPort = RdmaPort()) -> Device:
    """The RDMA port tsor.yaml's `rdma:` names (or the provider's default one), through pyverbs."""
    from tsor.verbs import pyverbs_provider
    return pyverbs_provider.open_device(port.device, port.port, port.gid_index)
