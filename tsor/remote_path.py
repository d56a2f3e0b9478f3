"""The remote leg of the kernel-chosen path: a quark pod's connection to a pod of another node, carried
over the node pair's RDMA link by the compiled pump with nothing trapped and no Python on its way.

With `local_path: sockmap` and an rdma link to a node (tsor.yaml's `transport`, the compiled pump),
the connect4 program (tsor/bpf/service_lb.bpf.c) sends a registered pod's connect() to an address
of that node's pods (after a Service ClusterIP became one of its endpoints) to this node's pump
listener instead; the kernel's own handshake makes it, and a sock_ops program notes, by the
client's address, where it was going. The pump (tsor/transport/rdma_pump.c) accepts it, reads that
note, and opens a channel to the far node with the accepted socket as the channel's end. The far
node's pump, for a pod of its node (the sockmap path's address map), writes the client pod's
address into the peers map, so that the pod's accept() and getpeername() answer the client pod,
connects to the pod from its node's address and makes that socket the channel's far end. No Python
and no trapped call on either side. Both applications see the real pod addresses and ports:
getpeername() on the client answers what it dialled (the programs' getpeername4), getsockname() is
its own; the server's accept() and getpeername() answer the client pod's address and port.

NetworkPolicy is never bypassed: the legs into and out of the pump skip the node's packet filters,
so a connect takes the pump only with tsord's verdict (tsor/netpol.py; egress and ingress both, as
the route source knows every pod's policies) for the client pod's namespace, the endpoint and the
current route generation. None yet: the connect is native (the filters decide it) and the miss is
noted; tsord decides it within `VERDICT_POLL` seconds for the connects after. Routes from a file
(no Kubernetes): no policy, every pumped connect allowed. The far node trusts the verdict of the
node that proved the cluster secret, as the tcp and rdma paths' far sides always have.

tsord is the control plane: it writes the remote map (each linked node's pod networks -> this
node's pump listener and the link), the verdicts and the route generation, and is on no
connection's path. A link that goes down leaves the map at once; connects to that node are native
until it is up again. The pump's listening socket is in the programs' pump map: when it closes
(tsord exits or dies, and the pump with it), the kernel takes it out, and connects to other nodes
are native from that moment, not refused.
"""
from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections.abc import Callable

from qlib import bpf
from tsor import service_lb
from tsor.addr import Endpoint

log = logging.getLogger("tsor.remote_path")
VERDICT_POLL = 0.02     # how often the misses map is read
REFRESH_MAX = 4096      # verdicts decided again at once when the route generation changes
RESYNC = 1.0            # the remote map is checked against the links at least this often

_VERDICT_KEY = struct.Struct("=QIHH")    # struct verdict_key {u64 netns; u32 ip4; u16 port (network order); pad}


def remote_value(pump: Endpoint, link_id: int) -> bytes:
    """struct remote {u32 pump_ip4; u16 pump_port (network order); u16 link}"""
    return socket.inet_aton(pump[0]) + struct.pack("!H", pump[1]) + struct.pack("=H", link_id)


def remote_key(network: str) -> bytes:
    """struct remote_key {u32 prefixlen; u32 ip4}: an LPM trie's key"""
    ip, _, bits = network.partition("/")
    return struct.pack("=I", int(bits or 32)) + socket.inet_aton(ip)


def peer_key(pod: Endpoint, pump: Endpoint) -> bytes:
    """struct peer_key {u32 local_ip4; u32 remote_ip4; u16 local_port; u16 remote_port} (the pod's end)"""
    return socket.inet_aton(pod[0]) + socket.inet_aton(pump[0]) + struct.pack("!HH", pod[1], pump[1])



class RemotePath:
    """tsord's side of the remote leg: the listener it gives the pump and the maps it keeps."""

    def __init__(self, lb: service_lb.ServiceLB, pump_address: Endpoint,
                 links: Callable[[], dict[str, tuple[tuple[str, ...], int]]],
                 generation: Callable[[], int], policy: Callable[[], object | None],
                 pod_of: Callable[[int], str | None], decide: Callable[[str, Endpoint], bool],
                 listener: socket.socket | None = None) -> None:
        """links() -> {node: (its pod networks, the pump's link id)} for every node whose link is up;
        generation() -> the route generation; policy() -> the NetworkPolicy evaluator (None: no
        Kubernetes); pod_of(netns cookie) -> that registered pod's IPv4 address; decide(src ip, dst)
        -> whether NetworkPolicy allows src's connection to dst. listener: the pump's listening socket
        at pump_address (default: one made here, in tsord's network namespace)."""
        self.lb, self.pump_address = lb, pump_address
        self.links, self.generation, self.policy, self.pod_of, self.decide = links, generation, policy, pod_of, decide
        self.maps = lb.maps
        self._remote: dict[bytes, bytes] = {}
        self._lock = threading.Lock()
        self._stop, self._dirty = threading.Event(), threading.Event()
        self.verdicts = 0
        self.left_native: set[bytes] = set()   # pod networks the remote map had no room for
        self._verdicts_full = False
        self._generation: int | None = None   # the one the config map holds
        if listener is None:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(pump_address)
            listener.listen(4096)
        self.listener = listener
        # while it listens, the programs send connects to it (the kernel removes it when it closes)
        bpf.map_update(self.maps[service_lb.PUMP_MAP], struct.pack("=I", 0), struct.pack("=Q", listener.fileno()))
        for key in bpf.map_keys(self.maps[service_lb.REMOTE_MAP], 8):   # a predecessor's: rewritten below
            self._remote[key] = b""
        self._thread = threading.Thread(target=self._run, name="remote-path", daemon=True)
        self._thread.start()

    # ---- the client's node -------------------------------------------------------------------------
    def changed(self) -> None:
        """Routes or links changed: the maps follow."""
        self._dirty.set()

    def _run(self) -> None:
        last = 0.0
        while not self._stop.wait(VERDICT_POLL):
            try:
                now = time.monotonic()
                if self._dirty.is_set() or now - last >= RESYNC:
                    self._dirty.clear()
                    last = now
                    self.sync()
                self.answer_misses()
            except (OSError, RuntimeError) as e:   # (RuntimeError: a table changed while read)
                log.warning("remote path: maps not updated: %s", e)

    def sync(self) -> None:
        """The config and remote maps made to match the routes and the links up now. A new route
        generation first gets the verdicts in use decided again (up to REFRESH_MAX), so that the
        connects after a change of routes or policies do not all go native once to ask again."""
        generation = self.generation() & 0xFFFFFFFF
        if generation != self._generation and self._generation is not None and self.policy() is not None:
            self._refresh(generation)
        cfg = struct.pack("=II", generation, 0 if self.policy() is None else 1)
        bpf.map_update(self.maps[service_lb.CONFIG_MAP], struct.pack("=I", 0), cfg)
        self._generation = generation
        want: dict[bytes, bytes] = {}
        for node, (networks, link_id) in self.links().items():
            for net in networks:
                if ":" not in net:
                    want[remote_key(net)] = remote_value(self.pump_address, link_id)
        with self._lock:
            for key in set(self._remote) - set(want):
                bpf.map_delete(self.maps[service_lb.REMOTE_MAP], key)
                del self._remote[key]
            full = set()
            for key, value in want.items():
                if self._remote.get(key) != value:
                    try:
                        bpf.map_update(self.maps[service_lb.REMOTE_MAP], key, value)
                    except OSError as e:
                        if not bpf.full(e):
                            raise
                        full.add(key)   # its pods' connects stay native
                        continue
                    self._remote[key] = value
            if full and not self.left_native:
                log.warning("remote path: the remote map is full: %d pod networks of linked nodes are left native "
                            "until there is room", len(full))
            elif self.left_native and not full:
                log.info("remote path: every linked node's pod networks are in the remote map again")
            self.left_native = full

    def _refresh(self, generation: int) -> None:
        verdicts = self.maps[service_lb.VERDICTS_MAP]
        for key in bpf.map_keys(verdicts, _VERDICT_KEY.size)[:REFRESH_MAX]:
            netns, ip4, port, _ = _VERDICT_KEY.unpack(key)
            src = self.pod_of(netns)
            if src is None:   # that pod is gone
                bpf.map_delete(verdicts, key)
                continue
            dst = (socket.inet_ntoa(struct.pack("=I", ip4)), socket.ntohs(port))
            self._verdict(key, struct.pack("=II", generation, int(self.decide(src, dst))), generation)
            self.verdicts += 1

    def answer_misses(self) -> int:
        """Decide the verdicts connects found missing; how many."""
        misses = self.maps[service_lb.MISSES_MAP]
        keys = bpf.map_keys(misses, _VERDICT_KEY.size)
        generation = self.generation() & 0xFFFFFFFF
        for key in keys:
            netns, ip4, port, _ = _VERDICT_KEY.unpack(key)
            src = self.pod_of(netns)
            dst = (socket.inet_ntoa(struct.pack("=I", ip4)), socket.ntohs(port))
            allow = src is not None and self.decide(src, dst)
            self._verdict(key, struct.pack("=II", generation, int(allow)), generation)
            bpf.map_delete(misses, key)
            self.verdicts += 1
        return len(keys)

    def _verdict(self, key: bytes, value: bytes, generation: int) -> None:
        """A verdict into its map; a full map first loses the verdicts of older generations, and
        where that is not room enough the connect stays native (logged once)."""
        verdicts = self.maps[service_lb.VERDICTS_MAP]
        for attempt in range(2):
            try:
                bpf.map_update(verdicts, key, value)
                self._verdicts_full = False
                return
            except OSError as e:
                if not bpf.full(e):
                    raise
            if attempt == 0:
                for old in bpf.map_keys(verdicts, _VERDICT_KEY.size):
                    raw = bpf.map_lookup(verdicts, old, 8)
                    if raw is not None and struct.unpack("=I", raw[:4])[0] != generation:
                        bpf.map_delete(verdicts, old)
        if not self._verdicts_full:
            log.warning("remote path: the verdict map is full: connects without a verdict stay native")
        self._verdicts_full = True

    def close(self) -> None:
        """tsord exits: nothing goes to a pump that is gone (connects are native until the next tsord)."""
        self._stop.set()
        self._thread.join(5)
        try:
            bpf.map_delete(self.maps[service_lb.PUMP_MAP], struct.pack("=I", 0))
        except OSError:
            pass
        with self._lock:
            for key in list(self._remote):
                try:
                    bpf.map_delete(self.maps[service_lb.REMOTE_MAP], key)
                except OSError:
                    pass
            self._remote.clear()
        self.listener.close()

