"""`quark tsor status`: the node's TSoR counters (connections and bytes per path) and its rdma links,
read from tsord's metrics endpoint (`metrics:` in /etc/quark/tsor.yaml, or --metrics).
`quark tsor check`: this host's RDMA devices and the transport each peer node would get (tsor/check.py)."""
from __future__ import annotations

import argparse
import json

from qlib.errors import QuarkError
from tsor import DEFAULT_CONFIG
from tsor import config as tsor_config
from tsor.check import report
from tsor.metrics import fetch, parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="tsor_verb", metavar="SUBCOMMAND", required=True)
    st = sub.add_parser("status", help="connections and bytes per path, from the running tsord")
    st.add_argument("--config", default=DEFAULT_CONFIG, help="tsord's config (default: %(default)s)")
    st.add_argument("--metrics", default=None,
                    help="tsord's metrics endpoint, HOST:PORT or unix:/path (default: from --config)")
    st.add_argument("--format", choices=("table", "json"), default="table")
    ck = sub.add_parser("check", help="RDMA devices, ports and GIDs, and the transport each peer node would get")
    ck.add_argument("--config", default=DEFAULT_CONFIG, help="tsord's config (default: %(default)s)")
    ck.add_argument("--format", choices=("table", "json"), default="table")


def _endpoint(args: argparse.Namespace):
    if args.metrics:
        if args.metrics.startswith("unix:"):
            return args.metrics[5:]
        return tsor_config.parse_hostport(args.metrics, "--metrics", "value")
    cfg = tsor_config.load(args.config)
    if cfg.metrics is None:
        raise QuarkError(f"{args.config}: metrics: not set, so tsord serves no counters")
    return cfg.metrics


def run(args: argparse.Namespace) -> int:
    if getattr(args, "tsor_verb", "status") == "check":
        return check(args)
    return status(args)


def status(args: argparse.Namespace) -> int:
    where = _endpoint(args)
    try:
        text = fetch(where)
        values = parse(text)
        links = _links(text)
        foreign = _foreign(text)
    except OSError as e:
        raise QuarkError(f"tsord is not answering on {where}: {e}") from None
    except ValueError as e:
        raise QuarkError(f"{where} did not answer with Prometheus text: {e}") from None
    paths = ("local", "tcp", "rdma", "fallback")
    rows = []
    for p in paths:
        conns = values.get(f'tsor_connections_total{{path="{p}"}}', 0)
        setup = values.get(f'tsor_setup_seconds_total{{path="{p}"}}', 0)
        rows.append({"path": p, "connections": int(conns),
                     "incoming": int(values.get(f'tsor_incoming_total{{path="{p}"}}', 0)),
                     "bytes_sent": _bytes(values, p, "sent"), "bytes_received": _bytes(values, p, "received"),
                     "mean_setup_us": round(setup / conns * 1e6, 1) if conns else None})
    summary = {"sandboxes": int(values.get("tsor_sandboxes", 0)), "pods": int(values.get("tsor_pods", 0)),
               "listeners": int(values.get("tsor_listeners", 0)),
               "protocol_errors": int(values.get("tsor_protocol_errors_total", 0)),
               "refused": int(values.get("tsor_refused_total", 0)),
               # connections sent native by tsord's per-sandbox bounds (tsor_limited_total, any limit)
               "limited": int(sum(v for k, v in values.items() if k.startswith("tsor_limited_total{")))}
    if args.format == "json":
        print(json.dumps({"paths": rows, "rdma_links": links, "foreign_policies": foreign, **summary}, indent=2))
        return 0
    print(f"{'PATH':<9} {'CONNECTIONS':>11} {'INCOMING':>8} {'BYTES SENT':>12} {'BYTES RECV':>12} {'SETUP (us)':>10}")
    for r in rows:
        fmt = lambda v: "-" if v is None else str(v)  # noqa: E731
        print(f"{r['path']:<9} {r['connections']:>11} {r['incoming']:>8} {fmt(r['bytes_sent']):>12} "
              f"{fmt(r['bytes_received']):>12} {fmt(r['mean_setup_us']):>10}")
    print(", ".join(f"{k.replace('_', ' ')}: {v}" for k, v in summary.items()))
    for link in links:
        what = f"rdma on {link['device']} ({link['provider']}, {link['pump']} pump)"
        print(f"rdma link to node {link['node']}: {what}, {link['connections']} connections")
    for f in foreign:
        where = ("every connection" if f["scope"] == "cluster"
                 else f"connections from or to namespace {f['scope'].split('/', 1)[1]}")
        print(f"policy kind {f['kind']} ({f['api']}) is not evaluated by tsord: {where} goes native")
    return 0


def _foreign(text: str) -> list[dict]:
    """The policy kinds tsord does not evaluate and where they send connections native (tsor_policy_foreign)."""
    from prometheus_client.parser import text_string_to_metric_families
    return [{k: sample.labels[k] for k in ("kind", "api", "scope")}
            for family in text_string_to_metric_families(text) for sample in family.samples
            if sample.name == "tsor_policy_foreign" and sample.value]


def _links(text: str) -> list[dict]:
    """The rdma links tsord has up (tsor_rdma_links, tsor_rdma_connections), one row per peer node."""
    from prometheus_client.parser import text_string_to_metric_families
    links: dict[str, dict] = {}
    conns: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "tsor_rdma_links":
                links[sample.labels["node"]] = {k: sample.labels.get(k) for k in ("node", "provider", "device", "pump")}
            elif sample.name == "tsor_rdma_connections":
                conns[sample.labels["node"]] = int(sample.value)
    return [links[n] | {"connections": conns.get(n, 0)} for n in sorted(links)]


def check(args: argparse.Namespace) -> int:
    r = report(args.config)
    if args.format == "json":
        print(json.dumps(r, indent=2))
        return 0
    rdma = r["rdma"]
    print("RDMA devices (pyverbs):" + (f" none: {rdma['error']}" if rdma["error"] else ""))
    for dev in rdma["devices"]:
        print(f"  {dev['name']}: {dev['kind']}")
        for p in dev["ports"]:
            print(f"  {dev['name']} port {p['port']}: {p['state']}, {p['link_layer']}, LID {p['lid']}, "
                  f"active MTU {p['mtu']}")
            for g in p["gids"]:
                mark = "  <- used (rdma.gid_index in tsor.yaml chooses another)" if g["index"] == p["default_gid"] else ""
                print(f"    GID[{g['index']}] {g['gid']} {g['type']}".rstrip() + mark)
    pump = rdma["pump"]
    print(f"rdma pump: {pump['used']}" + (f" ({pump['why']})" if pump["why"] else " (tsor/transport/rdma_pump.c)"))
    setting = ", ".join(f"{k}: {v}" for k, v in r["transport"].items())
    print(f"{r['config']}: node {r['node']}, transport {{{setting}}}")
    if not r["peers"]:
        print("no peer nodes" + ("" if r["routes"] or r["kubernetes"] else " (routes: not set)"))
        return 0
    print(f"{'NODE':<16} {'CONFIGURED':<10} {'TRANSPORT':<9} DETAIL")
    for p in r["peers"]:
        print(f"{p['node']:<16} {p['configured']:<10} {p['transport']:<9} {p['detail']}")
    return 0


def _bytes(values: dict, path: str, direction: str) -> int | None:
    v = values.get(f'tsor_bytes_total{{direction="{direction}",path="{path}"}}')   # parse() sorts labels
    return None if v is None else int(v)
