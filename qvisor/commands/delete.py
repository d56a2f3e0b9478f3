"""quark delete: remove a stopped container's resources (--force: stop it first)."""
from __future__ import annotations

import argparse

from qvisor import container


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-f", "--force", action="store_true", help="kill the container if it is still running")
    p.add_argument("id")


def run(args: argparse.Namespace) -> int:
    container.delete(args.root, args.id, args.force)
    return 0
