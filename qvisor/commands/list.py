"""quark list: the containers under --root."""
from __future__ import annotations

import argparse
import json
import os
import pwd

from qlib.errors import QuarkError
from qvisor.state import StateStore


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-f", "--format", choices=("table", "json"), default="table")
    p.add_argument("-q", "--quiet", action="store_true", help="display only container ids")


def run(args: argparse.Namespace) -> int:
    store = StateStore(args.root)
    rows = []
    for cid in store.list():
        try:
            st = store.load(cid)
        except QuarkError:
            continue
        try:
            owner = pwd.getpwuid(os.stat(store.dir(cid)).st_uid).pw_name
        except (KeyError, OSError):
            owner = "#0"
        rows.append(st.oci() | {"owner": owner})
    if args.quiet:
        print("\n".join(r["id"] for r in rows))
    elif args.format == "json":
        print(json.dumps(rows))
    else:
        fmt = "{:<20} {:<8} {:<10} {:<40} {:<32} {}"
        print(fmt.format("ID", "PID", "STATUS", "BUNDLE", "CREATED", "OWNER"))
        for r in rows:
            print(fmt.format(r["id"], r["pid"], r["status"], r["bundle"], r["created"], r["owner"]))
    return 0
