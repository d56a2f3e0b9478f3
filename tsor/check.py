"""`quark tsor check`: this host's RDMA devices and, for a tsor.yaml, the transport each peer node
in its route table would get. The transport is decided by the function tsord itself uses
(transport/rdma_link.py's `choose`, with its `open_active` for "has this host an active RDMA port"),
so the answer is what tsord would do, not a second opinion. The peers are the route file's nodes,
or with `kubernetes:` the Nodes the API server lists, read by tsord's own Kubernetes source."""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict

from tsor import config as configmod
from tsor import routes as routesmod
from tsor.errors import ConfigError
from tsor.transport.rdma_link import choose, open_active, open_pyverbs, pump_for
from tsor.verbs import Device, NoDevice, VerbsError
from tsor.verbs.pyverbs_provider import DeviceReport, describe_devices

def devices_report(describe: Callable[[], list[DeviceReport]] = describe_devices) -> dict:
    """{"devices": [...], "error": None} or {"devices": [], "error": "no RDMA device (...)"}."""
    try:
        found = describe()
    except (NoDevice, VerbsError) as e:
        return {"devices": [], "error": str(e)}
    return {"devices": [{"name": d.name, "kind": d.kind,
                         "ports": [{**asdict(p), "gids": [{"index": i, "gid": g, "type": t} for i, g, t in p.gids]}
                                   for p in d.ports]} for d in found], "error": None}


class _RdmaHere:
    """Whether tsord would find an active RDMA port here (asked once, and only if it matters)."""

    def __init__(self, open_rdma: Callable[[], Device]) -> None:
        self.open_rdma = open_rdma
        self.device: str | None = None
        self.why: str | None = None
        self.asked = False

    def __call__(self) -> bool:
        if not self.asked:
            self.asked = True
            try:
                dev = open_active(self.open_rdma)
            except (NoDevice, VerbsError) as e:
                self.why = str(e)
            else:
                self.device = dev.name
                dev.close()
        return self.device is not None


def _describe(configured: str, chosen: str, here: _RdmaHere, peer: str) -> str:
    if chosen == "rdma":
        return f"rdma on {here.device}, one RC queue pair to {peer}, if {peer} has an active RDMA port too; else tcp"
    if configured in ("rdma", "auto"):
        return f"tcp: {here.why or 'no active RDMA port here'}"
    return "tcp: a kernel TCP connection for each connection"


def peers_report(cfg: configmod.Config, nodes: list[routesmod.Node],
                 open_rdma: Callable[[], Device] = open_pyverbs) -> dict:
    """Per peer node of the route table: the configured transport and what tsord would use."""
    here = _RdmaHere(open_rdma)
    peers = []
    for n in nodes:
        if n.name == cfg.node:
            continue
        configured = cfg.transport_for(n.name)
        if cfg.node_key is None:
            chosen, detail = "native", "no cluster_secret_file: pods reach other nodes without TSoR"
        elif n.address is None:
            chosen, detail = "native", "the route table gives no address for its tsord"
        else:
            chosen = choose(configured, here)
            detail = _describe(configured, chosen, here, n.name)
        peers.append({"node": n.name, "address": str(n.address) if n.address else None,
                      "configured": configured, "transport": chosen, "detail": detail})
    local = {"device": here.device, "why_not": here.why} if here.asked else None
    return {"peers": peers, "rdma_port": local}


def kubernetes_nodes(path: str, cfg: configmod.Config) -> list[routesmod.Node]:
    """The nodes tsord's Kubernetes source would put in its table: one list of Nodes, by its own code
    (routes_k8s.py), from the API server tsor.yaml names. ConfigError when it cannot be listed."""
    from tsor.routes_k8s import KubernetesSource, describe
    table = routesmod.RouteTable()
    src = KubernetesSource(cfg.kubernetes, cfg.tsord_port, read_timeout=10)
    retries = logging.getLogger("urllib3.connectionpool")   # one line below says it, not three "Retrying"s
    level = retries.level
    retries.setLevel(logging.ERROR)
    try:
        src.list_once(table, ("nodes",))
    except ConfigError:
        raise
    except Exception as e:   # whatever stops the list: in a line, with the server it asked
        raise ConfigError(path, "kubernetes", f"cannot list the Nodes from the API server at {src.server}: "
                                              f"{describe(e)}") from None
    finally:
        retries.setLevel(level)
    return sorted(table.nodes.values(), key=lambda n: n.name)


def report(path: str, describe: Callable[[], list[DeviceReport]] = describe_devices,
           open_rdma: Callable[[], Device] | None = None) -> dict:
    """The whole check for the tsor.yaml at `path`; ConfigError (file and field) when it is bad or
    its API server cannot be listed."""
    cfg = configmod.load(path)
    if cfg.routes:
        nodes = routesmod.load(cfg.routes)
    elif cfg.kubernetes is not None:
        nodes = kubernetes_nodes(path, cfg)
    else:
        nodes = []
    return {"config": path, "node": cfg.node, "transport": dict(cfg.transport), "routes": cfg.routes,
            "kubernetes": cfg.kubernetes is not None,
            "rdma": devices_report(describe) | {"pump": dict(zip(("used", "why"), pump_for(cfg.rdma.pump)))},
            **peers_report(cfg, nodes, open_rdma or (lambda: open_pyverbs(cfg.rdma)))}
