"""tsord with the host tests' software verbs provider: `python -m tests.support.softverbs_tsord
--config tsor.yaml [--debug]` is tsord (tsor/daemon.py's main) that also takes `transport: softverbs`,
its rdma links then running over softverbs (tests/support/softverbs.py) with the tsords' set-up
connection as the cable. tests/support/testbed.py starts it for tests and benchmarks that ask for
softverbs; the production package has no software provider."""
from __future__ import annotations

import sys

from tests.support import softverbs
from tsor import daemon

if __name__ == "__main__":
    sys.exit(daemon.main(cabled=softverbs.CABLED))
