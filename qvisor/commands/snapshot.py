"""quark snapshot: hibernate a running container (freeze it, page its memory out), wake it, and
list the hibernated ones. A hibernated container also wakes on its own when a connection comes to
any socket it listens on, and for `quark resume` and `quark exec` (qvisor/supervisor/snapshot.py)."""
from __future__ import annotations

import argparse
import json
import time

from qlib.errors import QuarkError
from qvisor.container.snapshot import hibernate as container_hibernate
from qvisor.container.snapshot import snapshot_info, wake
from qvisor.state import StateStore

MiB = 1 << 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    c = sub.add_parser("create", help="hibernate a running container")
    c.add_argument("-f", "--format", choices=("table", "json"), default="table")
    c.add_argument("id")
    r = sub.add_parser("restore", help="wake a hibernated container")
    r.add_argument("--no-prefetch", action="store_true",
                   help="do not read the recorded working set back before thawing (pages come back on fault)")
    r.add_argument("id")
    ls = sub.add_parser("list", help="list hibernated containers")
    ls.add_argument("-f", "--format", choices=("table", "json"), default="table")


def hibernate(root: str, cid: str) -> dict:
    """Swap first (the supervisor may not switch it on), then ask the supervisor."""
    from qvisor import swap
    swap.ensure_swap()
    return container_hibernate(root, cid)


def run(args: argparse.Namespace) -> int:
    if args.action == "create":
        info = hibernate(args.root, args.id)
        if args.format == "json":
            print(json.dumps(info))
        else:
            note = "" if info.get("swap") else " (no swap on this host: frozen only, its memory stays)"
            if info.get("swap_full"):
                note = " (the swap is full: the rest stays in memory)"
            print(f"{args.id}: hibernated, memory {info['warm_bytes'] / MiB:.1f} MiB -> "
                  f"{info['held_bytes'] / MiB:.1f} MiB in {info['took_ms']:.0f} ms{note}")
        return 0
    if args.action == "restore":
        info = wake(args.root, args.id, prefetch=not args.no_prefetch)
        print(f"{args.id}: woken in {info['took_ms']:.1f} ms")
        return 0
    rows = _hibernated(args.root)
    if args.format == "json":
        print(json.dumps(rows))
        return 0
    fmt = "{:<24} {:>10} {:>10} {:>12} {:>6}  {}"
    print(fmt.format("ID", "HELD MiB", "WARM MiB", "HIBERNATED", "WAKES", "REASON"))
    for r in rows:
        print(fmt.format(r["id"], f"{r['held_now_bytes'] / MiB:.1f}", f"{r['warm_bytes'] / MiB:.1f}",
                         _ago(r["hibernated_for_s"]), r["wakes"], r["reason"]))
    return 0


def _hibernated(root: str) -> list[dict]:
    store = StateStore(root)
    rows = []
    for cid in store.list():
        if store.hibernation(cid) is None:
            continue
        try:
            info = snapshot_info(root, cid)
        except QuarkError:
            continue   # it stopped meanwhile
        if not info.get("hibernated"):
            continue
        rows.append({"id": cid, "held_now_bytes": info["held_now_bytes"], "warm_bytes": info["warm_bytes"],
                     "since": info["since"], "hibernated_for_s": round(time.time() - info["since_epoch"], 1),
                     "wakes": info["wakes"], "hibernations": info["hibernations"], "reason": info["reason"],
                     "swap": info["swap"]})
    return rows


def _ago(s: float) -> str:
    if s < 120:
        return f"{s:.0f}s"
    if s < 7200:
        return f"{s / 60:.0f}m"
    return f"{s / 3600:.1f}h"
