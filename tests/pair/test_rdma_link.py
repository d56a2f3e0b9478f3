"""TSoR's rdma transport between two hosts' RoCE devices: each guest of the pair lane runs the
engine tsord runs (the compiled pump, tsord's default, and the Python engine) on its own rxe0, and
connections carried over the one RC queue pair between them arrive intact, both ways (elsewhere
the transport is tested on one device that loops its QPs back: tests/integration/test_tsor_rdma.py)."""
from __future__ import annotations

import hashlib
import os
import socket

import pytest

from tests.pair.rdma_node import PUMPS, dial


@pytest.fixture(params=PUMPS, scope="module")
def linked(request, peer):
    node, ctl = dial(peer, request.param)
    yield node
    ctl.close()
    node.close()


@pytest.mark.parametrize("size", [1, 65537, 8 << 20])
def test_a_stream_arrives_intact_on_the_other_host(linked, size):
    payload = os.urandom(size)
    sock = linked.open()
    with sock:
        sock.settimeout(120)
        sock.sendall(b"S" + payload)
        sock.shutdown(socket.SHUT_WR)
        assert sock.recv(100).decode() == hashlib.sha256(payload).hexdigest()


def test_replies_come_back_over_the_link(linked):
    """Echoes: the far host's writes reach this one over the same queue pair, in order."""
    sock = linked.open()
    with sock:
        sock.settimeout(60)
        sock.sendall(b"E")
        for i in range(20):
            msg = f"ping {i}".encode() * (i + 1)
            sock.sendall(msg)
            got = b""
            while len(got) < len(msg):
                got += sock.recv(65536)
            assert got == msg


def test_several_connections_share_the_link(linked):
    socks = [linked.open() for _ in range(8)]
    payloads = [os.urandom(100_000 + i) for i in range(8)]
    for s, p in zip(socks, payloads):
        s.settimeout(120)
        s.sendall(b"S" + p)
        s.shutdown(socket.SHUT_WR)
    for s, p in zip(socks, payloads):
        with s:
            assert s.recv(100).decode() == hashlib.sha256(p).hexdigest()
