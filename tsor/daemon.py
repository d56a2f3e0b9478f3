"""`tsord`: the node daemon. Sandboxes register with it and ask it, per TCP connect, for a path.

    tsord --config /etc/quark/tsor.yaml     (foreground; logs to stderr; SIGTERM/SIGINT: clean exit)

One thread reads each registered sandbox's socket (at most MAX_SESSIONS); until its hello is
verified a connection gets no thread of its own: one gate thread holds them all, at most
MAX_UNREGISTERED for HELLO_TIMEOUT each (tsor/gate.py). Connects are served from a thread pool,
because a local connect waits for the server sandbox to take its end. On the local and tcp paths
tsord holds no connection once it is set up: killing or restarting it never breaks an established
connection, and while it is down sandboxes connect natively. The rdma path's pump runs in tsord
(transport/rdma.py): its connections end, reset, with it.

Per-sandbox bounds keep one noisy pod from slowing every pod's set-ups: at most SETUPS_PER_SANDBOX
of a sandbox's connects are being set up at once (the pool's share one sandbox can hold), and at most
OFFERS_PER_SANDBOX connections wait for a listening sandbox to take them (a listener that does not
answer holds a pool thread for OFFER_TIMEOUT each); the listening sandbox itself takes no more than
its listener's backlog queues (tsor/sandbox.py). What exceeds a bound is native — the kernel's TCP,
as without quark — and counted (`tsor_limited_total{limit}`).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import logging
import os
import random
import signal
import socket
import sys
import threading
import time

from tsor import DEFAULT_CONFIG, config as configmod, protocol, routes as routesmod
from tsor import kernel_sockets, local_path_marker, remote_path, service_lb, sockmap, sockopt_offload
from tsor.addr import Endpoint, family_of, is_unspecified, unmapped
from tsor.bytecount import TcpByteCounter
from tsor.errors import ConfigError, NotAllowed, ProtocolError
from tsor.gate import Gate, Pending
from tsor.identity import Identity, ProcVerifier, Verifier
from tsor.metrics import Metrics, MetricsServer
from tsor.netpol import ALLOW
from tsor.peers import Generation
from tsor.pods import Pod, PodRegistry, check_claim
from tsor.transport.local import LocalTransport
from tsor.transport.rdma_link import Cabled, RdmaTransport, open_pyverbs
from tsor.transport.rdma_pump import PumpLink
from tsor.transport.tcp import TcpTransport

log = logging.getLogger("tsor.daemon")
OFFER_TIMEOUT = 5.0
MAX_SESSIONS = 1024       # registered sandboxes (a thread each); a kubelet's default maxPods is 110
MAX_UNREGISTERED = 64     # connections that have not said a valid hello yet
SETUPS_PER_SANDBOX = 8    # a sandbox's connects being set up at once (of the pool's 32 threads)
OFFERS_PER_SANDBOX = 16   # connections offered to one listening sandbox and not yet answered
HELLO_TIMEOUT = 5.0       # ... for this long; supervisors retry every second


class Session:
    """One sandbox's connection to tsord."""

    def __init__(self, daemon: "Daemon", sock: socket.socket, peer_pid: int) -> None:
        self.daemon, self.sock, self.peer_pid = daemon, sock, peer_pid
        self.identity: Identity | None = None
        self.direct = False     # takes routes and channels to other sandboxes' listeners (tsor/peers.py)
        self.offload = False    # needs AF_UNIX ends made in quark's cgroup (tsor/sockopt_offload.py)
        self._send_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._waiting: dict[int, concurrent.futures.Future] = {}
        self.closed = False
        self._setups = 0        # its connects being set up now (SETUPS_PER_SANDBOX)
        self._setups_lock = threading.Lock()

    def begin_setup(self, limit: int) -> bool:
        with self._setups_lock:
            if self._setups >= limit:
                return False
            self._setups += 1
            return True

    def end_setup(self) -> None:
        with self._setups_lock:
            self._setups -= 1

    @property
    def offers_waiting(self) -> int:
        """Requests to this sandbox not answered yet (offers of connections, channels)."""
        return len(self._waiting)

    @property
    def name(self) -> str:
        return self.identity.sandbox if self.identity else f"pid {self.peer_pid}"

    def send(self, data: bytes, fds: list[int] = ()) -> None:
        with self._send_lock:
            protocol.send(self.sock, data, fds)

    def ask(self, message: object, fds: list[int], timeout: float) -> dict | None:
        """Send a request to the sandbox and wait for its reply (None: no reply in time, or gone)."""
        mid = next(self._ids)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._waiting[mid] = fut
        try:
            self.send(protocol.encode(mid, message), fds)
            return fut.result(timeout)
        except (OSError, concurrent.futures.TimeoutError):
            return None
        finally:
            self._waiting.pop(mid, None)

    def ask_nowait(self, message: object, fds: list[int]) -> concurrent.futures.Future | None:
        """ask() for a thread that must not block: the request goes out now if the socket takes it
        at once (None: it did not); the future gets the reply, or None if the sandbox goes away."""
        if self.closed or not self._send_lock.acquire(blocking=False):
            return None
        mid = next(self._ids)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._waiting[mid] = fut
        try:
            socket.send_fds(self.sock, [protocol.encode(mid, message)], list(fds), socket.MSG_DONTWAIT)
        except OSError:
            self._waiting.pop(mid, None)
            return None
        finally:
            self._send_lock.release()
        fut.add_done_callback(lambda _: self._waiting.pop(mid, None))
        return fut

    def tell(self, message: object, fds: list[int] = ()) -> None:
        """Send the sandbox a request whose answer nobody waits for (it is dropped on arrival)."""
        self.send(protocol.encode(next(self._ids), message), fds)

    def answered(self, mid: int, msg: dict) -> None:
        fut = self._waiting.get(mid)
        if fut is not None and not fut.done():
            fut.set_result(msg)

    def close(self) -> None:
        self.closed = True
        for fut in list(self._waiting.values()):
            if not fut.done():
                fut.set_result(None)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)   # wakes the reader thread; close() alone would not
        except OSError:
            pass
        self.sock.close()


class Daemon:
    def __init__(self, cfg: configmod.Config, verifier: Verifier | None = None,
                 route_source: routesmod.RouteSource | None = None, cabled: Cabled | None = None) -> None:
        """cabled: a software verbs provider for the host's tests (transport/rdma_link.py's Cabled);
        production tsord has none."""
        self.cfg = cfg
        self.cabled = cabled
        self.verifier = verifier or ProcVerifier()
        self.metrics = Metrics()
        self.routes = routesmod.RouteTable()
        # the route generation supervisors check before connecting directly (tsor/peers.py): any
        # change of the routes or NetworkPolicies bumps it
        self.generation = Generation()
        self.routes.changed = self.generation.bump
        self.route_source = route_source or _route_source(cfg)
        self.pods = PodRegistry(os.path.join(cfg.state_dir, "pods.json"))
        self.own_netns = os.stat("/proc/self/ns/net").st_ino
        self._lock = threading.Lock()
        self.sessions: set[Session] = set()
        self.listeners: dict[Endpoint, tuple[Session, int]] = {}
        self.pool = concurrent.futures.ThreadPoolExecutor(32, thread_name_prefix="connect")
        self.setups_per_sandbox, self.offers_per_sandbox = SETUPS_PER_SANDBOX, OFFERS_PER_SANDBOX
        self._stopped = threading.Event()
        self.local = LocalTransport(self.deliver)
        self.remote = None
        self.rdma: RdmaTransport | None = None
        self.server: socket.socket | None = None
        self.offload: sockopt_offload.Offload | None = None
        self.sockmap: sockmap.Registrar | None = None   # local_path: sockmap
        self.service_lb: service_lb.ServiceLB | None = None   # ... and its Services chosen at connect()
        self.service_sync: service_lb.Syncer | None = None
        self.remote_path: remote_path.RemotePath | None = None   # ... and other nodes' pods into the pump
        self.gate: Gate | None = None
        self.metrics_server: MetricsServer | None = None
        self.metrics.gauges = lambda: {"sandboxes": len(self.sessions), "listeners": len(self.listeners),
                                       "pods": len(self.pods), "route_pods": len(self.routes.pods),
                                       "route_services": len(self.routes.services),
                                       **({"sockmap_ends": self.sockmap.path.connections(),
                                           "sockmap_addresses_not_carried": len(self.sockmap.left_native)}
                                          if self.sockmap else {}),
                                       **({"service_ports": self.service_lb.service_ports(),
                                           "service_endpoints": self.service_lb.service_endpoints(),
                                           "service_ports_left_to_node": self.service_lb.left_to_node()}
                                          if self.service_lb else {}),
                                       **({"remote_path_accepted": self.rdma._pump.listened[0],
                                           "remote_path_unclaimed": self.rdma._pump.listened[1],
                                           "remote_path_verdicts": self.remote_path.verdicts,
                                           "remote_path_networks_left_native": len(self.remote_path.left_native)}
                                          if self.remote_path else {})}
        self.bytes = TcpByteCounter()   # tcp path: the kernel counts, see tsor/bytecount.py
        self.metrics.byte_counts = self._byte_counts
        self.metrics.rdma_links = lambda: self.rdma.status() if self.rdma is not None else {}
        self.metrics.rdma_resets = lambda: self.rdma.resets if self.rdma is not None else {}
        self.metrics.route_source = getattr(self.route_source, "status", dict)   # KubernetesSource's
        self.metrics.foreign_policies = lambda: self.routes.policy.foreign.scopes() if self.routes.policy else []
        self.metrics.warm_setups = lambda: self.remote.warm.taken if self.remote is not None else 0

    def _byte_counts(self) -> dict[tuple[str, str], int]:
        counts = self.bytes.totals()
        if self.rdma is not None:   # the rdma path's pump counts its own
            counts |= {("rdma", "sent"): self.rdma.bytes_sent, ("rdma", "received"): self.rdma.bytes_received}
        return counts

    # ---- life cycle ----------------------------------------------------------------------------
    def start(self) -> None:
        self.pods.load()
        if self.cfg.sockopt_offload:
            # the local-path and rdma-path ends made here must be covered by the option program
            # for sandboxes whose filter no longer traps TCP_NODELAY/TCP_CORK (tsor/sockopt_offload.py)
            self.offload = sockopt_offload.join()
        self._local_path()
        if self.route_source is not None:
            self.route_source.start(self.routes)
        self.bytes.start()
        self.rdma = RdmaTransport(self.cfg.node, self.deliver, self.cfg.node_key, self.cfg.transport_for,
                                  open_rdma=lambda: open_pyverbs(self.cfg.rdma), offer=self.offer,
                                  pump=self.cfg.rdma.pump, cabled=self.cabled)
        self.remote = TcpTransport(self.deliver, self.routes, self.cfg.listen, self.cfg.node_key, self.rdma.serve,
                                   offer=self.offer)
        self._remote_path()
        os.makedirs(os.path.dirname(self.cfg.socket), exist_ok=True)
        try:
            os.unlink(self.cfg.socket)
        except FileNotFoundError:
            pass
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        s.bind(self.cfg.socket)
        os.chmod(self.cfg.socket, 0o600)   # supervisors run as root; nothing else may register
        s.listen(128)
        self.server = s
        if self.cfg.metrics is not None:
            self.metrics_server = MetricsServer(self.metrics, self.cfg.metrics)
        self.gate = Gate(s, "sandboxes", self._opened, self._greeting, MAX_UNREGISTERED, HELLO_TIMEOUT)
        log.info("tsord node %s serving %s (tcp transport: %s, metrics: %s)", self.cfg.node,
                 self.cfg.socket, self.cfg.listen or "off", self.cfg.metrics or "off")

    def _local_path(self) -> None:
        """local_path: sockmap — take over or attach the programs (tsor/sockmap.py) and tell the
        sandboxes, by a file beside the socket, that they trap no socket call; socketpair — retire
        the programs a sockmap tsord left, if any."""
        root = sockopt_offload.cgroup2_root()
        marker = local_path_marker(self.cfg.socket)
        if self.cfg.local_path != "sockmap":
            _remove(marker)
            said = sockmap.retire(root) if root is not None else None
            if said:
                log.info("sockmap local path off: %s", said)
            if root is not None and service_lb.remove_attached(root):
                log.info("sockmap local path off: Services are the node's NAT's again")
            return
        if root is None:
            raise ConfigError(self.cfg.path, "local_path",
                              "sockmap needs the unified cgroup hierarchy (cgroup2) mounted")
        try:
            path = sockmap.SockmapPath.open(root)
        except OSError as e:
            raise ConfigError(self.cfg.path, "local_path", f"sockmap: {e}") from None
        path.clear()   # a tsord before us registered these; ours follow from hellos and the pod state
        try:
            lb = service_lb.ServiceLB.open(root)
        except OSError as e:
            path.close()
            raise ConfigError(self.cfg.path, "local_path", f"sockmap: Services at connect(): {e}") from None
        self.service_lb = lb
        self.service_sync = service_lb.Syncer(lb, lambda: service_lb.wanted(self.routes, self.cfg.node))
        bump = self.generation.bump

        def changed() -> None:
            bump()
            self.service_sync.changed()
        self.routes.changed = changed
        self.sockmap = sockmap.Registrar(path, lb.set_namespaces)
        self._sync_sockmap()
        # written before the socket is bound: a sandbox that sees the socket sees this too
        os.makedirs(os.path.dirname(marker), exist_ok=True)
        with open(f"{marker}.tmp", "w") as f:
            f.write("sockmap\n")
        os.replace(f"{marker}.tmp", marker)
        log.info("local path: sockmap (programs on %s)", root)

    def _remote_path(self) -> None:
        """local_path: sockmap, with peers and the compiled pump: other nodes' pods through the pump,
        the path chosen by the kernel at connect() (tsor/remote_path.py)."""
        if self.service_lb is None or self.cfg.listen is None or self.cfg.node_key is None:
            return
        if self.rdma.rdma_device() is None:
            return   # (logged by rdma_device: node-to-node connections use tcp)
        pump = self.rdma.compiled_pump()
        if pump is None:
            log.info("remote path off: rdma links use the Python pump")
            return
        address = (self.cfg.listen.host, self.cfg.rdma.pump_port)
        try:
            rp = remote_path.RemotePath(
                self.service_lb, address, self._pump_links, lambda: self.generation.value,
                lambda: self.routes.policy, self.sockmap.address_of,
                lambda src, dst: self.routes.verdict(src, dst)[0] == ALLOW)
        except OSError as e:
            raise ConfigError(self.cfg.path, "rdma.pump_port", f"the pump's listener {address[0]}:{address[1]}: "
                              f"{e.strerror or e}") from None
        try:
            pump.use_maps(self.service_lb.maps[service_lb.CONNS_MAP], self.service_lb.maps[service_lb.PEERS_MAP],
                          self.sockmap.path.addrs, self.service_lb.maps[service_lb.ROOM_MAP], address[0])
            pump.listen(rp.listener)
        except OSError as e:
            rp.close()
            raise ConfigError(self.cfg.path, "rdma.pump_port", f"the pump cannot take the listener: {e}") from None
        self.remote_path = rp
        self.rdma.on_change = rp.changed
        changed = self.routes.changed

        def routes_changed() -> None:
            changed()
            rp.changed()
        self.routes.changed = routes_changed
        threading.Thread(target=self._dial_links, name="rdma-dialer", daemon=True).start()
        log.info("remote path: other nodes' pods through the pump at %s:%d", *address)

    def _pump_links(self) -> dict[str, tuple[tuple[str, ...], int]]:
        """Each node whose compiled-pump link is up: what the route table routes to it (its pod
        networks from a routes file; from Kubernetes, its quark pods' own addresses) and the link's id."""
        by_node: dict[str, list[str]] = {}
        for ip, pod in list(self.routes.pods.items()):
            by_node.setdefault(pod.node, []).append(f"{ip}/32" if ":" not in ip else f"{ip}/128")
        out = {}
        for name, link in list(self.rdma.links.items()):
            node = self.routes.nodes.get(name)
            if node is not None and isinstance(link, PumpLink) and link.up:
                out[name] = (tuple(str(n) for n in node.pods) + tuple(by_node.get(name, ())), link.id)
        return out

    def _dial_links(self) -> None:
        """The remote path needs each rdma peer's link up before any connect can take it (no connect
        asks tsord for one): links are set up as nodes appear, and again after one goes down. Of two
        nodes, the one whose name sorts first sets the link up: two set-ups crossing would each replace
        the other's link (tsor/transport/rdma_link.py)."""
        while not self._stopped.wait(remote_path.RESYNC):
            for node in list(self.routes.nodes.values()):
                if node.name > self.cfg.node and node.address is not None and not self._stopped.is_set():
                    try:
                        self.rdma.usable(node)
                    except OSError as e:   # (usable() logs a failed set-up itself)
                        log.debug("rdma link to %s: %s", node.name, e)

    def _sync_sockmap(self) -> None:
        """The sockmap programs' address map = the addresses of the quark sandboxes registered with
        this tsord (their hellos). Pods quark-cni registered are not enough on their own: the
        conflist registers every pod of the node, runc's too, and those did not ask for quark."""
        if self.sockmap is None:
            return
        with self._lock:
            want = {ip: (f"/proc/{s.identity.pid}/ns/net", s.identity.netns)
                    for s in self.sessions if s.identity is not None for ip in s.identity.addrs}
        try:
            self.sockmap.sync(want)
        except OSError as e:
            log.warning("sockmap: registrations not updated: %s", e)

    def stop(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self.server is not None:
            try:
                os.unlink(self.cfg.socket)
            except FileNotFoundError:
                pass
            _remove(local_path_marker(self.cfg.socket))
            self.gate.close()
            self.server.close()
        if self.remote_path is not None:   # first: connects to other nodes are native from now on
            self.remote_path.close()
        if self.remote is not None:
            self.remote.close()
        if self.rdma is not None:
            self.rdma.close()
        if self.metrics_server is not None:
            self.metrics_server.close()
        self.bytes.close()
        if self.route_source is not None:
            self.route_source.stop()
        for sess in list(self.sessions):
            sess.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.generation.close()
        if self.sockmap is not None:   # attached it stays: the connections it carries keep their way
            self.sockmap.path.close()
        if self.service_sync is not None:   # attached they stay, balancing connects by the last state
            self.service_sync.close()
            self.service_lb.close()
        log.info("tsord stopped")

    # ---- new connections: no thread until the hello checks out -----------------------------------
    def _opened(self, p: Pending) -> bool:
        if len(self.sessions) >= MAX_SESSIONS:
            log.warning("refusing a sandbox: %d are registered already", MAX_SESSIONS)
            return False
        # non-blocking while at the gate: a peer that does not read our replies is dropped, never
        # waited for (the gate thread serves every new connection)
        p.conn.setblocking(False)
        p.state = Session(self, p.conn, kernel_sockets.peer_pid(p.conn))
        return True

    def _greeting(self, p: Pending) -> bool | None:
        """The gate's check: a record from an unregistered sandbox; it passes once its hello did."""
        sess: Session = p.state
        try:
            if not self._packet(sess):
                return False
        except OSError:
            return False
        if sess.identity is None:
            return None
        sess.sock.setblocking(True)
        with self._lock:
            self.sessions.add(sess)
        self._sync_sockmap()
        threading.Thread(target=self._serve, args=(sess,), name="sandbox", daemon=True).start()
        return True

    # ---- one sandbox ---------------------------------------------------------------------------
    def _serve(self, sess: Session) -> None:
        try:
            while self._packet(sess):
                pass
        except OSError:
            pass
        finally:
            self._drop(sess)

    def _packet(self, sess: Session) -> bool:
        """Read and act on one record from a sandbox; False at its end of file."""
        try:
            data, fds = protocol.recv(sess.sock)
        except ProtocolError as e:
            self._malformed(sess, e)
            return True
        for fd in fds:   # sandboxes never send tsord fds
            os.close(fd)
        if not data:
            return False
        try:
            mid, msg = protocol.decode(data)
        except ProtocolError as e:
            self._malformed(sess, e)
            return True
        if isinstance(msg, dict):
            sess.answered(mid, msg)
        else:
            self._request(sess, mid, msg)
        return True

    def _malformed(self, sess: Session, e: Exception) -> None:
        self.metrics.error("protocol")
        log.warning("malformed message from %s: %s", sess.name, e)
        try:
            sess.send(protocol.reply(getattr(e, "mid", -1), error=f"malformed message: {e}"))
        except OSError:
            pass

    def _drop(self, sess: Session) -> None:
        with self._lock:
            self.sessions.discard(sess)
            for key in [k for k, (s, _) in self.listeners.items() if s is sess]:
                del self.listeners[key]
        if not sess.closed:
            sess.close()
        if sess.identity:
            log.info("sandbox %s gone", sess.name)
            self._sync_sockmap()

    def _request(self, sess: Session, mid: int, msg: object) -> None:
        if isinstance(msg, protocol.Hello):
            return self._hello(sess, mid, msg)
        if isinstance(msg, protocol.POD_REQUESTS):
            if sess.identity is not None:   # quark-cni comes on a connection of its own, never a sandbox
                return sess.send(protocol.reply(mid, error="a sandbox cannot register pods"))
            return sess.send(protocol.reply(mid, **self._pod_request(msg)))
        if sess.identity is None:
            return sess.send(protocol.reply(mid, error="hello first"))
        if isinstance(msg, protocol.Listen):
            try:
                self._listen(sess, msg)
            except NotAllowed as e:
                self.metrics.error("claim")
                log.warning("sandbox %s: %s", sess.name, e)
                return sess.send(protocol.reply(mid, error=str(e)))
            sess.send(protocol.reply(mid, ok=True))
        elif isinstance(msg, protocol.Unlisten):
            with self._lock:
                for key in [k for k, (s, t) in self.listeners.items() if s is sess and t == msg.token]:
                    del self.listeners[key]
            sess.send(protocol.reply(mid, ok=True))
        elif isinstance(msg, protocol.Connect):
            if self._stopped.is_set():
                return
            if not sess.begin_setup(self.setups_per_sandbox):
                self.metrics.limited("setups")
                self.metrics.connected("fallback", 0.0)
                return sess.send(protocol.reply(mid, path="fallback"))
            self.pool.submit(self._connect_bounded, sess, mid, msg)
        elif isinstance(msg, protocol.Carried):
            carried = self.sockmap is not None and self.sockmap.path.holds(msg.local, msg.remote, msg.cookie)
            sess.send(protocol.reply(mid, carried=carried))
        elif isinstance(msg, protocol.Tally):   # counts of connections tsord did not see; no reply
            self.metrics.tallied("local", msg.connections, msg.incoming)
            if msg.native:
                self.metrics.tallied("fallback", msg.native)
        else:
            sess.send(protocol.reply(mid, error=f"{type(msg).__name__.lower()} is not a request to tsord"))

    def _hello(self, sess: Session, mid: int, hello: protocol.Hello) -> None:
        try:
            ident = self.verifier.verify(sess.peer_pid, hello)
            with self._lock:
                self._refuse_held_by_another_sandbox(ident.addrs, ident.netns, besides=sess)
                pod = self.pods.claimed_elsewhere(set(ident.addrs), ident.netns)
                if pod is not None:
                    raise NotAllowed(f"addresses {sorted(ident.addrs & set(pod.ips))} belong to pod {pod.label}")
                sess.identity = ident
                sess.direct = hello.direct
                sess.offload = hello.offload
        except NotAllowed as e:
            self.metrics.error("claim")
            log.warning("registration of %s refused: %s", hello.sandbox, e)
            return sess.send(protocol.reply(mid, error=str(e)))
        pod = self.pods.by_netns(ident.netns)
        log.info("sandbox %s registered%s: %s", ident.sandbox, f" (pod {pod.label})" if pod else "",
                 ", ".join(sorted(ident.addrs)) or "no addresses")
        if sess.direct:   # the route generation's page goes with the answer
            sess.send(protocol.reply(mid, ok=True, node=self.cfg.node, direct=True), [self.generation.fd])
        else:
            sess.send(protocol.reply(mid, ok=True, node=self.cfg.node))

    def _refuse_held_by_another_sandbox(self, addrs: set[str] | frozenset[str], netns: int,
                                        besides: Session | None = None) -> None:
        """NotAllowed if a registered sandbox (other than `besides`) of another network namespace
        holds one of `addrs` (the caller holds self._lock)."""
        for other in self.sessions:
            if other is besides or other.identity is None:
                continue
            taken = other.identity.addrs & addrs
            if taken and other.identity.netns != netns:
                raise NotAllowed(f"addresses {sorted(taken)} belong to sandbox {other.identity.sandbox}")

    # ---- pods registered by quark-cni (cni/plugin.py) ------------------------------------------
    def _pod_request(self, msg: object) -> dict:
        """The reply to one of quark-cni's requests. The socket is root's alone (0600), and a
        registration is checked with the kernel like a sandbox's hello (tsor/pods.py)."""
        if isinstance(msg, protocol.Ping):
            return {"ok": True, "node": self.cfg.node}
        if isinstance(msg, protocol.PodGc):
            removed = self.pods.gc(set(msg.keep))
            for key in removed:
                log.info("pod %s: no longer an attachment of the runtime; forgotten", key)
            return {"ok": True, "removed": removed}
        if isinstance(msg, protocol.PodDel):
            existed = self.pods.remove(f"{msg.sandbox}/{msg.ifname}")
            if existed:
                log.info("pod %s/%s deregistered", msg.sandbox, msg.ifname)
            return {"ok": True, "existed": existed}
        if not msg.sandbox or not msg.ifname or not os.path.isabs(msg.netns):
            return {"error": "sandbox, ifname and an absolute netns path are needed"}
        try:
            inode, ips = check_claim(msg.netns, msg.ips, self.own_netns)
            if isinstance(msg, protocol.PodCheck):
                pod = self.pods.get(f"{msg.sandbox}/{msg.ifname}")
                if pod is None:
                    raise NotAllowed(f"pod {msg.sandbox}/{msg.ifname} is not registered")
                if (pod.netns_inode, pod.ips) != (inode, ips):
                    raise NotAllowed(f"pod {pod.label} was registered with netns {pod.netns} and {list(pod.ips)}")
                return {"ok": True}
            with self._lock:
                self._refuse_held_by_another_sandbox(set(ips), inode)
            pod = Pod(msg.sandbox, msg.ifname, msg.netns, inode, ips, msg.name, msg.namespace, msg.uid)
            self.pods.add(pod)
        except NotAllowed as e:
            self.metrics.error("claim")
            log.warning("pod %s/%s: %s", msg.sandbox, msg.ifname, e)
            return {"error": str(e)}
        log.info("pod %s registered: sandbox %s, %s, %s", pod.label, pod.sandbox, pod.netns,
                 ", ".join(ips) or "no addresses")
        return {"ok": True}

    def _listen(self, sess: Session, msg: protocol.Listen) -> None:
        addrs = sess.identity.addrs
        ip = unmapped(msg.addr)
        if is_unspecified(ip):
            fam = family_of(ip)
            dual = fam == socket.AF_INET6 and not msg.v6only
            ips = [a for a in addrs if dual or family_of(a) == fam]
        elif ip in addrs:
            ips = [ip]
        else:
            raise NotAllowed(f"listen on {ip}: not an address of sandbox {sess.name}")
        with self._lock:
            for a in ips:
                self.listeners[(a, msg.port)] = (sess, msg.token)
        self.generation.bump()   # supervisors' cached "native" answers (tsor/peers.py) no longer hold

    # ---- connections ---------------------------------------------------------------------------
    def _connect_bounded(self, sess: Session, mid: int, msg: protocol.Connect) -> None:
        try:
            self._connect(sess, mid, msg)
        finally:
            sess.end_setup()

    def _connect(self, sess: Session, mid: int, msg: protocol.Connect) -> None:
        t0 = time.monotonic()
        generation = self.generation.value   # before anything is decided: a change meanwhile voids the route
        dst = (unmapped(msg.dst[0]), msg.dst[1])
        dialled = dst
        fam = family_of(dst[0])
        own = sorted(a for a in sess.identity.addrs if family_of(a) == fam)
        path, sock = "fallback", None
        # a fallback decided by addresses alone (not a pod TSoR carries from here, no Service, no
        # policy verdict, no transport tried) holds until the route generation changes: the
        # supervisor may answer the next connect to dst natively without asking (tsor/peers.py)
        cacheable = not own
        if own:
            # a Service ClusterIP:port goes to one of its endpoints (the reply names none of this:
            # the application's peer stays the address it dialled, as with kube-proxy's DNAT)
            dst = self._endpoint(dst, fam)
        if own and dst is not None:
            src = (own[0], msg.src_port)
            local = dst in self.listeners
            node = None if local else self.routes.lookup(dst[0])
            # another node's pod is carried when this node can reach its tsord (the rdma path too is
            # set up over that connection); without a peer address or cluster secret it is native
            carried = local or (node is not None and node.name != self.cfg.node and self.remote.serves(node))
            cacheable = not carried and dst == dialled
            # a TSoR path skips the node's packet filters: only what NetworkPolicy allows takes one
            # (denied, or tsord cannot tell: native, where the node's enforcement decides)
            if carried and self._policy_allows(sess, own[0], dst):
                try:
                    if local:   # (deliver refuses a listener an end made here would not serve)
                        if self._covers(sess):
                            path, sock = "local", self.local.connect(None, src, dst)
                    elif self.rdma.usable(node) and self._covers(sess):
                        path, sock = "rdma", self.rdma.connect(node, src, dst)
                    else:
                        path, sock = "tcp", self.remote.connect(node, src, dst)
                except OSError as e:
                    log.warning("connect %s -> %s failed: %s", sess.name, dst, e)
                    sock = None
        if sock is None:
            path = "fallback"
        self.metrics.connected(path, time.monotonic() - t0)
        log.debug("connect %s -> %s:%d%s: %s", sess.name, msg.dst[0], msg.dst[1],
                  f" ({dst[0]}:{dst[1]})" if dst is not None and dst != tuple(msg.dst) else "", path)
        try:
            if sock is None:
                cached = {"native": generation} if cacheable and sess.direct else {}
                sess.send(protocol.reply(mid, path="fallback", **cached))
            else:
                with sock:
                    if path == "tcp":
                        self.bytes.track(sock)
                    route = self._route(sess, dst, generation) if path == "local" and dst == dialled else None
                    if route is None:
                        sess.send(protocol.reply(mid, path=path, src=src), [sock.fileno()])
                    else:
                        fields, channel = route
                        with channel:
                            sess.send(protocol.reply(mid, path=path, src=src, direct=fields),
                                      [sock.fileno(), channel.fileno()])
        except OSError:
            pass

    def _route(self, sess: Session, dst: Endpoint, generation: int) -> tuple[dict, socket.socket] | None:
        """For a local-path connect to a pod address (never a Service's): a route and a channel end
        to the listening sandbox, whose supervisor gets the other end now (tsor/peers.py); None when
        either sandbox cannot take one."""
        entry = self.listeners.get(dst)
        if entry is None or not sess.direct:
            return None
        server, token = entry
        if not server.direct or server.identity is None or (server.offload and not sess.offload):
            return None   # (the client's supervisor makes the ends a channel carries: see _covers)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            with theirs:
                server.tell(protocol.Peer(sess.name, sorted(sess.identity.addrs)), [theirs.fileno()])
        except OSError:
            ours.close()
            return None
        return {"token": token, "generation": generation, "sandbox": server.name}, ours

    def _covers(self, sess: Session) -> bool:
        """Whether an AF_UNIX end made here works in `sess`'s sandbox: one whose filter leaves
        TCP_NODELAY/TCP_CORK to the kernel needs ends made in quark's cgroup, as tsord is when it
        joined it (so are offloading supervisors, which make the ends of direct channels)."""
        return self.offload is not None or not sess.offload

    def _policy_allows(self, sess: Session, src_ip: str, dst: Endpoint) -> bool:
        """With routes from Kubernetes, whether the NetworkPolicies allow a connection TSoR would
        carry (tsor/netpol.py). Both ends must be quark pods the route source knows; anything else,
        or a policy tsord cannot evaluate, is native."""
        verdict, why = self.routes.verdict(src_ip, dst)
        if verdict != ALLOW:
            self.metrics.policy_native(verdict)
            log.debug("connect %s -> %s:%d native: %s (%s)", sess.name, dst[0], dst[1], verdict, why)
        return verdict == ALLOW

    def _endpoint(self, dst: Endpoint, family: int) -> Endpoint | None:
        """Where a connect to `dst` goes: `dst` itself, or for a Service ClusterIP:port one of its ready
        endpoints picked at random as kube-proxy does (None: native, kube-proxy's to do: no ready
        endpoint, or ClientIP session affinity, whose memory is kube-proxy's). Whether the endpoint
        takes a TSoR path is then decided as for any pod address: only quark pods do."""
        svc = self.routes.service(*dst)
        if svc is None:
            return dst
        if svc.client_affinity:
            return None
        endpoints = self.routes.endpoints(svc, family, self.cfg.node)
        return random.choice(endpoints) if endpoints else None

    def deliver(self, dst: Endpoint, peer: Endpoint, sock: socket.socket, path: str, greet: bool) -> bool:
        """Offer a connection to the sandbox listening on dst; True if it took it."""
        entry = self.listeners.get((unmapped(dst[0]), dst[1]))
        if entry is None:
            return False
        sess, token = entry
        if (path != "tcp" and not self._covers(sess)) or not self._offer_room(sess):
            return False
        if path == "tcp":   # before the offer: the application may use it as soon as it is taken
            self.bytes.track(sock, greeting=greet)
        answer = sess.ask(protocol.Incoming(token, peer, dst, path, greet), [sock.fileno()], OFFER_TIMEOUT)
        if not answer or not answer.get("ok"):
            if answer and answer.get("full"):
                self.metrics.limited("backlog")   # the listener's backlog of queued connections is full
            if path == "tcp":
                self.bytes.untrack(sock)
            return False
        self.metrics.delivered(path)
        return True

    def _offer_room(self, sess: Session) -> bool:
        """May one more connection be offered to `sess` now (OFFERS_PER_SANDBOX)? Counted if not."""
        if sess.offers_waiting < self.offers_per_sandbox:
            return True
        self.metrics.limited("offers")
        return False

    def offer(self, dst: Endpoint, peer: Endpoint, sock: socket.socket,
              path: str) -> concurrent.futures.Future | None:
        """deliver() for a thread that must not block (the rdma engine's, the tcp gate's): the offer
        (its supervisor writes the greeting before it queues the connection) goes out now, or not
        at all (None)."""
        entry = self.listeners.get((unmapped(dst[0]), dst[1]))
        if entry is None or (path != "tcp" and not self._covers(entry[0])):
            return None   # (deliver(), which the caller falls back to, refuses it then)
        sess, token = entry
        if not self._offer_room(sess):
            return None
        if path == "tcp":   # before the offer: the application may use it as soon as it is taken
            self.bytes.track(sock, greeting=True)
        fut = sess.ask_nowait(protocol.Incoming(token, peer, dst, path, True), [sock.fileno()])
        if fut is None:
            if path == "tcp":
                self.bytes.untrack(sock)
            return None

        def done(f: concurrent.futures.Future) -> None:
            if f.result() and f.result().get("ok"):
                self.metrics.delivered(path)
                return
            if f.result() and f.result().get("full"):
                self.metrics.limited("backlog")
            if path == "tcp":
                self.bytes.untrack(sock)
        fut.add_done_callback(done)
        return fut


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _route_source(cfg: configmod.Config) -> routesmod.RouteSource | None:
    if cfg.kubernetes is not None:
        from tsor.routes_k8s import KubernetesSource   # the kubernetes client only where it is used
        return KubernetesSource(cfg.kubernetes, cfg.tsord_port)
    return routesmod.StaticFile(cfg.routes) if cfg.routes else None


def main(argv: list[str] | None = None, cabled: Cabled | None = None) -> int:
    """tsord. cabled: tests/support/softverbs_tsord.py's software provider (its name becomes a
    `transport` tsor.yaml may give)."""
    p = argparse.ArgumentParser(prog="tsord", description="TSoR node daemon (runs in the foreground)")
    p.add_argument("--config", default=DEFAULT_CONFIG, help="config file (default: %(default)s)")
    p.add_argument("--debug", action="store_true", help="log every connection")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.INFO, stream=sys.stderr,
                        format="tsord %(levelname)s %(name)s: %(message)s")
    try:
        cfg = configmod.load(args.config, configmod.TRANSPORTS + ((cabled.name,) if cabled else ()))
        daemon = Daemon(cfg, cabled=cabled)
        daemon.start()
    except (ConfigError, OSError) as e:
        print(f"tsord: {e}", file=sys.stderr)
        return 1
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    while not done.wait(3600):
        pass
    daemon.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
