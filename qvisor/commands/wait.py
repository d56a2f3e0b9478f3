"""quark wait (a quark extension): block until the init or an exec'd process exits.

The container's processes are children of quark's supervisor, not of the caller, so a shim cannot
reap them itself; this prints {"pid", "exit_status", "exited_at"} when the process is gone.
"""
from __future__ import annotations

import argparse
import json

from qvisor.container.wait import wait


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pid", type=int, default=0, help="an exec'd process's host pid (default: the init)")
    p.add_argument("id")


def run(args: argparse.Namespace) -> int:
    print(json.dumps(wait(args.root, args.id, args.pid)), flush=True)
    return 0
