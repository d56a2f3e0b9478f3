"""quark events: container statistics as runc prints them (once with --stats, else every --interval)."""
from __future__ import annotations

import argparse
import json
import time

from qvisor import container


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stats", action="store_true", help="print the statistics once and exit")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between statistics (default 5)")
    p.add_argument("id")


def run(args: argparse.Namespace) -> int:
    while True:
        print(json.dumps({"type": "stats", "id": args.id, "data": container.stats(args.root, args.id)}), flush=True)
        if args.stats:
            return 0
        time.sleep(args.interval)
