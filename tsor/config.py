"""tsord's configuration file (default /etc/quark/tsor.yaml):

    node: node-a                    # this node's name in the route table (default: the hostname)
    socket: /run/quark/tsord.sock   # where sandboxes reach tsord
    listen: 10.99.0.1:7470          # node-to-node tcp transport (omit: this node takes no tcp peers)
    metrics: 127.0.0.1:9470         # Prometheus text; host:port or unix:/path (omit: none)
    routes: /etc/quark/tsor-routes.yaml   # static route file (routes.py), reloaded when it changes
    kubernetes:                     # or routes from the API server instead (routes_k8s.py)
      kubeconfig: /etc/quark/kubeconfig   # omit: in-cluster (the pod's service account)
      context: null                 # a context of that kubeconfig (default: its current one)
      runtime_class: quark          # pods of this runtimeClassName are quark pods
      tsord_port: 7470              # the port of every node's tsord (default: this node's `listen` port)
      discovery_seconds: 60         # how often the policy kinds the cluster serves are looked up
                                    #   (kinds tsord does not evaluate send connections native)
    cluster_secret_file: /etc/quark/tsor-secret   # shared by every node's tsord (mode 0600)
    insecure_no_auth: false         # true: node-to-node without the secret (a trusted lab network)
    transport: auto                 # node to node: auto|rdma|tcp, or per peer node:
                                    #   {node-b: tcp, "*": auto}   ("*": every other node)
    state_dir: /run/quark/tsord     # what survives a restart of tsord: the pods quark-cni registered
    local_path: socketpair          # between pods of this node: socketpair (connect trapped, one
                                    #   AF_UNIX socketpair) or sockmap (nothing trapped, tsor/sockmap.py)
    rdma:                           # the RDMA port the rdma transport uses (each key optional)
      device: mlx5_0                # default: the first device
      port: 1                       # default: its first ACTIVE port
      gid_index: 3                  # default: the port's first RoCE v2 IPv4 GID (tsor/verbs/pyverbs_provider.py)
      pump: compiled                # what moves the bytes: compiled (transport/rdma_pump.c) or python
      pump_port: 7471               # local_path: sockmap: where the pump takes pods' connections to
                                    #   other nodes (on `listen`'s address; tsor/remote_path.py)

`transport`: `rdma` carries connections over an RC queue pair on this host's RDMA device (pyverbs),
`tcp` over one TCP connection each, and `auto` takes rdma where both nodes have an active RDMA port,
else tcp (transport/rdma_link.py). (The host tests' software provider adds its own name,
`softverbs`, through `load`'s `transports`: tests/support/softverbs_tsord.py.)

Node to node, each tsord proves to the other that it knows the cluster secret (transport/tcp.py).
Without a secret there is no node-to-node TSoR (connections to other nodes' pods run natively, and
`listen` is refused), unless `insecure_no_auth: true` says the network itself is trusted.
"""
from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass

import yaml

from tsor import DEFAULT_SOCKET
from tsor.errors import ConfigError

_KEYS = {"node", "socket", "listen", "metrics", "routes", "kubernetes", "cluster_secret_file", "insecure_no_auth",
         "transport", "state_dir", "sockopt_offload", "local_path", "rdma"}
_RDMA_KEYS = {"device", "port", "gid_index", "pump", "pump_port"}
DEFAULT_PUMP_PORT = 7471
PUMPS = ("compiled", "python")
_KUBE_KEYS = {"kubeconfig", "context", "runtime_class", "tsord_port", "discovery_seconds"}
DEFAULT_TSORD_PORT = 7470
DEFAULT_STATE_DIR = "/run/quark/tsord"
TRANSPORTS = ("auto", "rdma", "tcp")
LOCAL_PATHS = ("socketpair", "sockmap")
MIN_SECRET = 16   # bytes: a guessable secret would be no authentication


@dataclass(frozen=True)
class HostPort:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class Kubernetes:
    """Routes from the Kubernetes API server (tsor/routes_k8s.py)."""
    kubeconfig: str | None = None    # None: in-cluster configuration
    context: str | None = None
    runtime_class: str = "quark"
    tsord_port: int | None = None    # None: this node's listen port, else DEFAULT_TSORD_PORT
    discovery_seconds: float = 60.0  # policy kinds served (tsor/policy_kinds.py), looked up this often


@dataclass(frozen=True)
class RdmaPort:
    """Which RDMA port the rdma transport opens; None: the provider's default (its first device, that
    device's first ACTIVE port, the port's RoCE v2 IPv4 GID)."""
    device: str | None = None
    port: int | None = None
    gid_index: int | None = None
    pump: str = "compiled"   # rdma links' data plane: transport/rdma_pump.c, or transport/rdma.py's engine
    pump_port: int = DEFAULT_PUMP_PORT   # local_path: sockmap: the pump's listener (tsor/remote_path.py), on `listen`'s host


@dataclass(frozen=True)
class Config:
    node: str
    socket: str = DEFAULT_SOCKET
    listen: HostPort | None = None
    metrics: HostPort | str | None = None   # str: a unix socket path
    routes: str | None = None
    kubernetes: Kubernetes | None = None
    cluster_secret: bytes | None = None
    insecure_no_auth: bool = False
    transport: tuple[tuple[str, str], ...] = (("*", "auto"),)   # (node name or "*", transport)
    state_dir: str = DEFAULT_STATE_DIR
    # join quark's cgroup, whose BPF programs answer local-path ends' options (tsor/sockopt_offload.py);
    # tsor.yaml's default is true, a Daemon built in-process (tests) stays where it is unless asked
    sockopt_offload: bool = False
    local_path: str = "socketpair"
    rdma: RdmaPort = RdmaPort()
    path: str = ""   # the file it was read from (errors found later name it)

    def transport_for(self, node: str) -> str:
        """The node-to-node transport configured for peer `node`."""
        chosen = dict(self.transport)
        return chosen.get(node, chosen.get("*", "auto"))

    @property
    def tsord_port(self) -> int:
        """The port peer nodes' tsords listen on, as the Kubernetes route source addresses them."""
        if self.kubernetes is not None and self.kubernetes.tsord_port is not None:
            return self.kubernetes.tsord_port
        return self.listen.port if self.listen is not None else DEFAULT_TSORD_PORT

    @property
    def node_key(self) -> bytes | None:
        """The key of node-to-node authentication; None: no node-to-node TSoR."""
        if self.cluster_secret is not None:
            return self.cluster_secret
        return b"" if self.insecure_no_auth else None


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


def load(path: str, transports: tuple[str, ...] = TRANSPORTS) -> Config:
    """tsor.yaml at `path`; ConfigError naming the file and the field. transports: what `transport`
    may say (a tsord given a cabled provider takes its name too)."""
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
    kube = _kubernetes(raw.get("kubernetes"), path)
    if kube is not None and routes is not None:
        raise ConfigError(path, "kubernetes", "choose one route source: `routes` (a file) or `kubernetes`")
    secret = _secret(raw.get("cluster_secret_file"), path)
    insecure = raw.get("insecure_no_auth", False)
    if not isinstance(insecure, bool):
        raise ConfigError(path, "insecure_no_auth", f"expected true or false, got {insecure!r}")
    if listen is not None and secret is None and not insecure:
        raise ConfigError(path, "listen", "node-to-node set-up needs the cluster's shared secret: set "
                                          "cluster_secret_file (or insecure_no_auth: true on a trusted network)")
    state_dir = raw.get("state_dir", DEFAULT_STATE_DIR)
    if not isinstance(state_dir, str) or not os.path.isabs(state_dir):
        raise ConfigError(path, "state_dir", f"expected an absolute path, got {state_dir!r}")
    offload = raw.get("sockopt_offload", True)
    if not isinstance(offload, bool):
        raise ConfigError(path, "sockopt_offload", f"expected true or false, got {offload!r}")
    local_path = raw.get("local_path", "socketpair")
    if local_path not in LOCAL_PATHS:
        raise ConfigError(path, "local_path", f"expected one of {list(LOCAL_PATHS)}, got {local_path!r}")
    return Config(node=node, socket=sock, listen=listen, metrics=metrics, routes=routes, kubernetes=kube,
                  cluster_secret=secret, insecure_no_auth=insecure,
                  transport=_transport(raw.get("transport", "auto"), path, transports), state_dir=state_dir,
                  sockopt_offload=offload, local_path=local_path, rdma=_rdma(raw.get("rdma"), path), path=path)


def _mapping(value: object, keys: set[str], path: str, field: str, or_: str = "") -> None:
    """ConfigError unless `value` is a mapping whose keys are among `keys` (naming the first other one)."""
    if not isinstance(value, dict):
        raise ConfigError(path, field, f"expected {or_}a mapping of {sorted(keys)}, got {value!r}")
    unknown = set(value) - keys
    if unknown:
        raise ConfigError(path, f"{field}.{sorted(map(str, unknown))[0]}", f"unknown key (expected one of {sorted(keys)})")


def _kubernetes(value: object, path: str) -> Kubernetes | None:
    """`kubernetes: true` (in-cluster, defaults) or a mapping of _KUBE_KEYS; absent or false: None."""
    if value is None or value is False:
        return None
    if value is True:
        return Kubernetes()
    _mapping(value, _KUBE_KEYS, path, "kubernetes", "true or ")
    kubeconfig = value.get("kubeconfig")
    if kubeconfig is not None:
        if not isinstance(kubeconfig, str) or not kubeconfig:
            raise ConfigError(path, "kubernetes.kubeconfig", f"expected a file path, got {kubeconfig!r}")
        kubeconfig = os.path.join(os.path.dirname(os.path.abspath(path)), kubeconfig)
    for key in ("context", "runtime_class"):
        v = value.get(key)
        if v is not None and (not isinstance(v, str) or not v):
            raise ConfigError(path, f"kubernetes.{key}", f"expected a name, got {v!r}")
    port = value.get("tsord_port")
    if port is not None and (not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536):
        raise ConfigError(path, "kubernetes.tsord_port", f"expected a port number, got {port!r}")
    every = value.get("discovery_seconds", 60.0)
    if not isinstance(every, (int, float)) or isinstance(every, bool) or not 0 < every <= 86400:
        raise ConfigError(path, "kubernetes.discovery_seconds", f"expected seconds (0 to 86400), got {every!r}")
    return Kubernetes(kubeconfig=kubeconfig, context=value.get("context"),
                      runtime_class=value.get("runtime_class") or "quark", tsord_port=port,
                      discovery_seconds=float(every))


def _rdma(value: object, path: str) -> RdmaPort:
    if value is None:
        return RdmaPort()
    _mapping(value, _RDMA_KEYS, path, "rdma")
    device = value.get("device")
    if device is not None and (not isinstance(device, str) or not device or "/" in device):
        raise ConfigError(path, "rdma.device", f"expected a device name (as ibv_devices lists it), got {device!r}")
    port, gid = value.get("port"), value.get("gid_index")
    if port is not None and (not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 255):
        raise ConfigError(path, "rdma.port", f"expected a port number from 1, got {port!r}")
    if gid is not None and (not isinstance(gid, int) or isinstance(gid, bool) or not 0 <= gid <= 65535):
        raise ConfigError(path, "rdma.gid_index", f"expected a GID table index from 0, got {gid!r}")
    pump = value.get("pump", "compiled")
    if pump not in PUMPS:
        raise ConfigError(path, "rdma.pump", f"expected one of {', '.join(PUMPS)}, got {pump!r}")
    pump_port = value.get("pump_port", DEFAULT_PUMP_PORT)
    if not isinstance(pump_port, int) or isinstance(pump_port, bool) or not 1 <= pump_port <= 65535:
        raise ConfigError(path, "rdma.pump_port", f"expected a TCP port, got {pump_port!r}")
    return RdmaPort(device, port, gid, pump, pump_port)


def _transport(value: object, path: str, transports: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    pairs = value.items() if isinstance(value, dict) else [("*", value)]
    out = []
    for node, t in pairs:
        if not isinstance(node, str) or not node:
            raise ConfigError(path, "transport", f"expected node names as keys, got {node!r}")
        if t not in transports:
            field = "transport" if node == "*" and not isinstance(value, dict) else f"transport.{node}"
            raise ConfigError(path, field, f"expected one of {', '.join(transports)}, got {t!r}")
        out.append((node, t))
    return tuple(out)


def _secret(value: object, path: str) -> bytes | None:
    """The cluster secret from `cluster_secret_file`, which only its owner may read."""
    field = "cluster_secret_file"
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ConfigError(path, field, f"expected a file path, got {value!r}")
    file = os.path.join(os.path.dirname(os.path.abspath(path)), value)
    try:
        with open(file, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            secret = f.read(4096).strip()
    except OSError as e:
        raise ConfigError(path, field, f"cannot read {file}: {e.strerror}") from None
    if mode & 0o077:
        raise ConfigError(path, field, f"{file} is readable or writable by group or others "
                                       f"(mode {mode & 0o777:o}): chmod 600 it")
    if len(secret) < MIN_SECRET:
        raise ConfigError(path, field, f"{file} holds {len(secret)} bytes; the secret needs at least "
                                       f"{MIN_SECRET} (e.g. `head -c 32 /dev/urandom | base64`)")
    return secret
