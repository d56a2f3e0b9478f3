"""quark state: print the OCI state JSON."""
from __future__ import annotations

import argparse
import json

from qlib.errors import ContainerNotFound
from qvisor.container.common import state
from qvisor.state import CREATING


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("id")


def run(args: argparse.Namespace) -> int:
    st = state(args.root, args.id)
    if st.status == CREATING:
        # as runc: a container is there for `state` once its create is done (tools poll `state` after
        # starting `create` until it answers, then expect "created")
        raise ContainerNotFound(args.id)
    print(json.dumps(st.oci(), indent=2))
    return 0
