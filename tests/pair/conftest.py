"""tests/pair runs on guest a of the two-guest RDMA lane (tests/vm/pair.py), against guest b
(tests/pair/peer.py) on the far end of the wire; anywhere else every test here is skipped."""
from __future__ import annotations

import os
import time

import pytest

ROLE = os.environ.get("QUARK_PAIR_ROLE")


def pytest_collection_modifyitems(config, items):
    if ROLE == "a":
        return
    skip = pytest.mark.skip(reason="needs the two-guest RDMA lane: `make test-rdma-pair` "
                                   "(python -m tests.vm.pair) runs these on guest a against guest b")
    for item in items:
        if "tests/pair/" in str(item.fspath):
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _tell_b_when_done():
    """Guest b's peer serves until guest a's session is over."""
    yield
    if ROLE == "a":
        open(os.path.join(os.environ["QUARK_PAIR_DIR"], "a-done"), "w").close()


@pytest.fixture(scope="session")
def peer() -> str:
    """Guest b's wire address, once its peer program serves."""
    pair = os.environ["QUARK_PAIR_DIR"]
    deadline = time.monotonic() + 300
    while not os.path.exists(os.path.join(pair, "b-ready")):
        assert time.monotonic() < deadline, "guest b's peer never became ready"
        time.sleep(0.2)
    return os.environ["QUARK_PAIR_PEER"]
