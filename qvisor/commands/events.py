"""quark events: container statistics and OOM events as runc prints them, one JSON object per line.

With --stats the statistics are printed once. Otherwise they are printed every --interval, an
{"type": "oom"} event as soon as the OOM killer strikes in the container's cgroup (memory.events'
oom_kill on v2, memory.oom_control's on v1), and the command ends when the container stops.
"""
from __future__ import annotations

import argparse
import json
import time

from qvisor.container.common import state
from qvisor.container.events import running_cgroup
from qvisor.state import STOPPED

OOM_POLL_S = 0.1  # how soon an OOM kill is reported


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stats", action="store_true", help="print the statistics once and exit")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between statistics (default 5)")
    p.add_argument("id")


def _emit(kind: str, cid: str, data: dict | None = None) -> None:
    event: dict = {"type": kind, "id": cid}
    if data is not None:
        event["data"] = data
    print(json.dumps(event), flush=True)


def run(args: argparse.Namespace) -> int:
    cg = running_cgroup(args.root, args.id)   # opened once: v1 finds its hierarchies in mountinfo
    if args.stats:
        _emit("stats", args.id, cg.stats())
        return 0
    seen = cg.oom_kills()
    next_stats = time.monotonic()
    while True:
        if time.monotonic() >= next_stats:
            _emit("stats", args.id, cg.stats())
            next_stats += max(args.interval, OOM_POLL_S)
        time.sleep(min(OOM_POLL_S, max(0.0, next_stats - time.monotonic())))
        now = cg.oom_kills()   # before the stop check: an OOM kill of the init is reported too
        if now > seen:
            _emit("oom", args.id)
        seen = now
        if state(args.root, args.id).status == STOPPED:
            return 0
