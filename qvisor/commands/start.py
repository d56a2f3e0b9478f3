"""quark start: run the user's process in a created container."""
from __future__ import annotations

import argparse

from qvisor.container.start import start


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("id")


def run(args: argparse.Namespace) -> int:
    start(args.root, args.id)
    return 0
