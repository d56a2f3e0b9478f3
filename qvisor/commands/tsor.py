"""`quark tsor status`: the node's TSoR counters (connections and bytes per path), read from tsord's
metrics endpoint (`metrics:` in /etc/quark/tsor.yaml, or --metrics)."""
from __future__ import annotations

import argparse
import json

from qlib.errors import QuarkError
from tsor import DEFAULT_CONFIG
from tsor import config as tsor_config
from tsor.metrics import fetch, parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="tsor_verb", metavar="SUBCOMMAND", required=True)
    st = sub.add_parser("status", help="connections and bytes per path, from the running tsord")
    st.add_argument("--config", default=DEFAULT_CONFIG, help="tsord's config (default: %(default)s)")
    st.add_argument("--metrics", default=None,
                    help="tsord's metrics endpoint, HOST:PORT or unix:/path (default: from --config)")
    st.add_argument("--format", choices=("table", "json"), default="table")


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
    where = _endpoint(args)
    try:
        values = parse(fetch(where))
    except OSError as e:
        raise QuarkError(f"tsord is not answering on {where}: {e}") from None
    except ValueError as e:
        raise QuarkError(f"{where} did not answer with Prometheus text: {e}") from None
    paths = ("local", "tcp", "fallback")
    rows = []
    for p in paths:
        conns = values.get(f'tsor_connections_total{{path="{p}"}}', 0)
        setup = values.get(f'tsor_setup_seconds_total{{path="{p}"}}', 0)
        rows.append({"path": p, "connections": int(conns),
                     "incoming": int(values.get(f'tsor_incoming_total{{path="{p}"}}', 0)),
                     "bytes_sent": _bytes(values, p, "sent"), "bytes_received": _bytes(values, p, "received"),
                     "mean_setup_us": round(setup / conns * 1e6, 1) if conns else None})
    summary = {"sandboxes": int(values.get("tsor_sandboxes", 0)), "listeners": int(values.get("tsor_listeners", 0)),
               "protocol_errors": int(values.get("tsor_protocol_errors_total", 0)),
               "refused": int(values.get("tsor_refused_total", 0))}
    if args.format == "json":
        print(json.dumps({"paths": rows, **summary}, indent=2))
        return 0
    print(f"{'PATH':<9} {'CONNECTIONS':>11} {'INCOMING':>8} {'BYTES SENT':>12} {'BYTES RECV':>12} {'SETUP (us)':>10}")
    for r in rows:
        fmt = lambda v: "-" if v is None else str(v)  # noqa: E731
        print(f"{r['path']:<9} {r['connections']:>11} {r['incoming']:>8} {fmt(r['bytes_sent']):>12} "
              f"{fmt(r['bytes_received']):>12} {fmt(r['mean_setup_us']):>10}")
    print(", ".join(f"{k.replace('_', ' ')}: {v}" for k, v in summary.items()))
    return 0


def _bytes(values: dict, path: str, direction: str) -> int | None:
    v = values.get(f'tsor_bytes_total{{direction="{direction}",path="{path}"}}')   # parse() sorts labels
    return None if v is None else int(v)
