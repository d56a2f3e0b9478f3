"""The kernel-chosen remote path (tsor/remote_path.py) between two real kernels: a quark pod on
guest a dials a quark pod on guest b (tests/pair/remote_node.py: a tsord on each guest with
`local_path: sockmap` and `transport: rdma`, each on its own soft-RoCE device). The connect is made
by the kernel at a's pump listener, carried over the two nodes' RDMA link by the compiled pumps, and
delivered by b's tsord connecting to the pod; both applications see the real pod addresses, every
byte arrives, and nothing went through the wire natively."""
from __future__ import annotations

import json

import pytest

from tests.pair import remote_node
from tsor.metrics import fetch, parse

# a quark pod's client: N bytes to ip:port (after b"R": remote_node.SERVER's report), half-close,
# the server's report; what the socket said
CLIENT = ("import hashlib, json, os, socket, sys\n"
          "ip, port, n, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]\n"
          "s = socket.create_connection((ip, port), timeout=60)\n"
          "ends = {'sock': s.getsockname(), 'peer': s.getpeername()}   # (once both sides closed: ENOTCONN)\n"
          "data = os.urandom(n); s.sendall(b'R' + data); s.shutdown(socket.SHUT_WR)\n"
          "reply = b''\n"
          "while d := s.recv(1 << 16): reply += d\n"
          "json.dump({**ends, 'sha': hashlib.sha256(data).hexdigest(), 'server': json.loads(reply)}, open(out, 'w'))\n")


def counters(node) -> dict[str, float]:
    return parse(fetch(node.metrics))


@pytest.fixture(scope="module")
def nodes(peer):
    a = remote_node.PairNode("a", *remote_node.wire())
    try:
        yield a, remote_node.wait_for_b(a)
    finally:
        a.close()


def test_a_pod_reaches_another_nodes_pod_through_the_pump_with_the_real_addresses(nodes):
    a, server_ip = nodes
    before = counters(a.node)
    pod = a.node.pod("cli")
    out = "/out/client.json"
    n = 4 << 20
    r = a.bed.run("quark", "cli", a.bed.bundle("cli", ["python3", "-c", CLIENT, server_ip,
                                                      str(remote_node.SERVER_PORT), str(n), out], pod))
    assert r.returncode == 0, r.stderr
    with open(a.out("client.json")) as f:
        got = json.load(f)
    assert got["server"]["sha"] == got["sha"], "the bytes did not arrive intact"
    assert tuple(got["peer"]) == (server_ip, remote_node.SERVER_PORT)        # the client's getpeername
    assert got["sock"][0] == pod.ip                                          # its own address
    assert tuple(got["server"]["sock"]) == (server_ip, remote_node.SERVER_PORT)
    assert tuple(got["server"]["accept"]) == tuple(got["sock"])              # the server's accept()...
    assert tuple(got["server"]["peer"]) == tuple(got["sock"])                # ... and getpeername
    after = counters(a.node)
    assert after["tsor_remote_path_accepted"] - before["tsor_remote_path_accepted"] == 1, \
        "the connection did not go through the pump"
    sent = after['tsor_bytes_total{direction="sent",path="rdma"}'] - before['tsor_bytes_total{direction="sent",path="rdma"}']
    assert sent >= n
