"""The kernel-chosen remote path (tsor/remote_path.py) between two real kernels: a quark pod on
guest a dials a quark pod on guest b (tests/pair/remote_node.py: a tsord on each guest with
`local_path: sockmap` and `transport: rdma`, each on its own soft-RoCE device). The connect is made
by the kernel at a's pump listener, carried over the two nodes' RDMA link by the compiled pumps, and
delivered by b's tsord connecting to the pod; both applications see the real pod addresses, every
byte arrives, and nothing went through the wire natively."""
from __future__ import annotations

import json
import os
import time

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


# 1,000 connections open at once from one quark pod, each b"R" + 1 KiB, every reply checked
MANY = ("import hashlib, json, os, socket, sys\n"
        "ip, port, n, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]\n"
        "conns = []\n"
        "for _ in range(n):\n"
        " s = socket.create_connection((ip, port), timeout=120); data = os.urandom(1024)\n"
        " conns.append((s, s.getsockname(), hashlib.sha256(data).hexdigest())); s.sendall(b'R' + data)\n"
        "for s, _, _ in conns: s.shutdown(socket.SHUT_WR)\n"
        "bad = []\n"
        "for s, me, sha in conns:\n"
        " reply = b''\n"
        " while d := s.recv(1 << 16): reply += d\n"
        " r = json.loads(reply)\n"
        " if r['sha'] != sha or tuple(r['accept']) != tuple(me): bad.append([me, r])\n"
        " s.close()\n"
        "json.dump({'bad': bad[:5], 'n_bad': len(bad)}, open(out, 'w'))\n")


def test_1000_connections_at_once_all_arrive_those_past_the_links_room_natively(nodes):
    a, server_ip = nodes
    before = counters(a.node)
    pod = a.node.pod("many")
    n = 1000
    r = a.bed.run("quark", "many", a.bed.bundle("many", ["python3", "-c", MANY, server_ip,
                                                        str(remote_node.SERVER_PORT), str(n), "/out/many.json"], pod),
                  timeout=900)
    assert r.returncode == 0, r.stderr
    with open(a.out("many.json")) as f:
        got = json.load(f)
    assert got["n_bad"] == 0, got["bad"]
    after = counters(a.node)
    carried = after["tsor_remote_path_accepted"] - before["tsor_remote_path_accepted"]
    # the link's channels (RingConfig.slots: 127 each way, less the reserve) took what they could hold,
    # the rest went natively; none was reset for want of room
    assert 0 < carried < n
    assert after["tsor_remote_path_unclaimed"] == before["tsor_remote_path_unclaimed"]


# a quark pod's stream that runs until its connection fails: /out/NAME-connected once it is
# connected, /out/NAME-failed with the error and when (the guest's clock) once it fails
STREAMER = ("import json, socket, sys, time\n"
            "ip, port, name = sys.argv[1], int(sys.argv[2]), sys.argv[3]\n"
            "s = socket.create_connection((ip, port), timeout=60); s.sendall(b'S')\n"
            "block = bytes(1 << 16); s.sendall(block)\n"
            "open(f'/out/{name}-connected', 'w').close()\n"
            "try:\n"
            " while True: s.sendall(block); time.sleep(0.01)\n"
            "except OSError as e:\n"
            " json.dump({'error': type(e).__name__, 'at': time.time()}, open(f'/out/{name}-failed', 'w'))\n")


def stream_until_it_fails(a, server_ip: str, name: str) -> str:
    """A streaming pod on node a, connected (through the pump) to b's server pod; its failure file."""
    pod = a.node.pod(name)
    before = counters(a.node)["tsor_remote_path_accepted"]
    a.bed.start("quark", name, a.bed.bundle(name, ["python3", "-c", STREAMER, server_ip,
                                                   str(remote_node.SERVER_PORT), name], pod))
    wait_for(lambda: os.path.exists(a.out(f"{name}-connected")), 120)
    assert counters(a.node)["tsor_remote_path_accepted"] == before + 1, "the stream did not take the pump"
    return a.out(f"{name}-failed")


def wait_for(cond, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def one_connection_works(a, server_ip: str, name: str) -> None:
    pod = a.node.pod(name)
    r = a.bed.run("quark", name, a.bed.bundle(name, ["python3", "-c", CLIENT, server_ip, str(remote_node.SERVER_PORT),
                                                     str(4096), f"/out/{name}.json"], pod))
    assert r.returncode == 0, r.stderr
    with open(a.out(f"{name}.json")) as f:
        got = json.load(f)
    assert got["server"]["sha"] == got["sha"] and tuple(got["server"]["accept"]) == tuple(got["sock"])


def test_the_far_nodes_tsord_killed_mid_stream_resets_the_stream_within_the_stall_timeout(nodes):
    """Node b's tsord (and its pump) killed: a's pump finds the link gone and resets the stream (no
    hang); once b's tsord is back, a sets up a new link and connections take the pump again."""
    a, server_ip = nodes
    pair = os.environ["QUARK_PAIR_DIR"]
    failed = stream_until_it_fails(a, server_ip, "far")
    killed = time.time()
    open(os.path.join(pair, "b-kill-tsord"), "w").close()
    wait_for(lambda: os.path.exists(failed), 60)
    with open(failed) as f:
        got = json.load(f)
    assert got["error"] in ("ConnectionResetError", "BrokenPipeError"), got
    assert got["at"] - killed < 10 + 20   # the pump's stall timeout, and rxe's retries under TCG
    wait_for(lambda: os.path.exists(os.path.join(pair, "b-tsord-back")), 60)
    remote_node.wait_for_b(a)
    before = counters(a.node)["tsor_remote_path_accepted"]
    one_connection_works(a, server_ip, "afterfar")
    assert counters(a.node)["tsor_remote_path_accepted"] == before + 1


def test_the_clients_tsord_killed_resets_its_streams_and_connects_go_native_until_it_is_back(nodes):
    """Node a's own tsord (and its pump) killed: the stream through it is reset at once; the pump's
    listener left the programs' pump map with it, so a new connection to b's pod is native and
    works (not refused at a port nobody listens on); a tsord started again carries them again."""
    a, server_ip = nodes
    failed = stream_until_it_fails(a, server_ip, "near")
    killed = time.time()
    a.kill_tsord()
    try:
        wait_for(lambda: os.path.exists(failed), 30)
        with open(failed) as f:
            got = json.load(f)
        assert got["error"] in ("ConnectionResetError", "BrokenPipeError"), got
        assert got["at"] - killed < 10
        one_connection_works(a, server_ip, "whiledown")
    finally:
        a.start_tsord()
    remote_node.wait_for_b(a)
    before = counters(a.node)["tsor_remote_path_accepted"]
    one_connection_works(a, server_ip, "afternear")
    assert counters(a.node)["tsor_remote_path_accepted"] == before + 1
