"""quark update: change a running container's resource limits."""
from __future__ import annotations

import argparse

from qvisor import container


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-r", "--resources", required=True, help="linux.resources JSON file ('-' for stdin)")
    p.add_argument("id")


def run(args: argparse.Namespace) -> int:
    container.update(args.root, args.id, args.resources)
    return 0
