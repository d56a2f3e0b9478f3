"""quark kill: signal the container's init (or, with --all, every process in it)."""
from __future__ import annotations

import argparse

from qvisor.container.kill import kill, parse_signal


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-a", "--all", action="store_true", help="signal all processes in the container")
    p.add_argument("id")
    p.add_argument("signal", nargs="?", default="SIGTERM", help="name (TERM, SIGKILL) or number (default SIGTERM)")


def run(args: argparse.Namespace) -> int:
    kill(args.root, args.id, parse_signal(args.signal), args.all)
    return 0
