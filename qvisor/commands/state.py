"""quark state: print the OCI state JSON."""
from __future__ import annotations

import argparse
import json

from qvisor import container


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("id")


def run(args: argparse.Namespace) -> int:
    print(json.dumps(container.state(args.root, args.id).oci(), indent=2))
    return 0
