"""quark delete: remove a stopped container's resources (--force: stop it first)."""
from __future__ import annotations

import argparse

from qlib.errors import ContainerNotFound
from qvisor.container.delete import delete


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-f", "--force", action="store_true",
                   help="kill the container if it is still running; a container that does not exist is no error")
    p.add_argument("id")


def run(args: argparse.Namespace) -> int:
    try:
        delete(args.root, args.id, args.force)
    except ContainerNotFound:
        if not args.force:   # runc: with --force, deleting what is already gone succeeds
            raise
    return 0
