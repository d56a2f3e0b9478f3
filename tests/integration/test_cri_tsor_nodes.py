"""TSoR through CRI across two nodes: a quark pod on node a reaches a quark pod on node b over the
tcp path (tsord to tsord), with every pod started by a real containerd through CRI.

Two "nodes" are network namespaces joined by a veth (tests/support/testbed.py: routes to each
other's pod subnet, each node with its own tsord listening on its link address, routes from the
testbed's file, transport tcp). Each node has a containerd of its own (tests/integration/cri_env.py)
running inside the node's network namespace (`nsenter --net`; the mount namespace stays the host's,
so the pods' netns files are seen by the node's tsord): the bridge plugin it runs makes the node's
bridge and the pods' veths in there, on the node's pod subnet, and quark-cni registers the pods with
that node's tsord (`failOpen: false`). Two containerds rather than one: a pod's network is wired by
the containerd that runs it, so one containerd cannot put pods behind two nodes' bridges. What proves
the path is tsord's own counters: tsor_connections_total{path="tcp"} on node a,
tsor_incoming_total{path="tcp"} on node b and tsor_bytes_total{path="tcp"} on both.
"""
from __future__ import annotations

import ipaddress
import subprocess

import pytest

try:
    from tests.integration import cri_env
except ImportError:  # pytest put tests/integration itself on sys.path
    import cri_env

PREFIX, OCTET = "qw15i", 225      # netns, bridge and link names and 10.OCTET.0.0/16: this file's own
BLOB_KIB = 1024                   # the payload: large enough that the byte counters cannot miss it


SKIP = cri_env.tsor_skip_reason()
pytestmark = [pytest.mark.root, pytest.mark.timeout(600), pytest.mark.skipif(SKIP is not None, reason=SKIP or "")]

if SKIP is None:
    from tests.integration.test_cri import IMAGE, CheckedCri, wait_for
    from tests.integration.test_cri_tsor import run_script
    from tests.support import testbed
    from tsor import SOCKET_ANNOTATION
    from tsor.metrics import fetch, parse


@pytest.fixture(scope="module")
def nodes():
    """(node a, node b, containerd of a, containerd of b); all removed on leaving."""
    bed = testbed.Testbed(prefix=PREFIX, octet=OCTET)
    cds: list = []
    try:
        a, b = bed.node("a"), bed.node("b")
        bed.link(a, b)
        for n in (a, b):
            n.start_tsord(transport="tcp")
            d = cri_env.CriContainerd(quark_cni_conf={"failOpen": False, "tsorSocket": n.socket},
                                      bridge=f"{PREFIX}br{n.index}", subnet=n.subnet, netns=n.netns)
            cds.append(d)
            d.start()
            d.import_images()
        yield a, b, cds[0], cds[1]
    finally:
        for d in cds:
            d.close()     # its pods first, through CRI, while the node's tsord still runs
        for n in bed.nodes:
            print(f"--- tsord {n.name}\n{n.log()[-3000:]}")   # shown when a test fails
        bed.close()


def counters(node) -> dict[str, float]:
    return parse(fetch(node.metrics))


def quark_pod(cri, node, name: str):
    """RunPodSandbox (handler quark) told of its node's tsord: (pod id, config, pod IP)."""
    pod, config = cri.run_pod(name, "quark", annotations={SOCKET_ANNOTATION: node.socket})
    return pod, config, cri.pod_status(pod).status.network.ip


def test_a_quark_pod_reaches_a_quark_pod_on_another_node_over_the_tcp_path(nodes):
    a, b, cd_a, cd_b = nodes
    with CheckedCri(cd_a) as cri_a, CheckedCri(cd_b) as cri_b:
        srv, srv_conf, srv_ip = quark_pod(cri_b, b, "far-srv")
        cli, cli_conf, cli_ip = quark_pod(cri_a, a, "near-cli")
        # each pod behind its own node's bridge: its address from that node's subnet, its veth
        # enslaved to the bridge inside that node's namespace (the host has no such bridge)
        for node, ip in ((b, srv_ip), (a, cli_ip)):
            assert ipaddress.ip_address(ip) in ipaddress.ip_network(node.subnet), (node.name, ip)
            ports = subprocess.run(["ip", "-n", node.netns, "-o", "link", "show", "master", f"{PREFIX}br{node.index}"],
                                   capture_output=True, text=True, check=True).stdout
            assert "veth" in ports, ports
        assert subprocess.run(["ip", "link", "show", f"{PREFIX}br1"], capture_output=True).returncode != 0

        srv_cid = cri_b.create_container(srv, srv_conf, "srv", IMAGE, ["sh", "-c", (
            f"mkdir -p /www && dd if=/dev/urandom of=/www/blob bs=1024 count={BLOB_KIB} 2>/dev/null && "
            "exec httpd -f -p 8080 -h /www")])
        cri_b.start_container(srv_cid)
        wait_for("the server's httpd", lambda: cri_b.exec_sync(
            srv_cid, ["sh", "-c", "netstat -ltn | grep -q :8080"]).exit_code == 0, timeout=60)
        want = cri_b.exec_sync(srv_cid, ["md5sum", "/www/blob"]).stdout.split()[0].decode()

        tcp = 'tsor_connections_total{path="tcp"}'
        incoming = 'tsor_incoming_total{path="tcp"}'
        received = 'tsor_bytes_total{direction="received",path="tcp"}'
        sent = 'tsor_bytes_total{direction="sent",path="tcp"}'
        before_a, before_b = counters(a), counters(b)
        code, out = run_script(cri_a, cli, cli_conf, "cli",
                               f"wget -qO /tmp/blob http://{srv_ip}:8080/blob && md5sum /tmp/blob")
        assert code == 0 and out.split()[0] == want, out + a.log()[-3000:]

        after_a = counters(a)
        assert after_a.get(tcp, 0.0) == before_a.get(tcp, 0.0) + 1, a.log()[-3000:]
        assert after_a.get('tsor_connections_total{path="local"}', 0.0) == \
            before_a.get('tsor_connections_total{path="local"}', 0.0)
        assert f"{srv_ip}:8080: tcp" in a.log()
        assert counters(b).get(incoming, 0.0) == before_b.get(incoming, 0.0) + 1, b.log()[-3000:]
        # the payload crossed on the tcp path: node a's pods received it, node b's sent it (the
        # kernel's TCP_INFO of the sockets tsord handed out; final counts arrive as the sockets go)
        size = BLOB_KIB * 1024
        wait_for("node a's tcp-path bytes", lambda: counters(a).get(received, 0.0) - before_a.get(received, 0) >= size)
        wait_for("node b's tcp-path bytes", lambda: counters(b).get(sent, 0.0) - before_b.get(sent, 0) >= size)

        for pod, cri in ((cli, cri_a), (srv, cri_b)):
            cri.teardown_pod(pod)
        # quark-cni's DEL: each node's tsord has let its pod go
        assert counters(a)["tsor_pods"] == 0 and counters(b)["tsor_pods"] == 0

