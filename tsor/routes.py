"""The route table: which node holds a pod address, and how to reach that node's tsord.

A `RouteSource` feeds the table; `StaticFile` reads a YAML file and reloads it when it changes.
A Kubernetes source (nodes' podCIDRs from the API server) plugs in the same way:

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
from dataclasses import dataclass
from typing import Callable, Protocol

import yaml

from tsor.addr import unmapped
from tsor.config import HostPort, parse_hostport
from tsor.errors import ConfigError

log = logging.getLogger("tsor.routes")

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class Node:
    name: str
    address: HostPort | None
    pods: tuple[Network, ...]


class RouteTable:
    """Longest-prefix match of a pod address to its node. Replaced whole on reload (readers never
    see half a table)."""

    def __init__(self, nodes: list[Node] = ()) -> None:
        self._entries: list[tuple[Network, Node]] = []
        self.replace(nodes)

    def replace(self, nodes: list[Node]) -> None:
        entries = [(net, n) for n in nodes for net in n.pods]
        entries.sort(key=lambda e: e[0].prefixlen, reverse=True)
        self._entries = entries
        self.nodes = {n.name: n for n in nodes}

    def lookup(self, ip: str) -> Node | None:
        a = ipaddress.ip_address(unmapped(ip))
        for net, node in self._entries:
            if a.version == net.version and a in net:
                return node
        return None


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
