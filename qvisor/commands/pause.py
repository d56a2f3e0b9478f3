"""quark pause: freeze every process of the container (cgroup freezer)."""
from __future__ import annotations

import argparse

from qvisor.container.pause import pause


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("id")


def run(args: argparse.Namespace) -> int:
    pause(args.root, args.id)
    return 0
