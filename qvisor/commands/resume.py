"""quark resume: thaw a paused container."""
from __future__ import annotations

import argparse

from qvisor.container.resume import resume


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("id")


def run(args: argparse.Namespace) -> int:
    resume(args.root, args.id)
    return 0
