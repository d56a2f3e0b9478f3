"""TSoR across two nodes on one machine: two network namespaces joined by a veth, each with its own
bridge, pods and tsord. quark to quark takes the tcp path (real kernel TCP sockets handed to both
pods); runc pods on either side still talk to quark pods over plain TCP."""
from __future__ import annotations

import json

import pytest

from tests.integration.conftest import needs_root
from tests.integration.test_tsor import CHECKS, PORT, PROG, needs_tsor_in_qkernel, wait_file
from tsor.metrics import fetch, parse


def counters(node) -> dict[str, float]:
    return parse(fetch(node.metrics))


def two_nodes(prefix: str, octet: int, transport: str | None = None, rdma: dict | None = None):
    """Two linked nodes with a tsord each (`transport`, `rdma`: tsor.yaml's node-to-node settings)
    and the semantics program's server in a quark pod on node b; a generator for module fixtures."""
    needs_root()
    needs_tsor_in_qkernel()
    from tests.support.testbed import Testbed
    b = Testbed(prefix=prefix, octet=octet)
    try:
        a, bn = b.node("a"), b.node("b")
        b.link(a, bn)
        a.start_tsord(transport=transport, rdma=rdma)
        bn.start_tsord(transport=transport, rdma=rdma)
        srv = bn.pod("srv")
        b.start("quark", "srv", b.bundle("srv", PROG + ["server", str(PORT)], srv))
        wait_file(b.out("server-ready"))
        b.a, b.b, b.srv = a, bn, srv
        yield b
    finally:
        b.close()


def client_semantics(two) -> dict:
    """The semantics program's client in a quark pod on node a, against the server on node b."""
    pod = two.a.pod("cli")
    r = two.run("quark", "cli", two.bundle("cli", PROG + ["client", two.srv.ip, two.srv.ip6, str(PORT),
                                                         "/out/client.json"], pod))
    assert r.returncode == 0, r.stderr
    with open(two.out("client.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def two():
    yield from two_nodes("qt2", 214)


@pytest.fixture(scope="module")
def semantics(two):
    return client_semantics(two)


@pytest.mark.parametrize("check", [c for c in CHECKS if c != "loopback_stays_in_the_pod"])
def test_tcp_semantics_over_the_tcp_path(semantics, check):
    res = semantics[check]
    assert res["ok"], res["detail"]


def test_quark_to_quark_took_the_tcp_path(two, semantics):
    a, b = counters(two.a), counters(two.b)
    assert a['tsor_connections_total{path="tcp"}'] >= 12
    assert a['tsor_connections_total{path="local"}'] == 0
    assert b['tsor_incoming_total{path="tcp"}'] == a['tsor_connections_total{path="tcp"}']


def test_runc_and_quark_pods_mix(two):
    """runc client -> quark server (plain TCP into the real listener) and quark client -> runc
    server (tsord finds no TSoR listener: native connect)."""
    pod_rs, pod_rc, pod_qc = two.b.pod("rsrv"), two.a.pod("rcli"), two.a.pod("qcli")
    two.start("runc", "rsrv", two.bundle("rsrv", ["python3", "-c",
              "import socket; l=socket.create_server(('0.0.0.0', 7100)); open('/out/rsrv-ready','w');"
              "\nwhile True:\n c=l.accept()[0]; c.sendall(b'runc-here'); c.close()"], pod_rs, tsor=False))
    wait_file(two.out("rsrv-ready"))
    probe = ("import socket,sys; s=socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10);"
             "s.sendall(sys.argv[3].encode()); print(s.recv(100).decode())")
    r = two.run("runc", "rcli", two.bundle("rcli", ["sh", "-c",
                f"python3 -c \"{probe}\" {two.srv.ip} {PORT} 'echo\nfrom-runc' > /out/rcli.txt"],
                pod_rc, tsor=False))
    assert r.returncode == 0, r.stderr
    before = counters(two.a)['tsor_connections_total{path="fallback"}']
    r = two.run("quark", "qcli", two.bundle("qcli", ["sh", "-c",
                f"python3 -c \"{probe}\" {pod_rs.ip} 7100 x > /out/qcli.txt"], pod_qc))
    assert r.returncode == 0, r.stderr
    with open(two.out("rcli.txt")) as f:
        assert f.read().strip() == "from-runc"
    with open(two.out("qcli.txt")) as f:
        assert f.read().strip() == "runc-here"
    assert counters(two.a)['tsor_connections_total{path="fallback"}'] == before + 1
    two.stop("runc", "rsrv")


def test_a_peer_on_another_node_wakes_a_hibernated_server(two):
    """Wake-on-connect over the tcp path: a quark client on node a connects to a hibernated
    quark server on node b; the connection waits in the frozen listener's queue and completes."""
    pod_s, pod_c = two.b.pod("hsrv"), two.a.pod("hcli")
    two.start("quark", "hsrv", two.bundle("hsrv", ["busybox", "httpd", "-f", "-p", "8080", "-h", "/etc"], pod_s))
    from tests.support.snapshot import wait_listening
    wait_listening(json.loads(two.quark("state", "hsrv").stdout)["pid"], 8080)
    two.quark("snapshot", "create", "hsrv")
    assert json.loads(two.quark("state", "hsrv").stdout)["status"] == "paused"
    before = counters(two.a)['tsor_connections_total{path="tcp"}']
    r = two.run("quark", "hcli", two.bundle("hcli", ["sh", "-c",
                f"busybox wget -q -O /out/hcli.txt http://{pod_s.ip}:8080/hostname"], pod_c), timeout=60)
    assert r.returncode == 0, r.stderr
    with open("/etc/hostname") as f, open(two.out("hcli.txt")) as g:
        assert g.read() == f.read()
    assert counters(two.a)['tsor_connections_total{path="tcp"}'] == before + 1
    assert json.loads(two.quark("state", "hsrv").stdout)["status"] == "running"
    two.stop("quark", "hsrv")
