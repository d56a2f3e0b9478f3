"""The route table: which node holds a pod address, and how to reach that node's tsord.

A `RouteSource` feeds the table: `StaticFile` reads a YAML file and reloads it when it changes;
`tsor.routes_k8s.KubernetesSource` lists and watches the API server (nodes, quark pods, Services and
their EndpointSlices). The file:

    nodes:
      - name: node-a
        address: 10.99.0.1:7470     # that node's tsord (its `listen`)
        pods: [10.88.1.0/24, fd00:88:1::/64]   # pod CIDRs or single pod addresses
"""
from __future__ import annotations

import ipaddress
import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable, Protocol

import yaml

from tsor.addr import Endpoint, unmapped
from tsor.config import HostPort, parse_hostport
from tsor.errors import ConfigError

log = logging.getLogger("tsor.routes")

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class Node:
    name: str
    address: HostPort | None
    pods: tuple[Network, ...]               # routed: every address in these goes to this node
    pod_cidrs: tuple[Network, ...] = ()     # Kubernetes' podCIDRs, for information: only quark pods are routed


@dataclass(frozen=True, eq=False)
class Pod:
    """A quark pod the route source knows (Kubernetes): routed by its own addresses, not its node's
    CIDR, so that the runc pods beside it stay native. Namespace and labels are kept for policy."""
    namespace: str
    name: str
    node: str
    ips: tuple[str, ...]
    labels: Mapping[str, str] = field(default_factory=dict)
    ports: Mapping[str, int] = field(default_factory=dict)   # its containers' named TCP ports (policies name them)
    # the API object's resourceVersion it was made from (a relist reuses the entry of an object
    # listed at the same version: tsor/routes_k8s.py); None where it was not made from one
    version: object = None


@dataclass(frozen=True)
class ServicePort:
    """One TCP port of a Service's ClusterIP."""
    namespace: str
    service: str
    port_name: str              # "" for an unnamed port; matches the EndpointSlice port of that name
    client_affinity: bool = False   # sessionAffinity: ClientIP (kube-proxy remembers; tsord cannot)
    node_local: bool = False        # internalTrafficPolicy: Local (endpoints on this node only)
    # sessionAffinityConfig.clientIP.timeoutSeconds: how long a client sticks to its endpoint
    # since its last connect (the connect-time balancer remembers it: tsor/service_lb.py)
    affinity_seconds: int = 10800


@dataclass(frozen=True)
class EndpointSlice:
    namespace: str
    service: str
    family: int                                   # socket.AF_INET or AF_INET6 (addressType)
    ports: tuple[tuple[str, int, str], ...]       # (name, port, protocol)
    endpoints: tuple[tuple[str, bool, str | None], ...]   # (address, ready, nodeName)


class RouteTable:
    """Where a destination address goes: longest-prefix match of CIDRs to nodes (the static file),
    quark pods by address (Kubernetes), and Service ClusterIP:ports to their endpoints.

    Writers are route sources (one thread each); readers are tsord's connect threads, which take no
    lock: every index is a dict or list replaced or updated by single assignments, so a reader sees
    an object either before or after a change, never half of one. `replace` swaps the CIDR part
    whole; `sync` swaps every Kubernetes index whole (a relist); the `set_*` methods apply one watch
    event."""

    def __init__(self, nodes: list[Node] = ()) -> None:
        self._lock = threading.Lock()
        self._entries: list[tuple[Network, Node]] = []
        self._hosts: dict[str, Node] = {}    # single-address entries of the static file
        self.nodes: dict[str, Node] = {}
        self.pods: dict[str, Pod] = {}                       # quark pods by address
        self._pod_keys: dict[tuple[str, str], Pod] = {}      # ... by (namespace, name)
        self.services: dict[tuple[str, int], ServicePort] = {}         # (clusterIP, port)
        self._service_keys: dict[tuple[str, str], tuple[tuple[str, int], ...]] = {}
        self._slices: dict[tuple[str, str], dict[str, EndpointSlice]] = {}   # (ns, service) -> by slice name
        self._slice_owner: dict[tuple[str, str], tuple[str, str]] = {}     # (ns, slice) -> (ns, service)
        # NetworkPolicies (tsor/netpol.py), kept by the Kubernetes source: None where routes come from a
        # file, whose nodes are no Kubernetes cluster
        self._policy = None
        # called after every change (tsord bumps its route generation: tsor/peers.py)
        self.changed: Callable[[], None] = _nothing
        self.replace(nodes)

    @property
    def policy(self):
        return self._policy

    @policy.setter
    def policy(self, policy) -> None:
        self._policy = policy
        if policy is not None:
            policy.changed = lambda: self.changed()
        self.changed()

    # ---- the static file: CIDRs of nodes ---------------------------------------------------------
    def replace(self, nodes: list[Node]) -> None:
        entries, hosts = [], {}
        for n in nodes:
            for net in n.pods:
                if net.prefixlen == net.max_prefixlen:
                    hosts[str(net.network_address)] = n
                else:
                    entries.append((net, n))
        entries.sort(key=lambda e: e[0].prefixlen, reverse=True)
        with self._lock:
            self._entries, self._hosts = entries, hosts
            self.nodes = {n.name: n for n in nodes}
        self.changed()

    def lookup(self, ip: str) -> Node | None:
        """The node holding pod address `ip`, None when no route source knows it."""
        ip = unmapped(ip)
        pod = self.pods.get(ip)
        if pod is not None:
            return self.nodes.get(pod.node)
        node = self._hosts.get(ip)
        if node is not None:
            return node
        a = ipaddress.ip_address(ip)
        for net, node in self._entries:
            if a.version == net.version and a in net:
                return node
        return None

    # ---- Kubernetes: nodes, quark pods, Services and their EndpointSlices -------------------------
    def sync(self, nodes: list[Node] | None = None, pods: list[Pod] | None = None,
             services: dict[tuple[str, str], dict[tuple[str, int], ServicePort]] | None = None,
             slices: dict[tuple[str, str], EndpointSlice] | None = None) -> None:
        """Replace whole the kinds given (a relist), leaving the others as they are."""
        with self._lock:
            if nodes is not None:
                self.nodes = {n.name: n for n in nodes}
            if pods is not None:
                self._pod_keys = {(p.namespace, p.name): p for p in pods}
                self.pods = {ip: p for p in pods for ip in p.ips}
            if services is not None:
                self._service_keys = {key: tuple(ports) for key, ports in services.items()}
                self.services = {ep: sp for ports in services.values() for ep, sp in ports.items()}
            if slices is not None:
                by_service: dict[tuple[str, str], dict[str, EndpointSlice]] = {}
                for (ns, name), sl in slices.items():
                    by_service.setdefault((ns, sl.service), {})[name] = sl
                self._slices = by_service
                self._slice_owner = {(ns, name): (ns, sl.service) for (ns, name), sl in slices.items()}
        self.changed()

    def set_node(self, name: str, node: Node | None) -> None:
        with self._lock:
            nodes = dict(self.nodes)
            if node is None:
                nodes.pop(name, None)
            else:
                nodes[name] = node
            self.nodes = nodes
        self.changed()

    def set_pod(self, key: tuple[str, str], pod: Pod | None) -> None:
        """Add, change or (None) remove one quark pod."""
        with self._lock:
            old = self._pod_keys.pop(key, None)
            if old is not None:
                for ip in old.ips:
                    if self.pods.get(ip) is old:   # the address may belong to a newer pod already
                        del self.pods[ip]
            if pod is not None:
                self._pod_keys[key] = pod
                for ip in pod.ips:
                    self.pods[ip] = pod
        self.changed()

    def set_service(self, key: tuple[str, str], ports: dict[tuple[str, int], ServicePort] | None) -> None:
        """Add, change or (None) remove the ClusterIP ports of one Service."""
        with self._lock:
            for ep in self._service_keys.pop(key, ()):
                self.services.pop(ep, None)
            if ports:
                self._service_keys[key] = tuple(ports)
                self.services.update(ports)
        self.changed()

    def set_slice(self, namespace: str, name: str, sl: EndpointSlice | None) -> None:
        """Add, change or (None) remove one EndpointSlice."""
        with self._lock:
            owner = self._slice_owner.pop((namespace, name), None)
            if owner is not None:   # copy, not edit: a reader may be iterating the old one
                rest = {k: v for k, v in self._slices.get(owner, {}).items() if k != name}
                if rest:
                    self._slices[owner] = rest
                else:
                    self._slices.pop(owner, None)
            if sl is not None:
                key = (namespace, sl.service)
                self._slices[key] = {**self._slices.get(key, {}), name: sl}
                self._slice_owner[(namespace, name)] = key
        self.changed()

    def pod(self, key: tuple[str, str]) -> Pod | None:
        """The quark pod (namespace, name), None if the table has none of that name."""
        return self._pod_keys.get(key)

    def verdict(self, src_ip: str, dst: Endpoint) -> tuple[str, str]:
        """NetworkPolicy's verdict (tsor/netpol.py: ALLOW, DENY, UNKNOWN) on a connection from the
        quark pod at src_ip to dst, and why. Routes from a file: allowed (no Kubernetes, no policy).
        Both ends must be quark pods the route source lists, else UNKNOWN."""
        from tsor.netpol import ALLOW, UNKNOWN, PodRef
        policy = self.policy
        if policy is None:
            return ALLOW, "no NetworkPolicy: routes from a file"
        src_pod, dst_pod = self.pods.get(unmapped(src_ip)), self.pods.get(unmapped(dst[0]))
        if src_pod is None or dst_pod is None:
            return UNKNOWN, f"{src_ip if src_pod is None else dst[0]} is no quark pod the API server lists"
        return policy.decide(PodRef(src_pod.namespace, src_pod.name, src_pod.labels, src_ip),
                             PodRef(dst_pod.namespace, dst_pod.name, dst_pod.labels, dst[0], dict(dst_pod.ports)),
                             dst[1])

    def service(self, ip: str, port: int) -> ServicePort | None:
        """The Service port at ClusterIP `ip`:`port`, None if that is not one."""
        return self.services.get((unmapped(ip), port))

    def endpoints(self, sp: ServicePort, family: int, node: str) -> list[Endpoint]:
        """The ready endpoints (address, targetPort) of a Service port, as kube-proxy would choose
        among them: EndpointSlices of the ClusterIP's family, the port of the same name, endpoints
        ready (or of unknown readiness, which the API says to take as ready), on `node` only when
        the Service's internalTrafficPolicy is Local."""
        out = []
        for sl in self._slices.get((sp.namespace, sp.service), {}).values():
            if sl.family != family:
                continue
            port = next((p for name, p, proto in sl.ports if name == sp.port_name and proto == "TCP"), None)
            if port is None:
                continue
            for ip, ready, where in sl.endpoints:
                if ready and (not sp.node_local or where == node):
                    out.append((ip, port))
        return out


class RouteSource(Protocol):
    """Something that keeps a RouteTable current (a file, the Kubernetes API)."""

    def start(self, table: RouteTable) -> None: ...
    def stop(self) -> None: ...


def parse(raw: object, path: str) -> list[Node]:
    if not isinstance(raw, dict) or not isinstance(raw.get("nodes"), list):
        raise ConfigError(path, "nodes", "expected a list of nodes")
    nodes = []
    for i, n in enumerate(raw["nodes"]):
        where = f"nodes[{i}]"
        if not isinstance(n, dict) or not isinstance(n.get("name"), str):
            raise ConfigError(path, f"{where}.name", "expected a node name")
        address = parse_hostport(n["address"], path, f"{where}.address") if n.get("address") else None
        pods = n.get("pods", [])
        if not isinstance(pods, list):
            raise ConfigError(path, f"{where}.pods", "expected a list of CIDRs or addresses")
        nets = []
        for j, p in enumerate(pods):
            try:
                nets.append(ipaddress.ip_network(str(p), strict=False))
            except ValueError:
                raise ConfigError(path, f"{where}.pods[{j}]", f"not a CIDR or address: {p!r}") from None
        nodes.append(Node(n["name"], address, tuple(nets)))
    return nodes


def load(path: str) -> list[Node]:
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(path, "", "no such file") from None
    except yaml.YAMLError as e:
        raise ConfigError(path, "", f"not valid YAML: {e}") from None
    return parse(raw, path)


class StaticFile:
    """Routes from a YAML file, re-read when its mtime or size changes. A bad edit is logged and the
    previous table kept, so a typo never takes routes away from running pods."""

    def __init__(self, path: str, interval: float = 1.0,
                 on_reload: Callable[[list[Node]], None] | None = None) -> None:
        self.path, self.interval, self.on_reload = path, interval, on_reload
        self._stamp: tuple[float, int] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, table: RouteTable) -> None:
        self.table = table
        table.replace(load(self.path))   # a bad file at start-up is the operator's error: fail
        self._stamp = self._stat()
        self._thread = threading.Thread(target=self._watch, name="routes", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _stat(self) -> tuple[float, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (st.st_mtime, st.st_size)

    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            self.check()

    def check(self) -> None:
        stamp = self._stat()
        if stamp == self._stamp or stamp is None:
            return
        self._stamp = stamp
        try:
            nodes = load(self.path)
        except ConfigError as e:
            log.error("route file not reloaded, keeping the previous routes: %s", e)
            return
        self.table.replace(nodes)
        log.info("routes reloaded from %s: %d nodes", self.path, len(nodes))
        if self.on_reload:
            self.on_reload(nodes)


def _nothing() -> None:
    pass
