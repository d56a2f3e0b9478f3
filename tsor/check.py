"""`quark tsor check`: this host's RDMA devices and, for a tsor.yaml, the transport each peer node
in its route table would get. The transport is decided by the function tsord itself uses
(transport/rdma_link.py's `choose`, with its `open_active` for "has this host an active RDMA port"),
so the answer is what tsord would do, not a second opinion."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict

from tsor import config as configmod
from tsor import routes as routesmod
from tsor.transport.rdma_link import choose, open_active, open_pyverbs
from tsor.verbs import Device, NoDevice, VerbsError
from tsor.verbs.pyverbs_provider import DeviceReport, describe_devices

SOFTVERBS = "softverbs (software RDMA over the tsords' TCP connection; no RDMA hardware)"


def devices_report(describe: Callable[[], list[DeviceReport]] = describe_devices) -> dict:
    """{"devices": [...], "error": None} or {"devices": [], "error": "no RDMA device (...)"}."""
    try:
        found = describe()
    except (NoDevice, VerbsError) as e:
        return {"devices": [], "error": str(e)}
    return {"devices": [{"name": d.name, "ports": [{**asdict(p), "gids": [{"index": i, "gid": g} for i, g in p.gids]}
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
    if chosen == "softverbs":
        return f"{SOFTVERBS}; {peer} must say softverbs too, else tcp"
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


def report(path: str, describe: Callable[[], list[DeviceReport]] = describe_devices,
           open_rdma: Callable[[], Device] = open_pyverbs) -> dict:
    """The whole check for the tsor.yaml at `path`; ConfigError (file and field) when it is bad."""
    cfg = configmod.load(path)
    nodes = routesmod.load(cfg.routes) if cfg.routes else []
    return {"config": path, "node": cfg.node, "transport": dict(cfg.transport), "routes": cfg.routes,
            "rdma": devices_report(describe), **peers_report(cfg, nodes, open_rdma)}
