"""tsord's configuration file (default /etc/quark/tsor.yaml):

    node: node-a                    # this node's name in the route table (default: the hostname)
    socket: /run/quark/tsord.sock   # where sandboxes reach tsord
    listen: 10.99.0.1:7470          # node-to-node tcp transport (omit: this node takes no tcp peers)
    metrics: 127.0.0.1:9470         # Prometheus text; host:port or unix:/path (omit: none)
    routes: /etc/quark/tsor-routes.yaml   # static route file (routes.py), reloaded when it changes
"""
from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass

import yaml

from tsor import DEFAULT_SOCKET
from tsor.errors import ConfigError

_KEYS = {"node", "socket", "listen", "metrics", "routes"}


@dataclass(frozen=True)
class HostPort:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class Config:
    node: str
    socket: str = DEFAULT_SOCKET
    listen: HostPort | None = None
    metrics: HostPort | str | None = None   # str: a unix socket path
    routes: str | None = None


def parse_hostport(value: object, path: str, field: str) -> HostPort:
    if not isinstance(value, str) or ":" not in value:
        raise ConfigError(path, field, f"expected HOST:PORT, got {value!r}")
    host, _, port = value.rpartition(":")
    host = host.strip("[]")
    try:
        ipaddress.ip_address(host)
        p = int(port)
    except ValueError:
        raise ConfigError(path, field, f"expected IP:PORT, got {value!r}") from None
    if not 0 < p < 65536:
        raise ConfigError(path, field, f"port out of range in {value!r}")
    return HostPort(host, p)


def load(path: str) -> Config:
    try:
        with open(path) as f:
            raw = yaml.safe_load(f) or {}
    except FileNotFoundError:
        raise ConfigError(path, "", "no such file") from None
    except yaml.YAMLError as e:
        raise ConfigError(path, "", f"not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(path, "", "expected a mapping at the top level")
    unknown = set(raw) - _KEYS
    if unknown:
        raise ConfigError(path, sorted(unknown)[0], f"unknown key (expected one of {sorted(_KEYS)})")
    node = raw.get("node", socket.gethostname())
    if not isinstance(node, str) or not node:
        raise ConfigError(path, "node", f"expected a node name, got {node!r}")
    sock = raw.get("socket", DEFAULT_SOCKET)
    if not isinstance(sock, str) or not os.path.isabs(sock):
        raise ConfigError(path, "socket", f"expected an absolute path, got {sock!r}")
    listen = parse_hostport(raw["listen"], path, "listen") if raw.get("listen") is not None else None
    metrics = raw.get("metrics")
    if isinstance(metrics, str) and metrics.startswith("unix:"):
        metrics = metrics[5:]
        if not os.path.isabs(metrics):
            raise ConfigError(path, "metrics", "expected unix:/absolute/path")
    elif metrics is not None:
        metrics = parse_hostport(metrics, path, "metrics")
    routes = raw.get("routes")
    if routes is not None:
        if not isinstance(routes, str):
            raise ConfigError(path, "routes", f"expected a file path, got {routes!r}")
        routes = os.path.join(os.path.dirname(os.path.abspath(path)), routes)
    return Config(node=node, socket=sock, listen=listen, metrics=metrics, routes=routes)
