"""Services chosen at connect(): socket-level load balancing for the sockmap local path.

A connection to a Service ClusterIP is otherwise rewritten by the node's NAT (kube-proxy) packet by
packet, so its two ends' addresses do not pair up and the sockmap path (tsor/sockmap.py) cannot
splice it. Here the kernel rewrites the socket instead, once, at connect(), as Cilium's
socket-level load balancing does: a cgroup connect4 program (tsor/bpf/service_lb.bpf.c) on the
unified hierarchy's root turns a quark pod's connect() to ClusterIP:port into a connect() to one
ready endpoint of that Service port, chosen at random; a getpeername4 program makes the socket's
getpeername() answer the ClusterIP:port it dialled, as it would through NAT. A Service port with
no ready endpoint refuses the connect with ECONNREFUSED, as kube-proxy's REJECT rule answers.

What the connection is then: the kernel's own TCP between the two pods' own addresses, set up with
no trapped call and nothing in user space on its path. Between two quark pods of this node the
sockmap path carries it (its ends pair up now); to a pod elsewhere it is routed as any pod-to-pod
connection; either way the node's packet filters, and with them NetworkPolicy, see the pod-to-pod
connection it is (as with kube-proxy, which DNATs before the filters' FORWARD rules).

Whose: only sockets of the network namespaces of quark pods registered with tsord (their cookies,
kept by tsor/sockmap.py's Registrar); every other socket of the node, runc pods' and the host's,
passes the programs untouched and meets kube-proxy as before.

Which: IPv4 TCP Service ports (tsord's route table has them from the API server: tsor/routes.py),
their ready endpoints of the IPv4 family (internalTrafficPolicy: Local: this node's only). With
sessionAffinity: ClientIP a pod gets the endpoint it had while it connects again within the
Service's timeoutSeconds (and that endpoint is still there), as kube-proxy keeps a client address
on one; the client here is the pod by its network namespace, which holds its address (an LRU map:
past 65,536 pod-and-Service pairs the oldest forget). Left to the node's NAT: IPv6 ClusterIPs, UDP,
and an AF_INET6 socket dialling an IPv4-mapped ClusterIP (the connect6 hook; not attached).

tsord is the control plane: it fills the maps from its route table (a change is in the maps within
`SETTLE` seconds) and is on no connection's path. The programs and maps stay attached when tsord
exits (connects go on being balanced by the last state); the next tsord takes them over by name and
brings the maps up to date.
"""
from __future__ import annotations

import logging
import os
import socket
import struct
import threading
from collections.abc import Callable
from typing import NamedTuple

from qlib import bpf, libbpf

log = logging.getLogger("tsor.service_lb")

# The programs are tsor/bpf/service_lb.bpf.c, compiled by `make install`; their names there carry
# the version (bump both when a program or a map's layout changes).
VERSION = 3          # 2: sessionAffinity: ClientIP; 3: another node's pods into the pump (remote_path.py)
PREFIX = "quark_lb"
CONNECT_NAME, PEER_NAME, OPS_NAME = f"{PREFIX}{VERSION}_conn", f"{PREFIX}{VERSION}_peer", f"{PREFIX}{VERSION}_ops"
NETNS_MAP, SERVICES_MAP, BACKENDS_MAP, ORIGS_MAP = "quark_lb_netns", "quark_lb_svcs", "quark_lb_backs", "quark_lb_origs"
STICKY_MAP = "quark_lb_sticky"
# the remote leg's maps (tsor/remote_path.py writes and reads them; the pump reads conns, writes peers)
REMOTE_MAP, VERDICTS_MAP, MISSES_MAP, CONFIG_MAP = "quark_lb_remote", "quark_lb_policy", "quark_lb_misses", "quark_lb_config"
CONNS_MAP, PEERS_MAP, ROOM_MAP, PUMP_MAP = "quark_lb_conns", "quark_lb_peers", "quark_lb_room", "quark_lb_pump"
MAPS = (NETNS_MAP, SERVICES_MAP, BACKENDS_MAP, ORIGS_MAP, STICKY_MAP, REMOTE_MAP, VERDICTS_MAP, MISSES_MAP,
        CONFIG_MAP, CONNS_MAP, PEERS_MAP, ROOM_MAP, PUMP_MAP)
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bpf", "service_lb.bpf.c")
OBJECT = SOURCE[:-1] + "o"
INET4_CONNECT, INET4_GETPEERNAME, CGROUP_SOCK_OPS = 10, 29, 3       # enum bpf_attach_type
ATTACH = {CONNECT_NAME: INET4_CONNECT, PEER_NAME: INET4_GETPEERNAME, OPS_NAME: CGROUP_SOCK_OPS}
MAX_ENDPOINTS = 65535                            # an index is 16 bits
SETTLE = 0.05                                    # route changes gathered before the maps are written

Endpoint = tuple[str, int]


class Target(NamedTuple):
    """What the programs hold of one Service port."""
    endpoints: tuple[Endpoint, ...]
    affinity_s: int = 0      # sessionAffinity: ClientIP's timeout (seconds); 0: none


def _target(value: Target | list[Endpoint] | tuple[Endpoint, ...]) -> Target:
    return value if isinstance(value, Target) else Target(tuple(value))


def _service_key(ip: str, port: int) -> bytes:
    return socket.inet_aton(ip) + struct.pack("!H", port) + b"\0\0"


def _backend_key(ip: str, port: int, index: int) -> bytes:
    return socket.inet_aton(ip) + struct.pack("!H", port) + struct.pack("=H", index)


def endpoint_value(ep: Endpoint) -> bytes:
    """struct endpoint {u32 ip4; u16 port (network order); u16 pad}: a backend, and the remote path's
    peers map value"""
    return socket.inet_aton(ep[0]) + struct.pack("!H", ep[1]) + b"\0\0"


def _parse_endpoint(raw: bytes) -> Endpoint:
    return socket.inet_ntoa(raw[:4]), struct.unpack("!H", raw[4:6])[0]


def wanted(table, node: str) -> dict[Endpoint, Target]:
    """ClusterIP:port -> its ready endpoints (and ClientIP affinity's timeout), for every Service
    port the programs balance (the module's docstring says which), from tsord's route table
    (tsor/routes.py)."""
    out = {}
    for (ip, port), sp in list(table.services.items()):
        if ":" in ip:
            continue
        eps = sorted({ep for ep in table.endpoints(sp, socket.AF_INET, node) if ":" not in ep[0]})
        out[(ip, port)] = Target(tuple(eps[:MAX_ENDPOINTS]), sp.affinity_seconds if sp.client_affinity else 0)
    return out


class ServiceLB:
    """The programs on the unified hierarchy's root, their maps, and tsord's mirror of what the
    maps hold."""

    def __init__(self, root_fd: int, programs: dict[str, int], maps: dict[str, int]) -> None:
        self.root_fd, self.programs, self.maps = root_fd, programs, maps
        self._lock = threading.Lock()
        self._services: dict[Endpoint, Target] = {}
        self._namespaces: set[int] = set()
        self._overflow: set[Endpoint] = set()   # Service ports with no room in the maps
        self._read_back()

    @classmethod
    def open(cls, cgroup_root: str) -> ServiceLB:
        """Take over the programs a tsord before us left attached (this version's: with their maps
        and what they hold), or attach new ones in place of an older version's. OSError (its
        message names the step) when the kernel cannot."""
        root_fd = os.open(cgroup_root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        fds: list[int] = []
        found: dict[str, tuple[int, int, list[int]]] = {}
        try:
            found = _attached(root_fd)
            if all(name in found for name in ATTACH):
                programs = {name: found.pop(name)[0] for name in ATTACH}
                fds += programs.values()
                maps = _maps_by_name(sorted({m for fd in programs.values() for m in _map_ids(fd)}))
                fds += maps.values()
                if set(maps) != set(MAPS):
                    raise OSError(f"{CONNECT_NAME} is attached with the maps {sorted(maps)}, not {sorted(MAPS)}")
                log.info("service_lb: took over the programs already attached")
            else:
                loaded = libbpf.load(OBJECT, SOURCE, list(ATTACH))
                programs, maps = dict(loaded.programs), dict(loaded.maps)
                fds += [*programs.values(), *maps.values()]
                for name, fd in programs.items():
                    bpf.attach(root_fd, fd, ATTACH[name], bpf.F_ALLOW_MULTI, what=f"attaching {name} to {cgroup_root}")
            for name, (fd, attach_type, _) in found.items():   # an older version's, or half of ours
                bpf.detach(root_fd, fd, attach_type)
                log.info("service_lb: replaced %s", name)
        except BaseException:
            for fd in fds + [root_fd]:
                os.close(fd)
            raise
        finally:
            for fd, _, _ in found.values():
                os.close(fd)
        return cls(root_fd, programs, maps)

    # ---- what tsord writes -----------------------------------------------------------------------
    def set_namespaces(self, cookies: set[int]) -> None:
        """The network namespaces (cookies) of the quark pods registered with tsord: their connects,
        and only theirs, are balanced."""
        with self._lock:
            for cookie in self._namespaces - cookies:
                bpf.map_delete(self.maps[NETNS_MAP], struct.pack("Q", cookie))
            for cookie in cookies - self._namespaces:
                bpf.map_update(self.maps[NETNS_MAP], struct.pack("Q", cookie), b"\1")
            self._namespaces = set(cookies)

    def sync(self, services: dict[Endpoint, Target | list[Endpoint]]) -> int:
        """The maps made to hold `services` (ClusterIP:port -> its Target, or its endpoints alone),
        changing only what differs; how many Service ports changed. The order of the writes keeps
        every count a program reads covered by endpoints (the C file's comment on its backends map).
        A Service port the maps have no room for is left out of them whole, so its connects go to
        the node's NAT (kube-proxy) as a runc pod's do: counted (left_to_node), logged once, and
        written at a later sync that finds room."""
        changed = 0
        with self._lock:
            for (ip, port) in set(self._services) - set(services):
                changed += 1
                self._remove(ip, port)
            overflow = set()
            for (ip, port), value in services.items():
                want = _target(value)
                old = self._services.get((ip, port))
                if old == want:
                    continue
                changed += 1
                try:
                    self._write(ip, port, want, old)
                except OSError as e:
                    if not bpf.full(e):
                        raise
                    self._remove(ip, port, written=max(len(want.endpoints), len(old.endpoints) if old else 0))
                    overflow.add((ip, port))
            if overflow and not self._overflow:
                log.warning("service_lb: the maps are full: %d Service ports (e.g. %s:%d) are left to the node's NAT "
                            "(kube-proxy) until there is room", len(overflow), *sorted(overflow)[0])
            elif self._overflow and not overflow:
                log.info("service_lb: every Service port is in the maps again")
            self._overflow = overflow
        return changed

    def _write(self, ip: str, port: int, want: Target, old: Target | None) -> None:
        svcs, backs = self.maps[SERVICES_MAP], self.maps[BACKENDS_MAP]
        eps, before = want.endpoints, old.endpoints if old else ()
        for i, ep in enumerate(eps):           # endpoints first ...
            if i >= len(before) or before[i] != ep:
                bpf.map_update(backs, _backend_key(ip, port, i), endpoint_value(ep))
        bpf.map_update(svcs, _service_key(ip, port), struct.pack("=II", len(eps), want.affinity_s))   # ... then the count
        for i in range(len(eps), len(before)):    # and what is past it now
            bpf.map_delete(backs, _backend_key(ip, port, i))
        self._services[(ip, port)] = want

    def _remove(self, ip: str, port: int, written: int = 0) -> None:
        """A Service port out of the maps: its count first (its connects go to the node from then
        on), then its endpoints (those of the mirror, or the first `written` of a failed write)."""
        bpf.map_delete(self.maps[SERVICES_MAP], _service_key(ip, port))
        old = self._services.pop((ip, port), None)
        for i in range(max(written, len(old.endpoints) if old else 0)):
            bpf.map_delete(self.maps[BACKENDS_MAP], _backend_key(ip, port, i))

    def left_to_node(self) -> int:
        """Service ports the last sync found no room for in the maps (tsord's metrics)."""
        return len(self._overflow)

    def service_ports(self) -> int:
        """How many Service ports the maps hold (tsord's metrics)."""
        return len(self._services)

    def service_endpoints(self) -> int:
        """How many endpoints the maps hold, over every Service port (tsord's metrics)."""
        return sum(len(t.endpoints) for t in list(self._services.values()))

    def services(self) -> dict[Endpoint, Target]:
        """What the maps hold, read from the kernel."""
        out = {}
        for key in bpf.map_keys(self.maps[SERVICES_MAP], 8):
            raw = bpf.map_lookup(self.maps[SERVICES_MAP], key, 8)
            if raw is None:
                continue
            ip, port = socket.inet_ntoa(key[:4]), struct.unpack("!H", key[4:6])[0]
            count, affinity_s = struct.unpack("=II", raw)
            eps = []
            for i in range(count):
                ep = bpf.map_lookup(self.maps[BACKENDS_MAP], _backend_key(ip, port, i), 8)
                if ep is not None:
                    eps.append(_parse_endpoint(ep))
            out[(ip, port)] = Target(tuple(eps), affinity_s)
        return out

    def _read_back(self) -> None:
        """The mirror from the maps (a tsord taking over: what its predecessor wrote)."""
        self._services = self.services()
        self._namespaces = {struct.unpack("Q", k)[0] for k in bpf.map_keys(self.maps[NETNS_MAP], 8)}
        stale = {key[:6] for key in bpf.map_keys(self.maps[BACKENDS_MAP], 8)} - {
            _service_key(*ep)[:6] for ep in self._services}
        for key in bpf.map_keys(self.maps[BACKENDS_MAP], 8):   # endpoints past a count, or of no Service
            ip, port = socket.inet_ntoa(key[:4]), struct.unpack("!H", key[4:6])[0]
            have = self._services.get((ip, port))
            if key[:6] in stale or struct.unpack("=H", key[6:8])[0] >= (len(have.endpoints) if have else 0):
                bpf.map_delete(self.maps[BACKENDS_MAP], key)

    def close(self) -> None:
        """tsord exits: the programs stay attached with what the maps hold, the fds go."""
        for fd in (*self.programs.values(), *self.maps.values(), self.root_fd):
            os.close(fd)

    def remove(self) -> None:
        """Detach and close: connects go to the node's NAT again."""
        for name, fd in self.programs.items():
            try:
                bpf.detach(self.root_fd, fd, ATTACH[name])
            except OSError as e:
                log.warning("service_lb: %s", e)
        self.close()


class Syncer:
    """Keeps the maps equal to tsord's route table: woken by every route change, it gathers the
    changes of `SETTLE` seconds and writes what differs (a thread of its own, off the route
    sources' threads)."""

    def __init__(self, lb: ServiceLB, services: Callable[[], dict[Endpoint, Target]]) -> None:
        self.lb, self.services = lb, services
        self._dirty, self._stop = threading.Event(), threading.Event()
        self.syncs = 0
        self._thread = threading.Thread(target=self._run, name="service-lb", daemon=True)
        self._dirty.set()
        self._thread.start()

    def changed(self) -> None:
        self._dirty.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._dirty.wait()
            if self._stop.wait(SETTLE):
                return
            self._dirty.clear()
            try:
                n = self.lb.sync(self.services())
                if n:
                    log.debug("service_lb: %d Service ports updated", n)
            except (OSError, RuntimeError) as e:   # (RuntimeError: a table changed while read)
                log.warning("service_lb: Services not updated: %s", e)
                self._dirty.set()
            self.syncs += 1

    def close(self) -> None:
        self._stop.set()
        self._dirty.set()
        self._thread.join(5)


def _attached(root_fd: int) -> dict[str, tuple[int, int, list[int]]]:
    """quark's connect4, getpeername4 and sock_ops programs of this module on the root: name -> (an
    fd, its attach type, its maps' ids)."""
    out = {}
    for attach_type in (INET4_CONNECT, INET4_GETPEERNAME, CGROUP_SOCK_OPS):
        for pid in bpf.query(root_fd, attach_type)[1]:
            try:
                fd = bpf.prog_by_id(pid)
            except OSError:
                continue
            name, maps = bpf.prog_info(fd)
            if name.startswith(PREFIX) and name not in out:
                out[name] = (fd, attach_type, maps)
            else:
                os.close(fd)
    return out


def _map_ids(prog_fd: int) -> list[int]:
    return bpf.prog_info(prog_fd)[1]


def _maps_by_name(map_ids: list[int]) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        for map_id in map_ids:
            fd = bpf.map_by_id(map_id)
            name = bpf.map_info(fd)[2]
            if name in MAPS:
                out[name] = fd
            else:
                os.close(fd)
    except BaseException:
        for fd in out.values():
            os.close(fd)
        raise
    return out


def attached_names(cgroup_root: str) -> set[str]:
    """The names of this module's programs attached to the root (a tsord's, running or gone)."""
    root_fd = os.open(cgroup_root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        found = _attached(root_fd)
        for fd, _, _ in found.values():
            os.close(fd)
        return set(found)
    finally:
        os.close(root_fd)


def remove_attached(cgroup_root: str) -> int:
    """Detach every program of this module's from the root (a tsord whose local path is not
    sockmap; tests' clean-up): how many."""
    root_fd = os.open(cgroup_root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        found = _attached(root_fd)
        for fd, attach_type, _ in found.values():
            try:
                bpf.detach(root_fd, fd, attach_type)
            finally:
                os.close(fd)
        return len(found)
    finally:
        os.close(root_fd)
