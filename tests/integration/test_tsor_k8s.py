"""Routes from Kubernetes, end to end: real quark pods on two testbed nodes whose tsords take their
routes from the API stand-in (tests/support/fake_kube_api.py, served inside node a's network
namespace). A client connects to a Service ClusterIP that exists only in the stand-in (an address of
the testbed's own 10.<octet>/16 range that no interface holds: no kube-proxy here, so only TSoR can
carry it); the connection reaches the server pod over the local path (same node) or the tcp path
(the other node), and the client's getpeername() answers the ClusterIP:port it dialled."""
from __future__ import annotations

import json
import os

import pytest

from tests.integration.conftest import needs_root
from tests.integration.test_tsor import needs_tsor_in_qkernel
from tests.support import fake_kube_api as k8s
from tests.support.testbed import local_connections, wait_file
from tsor.metrics import fetch, parse

OCTET = 231
CLUSTER_IP = f"10.{OCTET}.250.10"

SERVER = """
import json, socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 8080)); s.listen(8)
open("/out/k8s-server-ready", "w").close()
c, peer = s.accept()
data = c.recv(64)
c.sendall(b"echo:" + data)
json.dump({"local": c.getsockname()[:2], "peer": c.getpeername()[:2]}, open("/out/k8s-server.json", "w"))
c.close()
"""

CLIENT = f"""
import json, socket
c = socket.create_connection(("{CLUSTER_IP}", 80), timeout=20)
peer = c.getpeername()[:2]
c.sendall(b"ping")
answer = c.recv(64)
json.dump({{"peer": peer, "local": c.getsockname()[:2], "answer": answer.decode(),
           "family": c.family == socket.AF_INET}}, open("/out/k8s-client.json", "w"))
"""


@pytest.fixture(scope="module")
def bed():
    needs_root()
    needs_tsor_in_qkernel()
    from tests.support.testbed import Testbed
    from tsor.kernel_sockets import socket_at
    b = Testbed(prefix="qk15c", octet=OCTET)
    api = None
    try:
        a, bn = b.node("a"), b.node("b")
        b.link(a, bn)
        # the stand-in listens in node a's namespace: its tsord reaches it on loopback, node b's
        # tsord over the link
        listener = socket_at(f"/var/run/netns/{a.netns}")
        listener.bind(("0.0.0.0", 0))
        listener.listen(16)
        api = k8s.FakeKubeAPI(listener)
        for n in (a, bn):   # InternalIP: the node's link address, where its tsord listens
            api.put("nodes", k8s.node(n.name, n.address, [n.subnet]))
        b.api, b.node_a, b.node_b = api, a, bn
        yield b
    finally:
        if api is not None:
            api.stop()
        b.close()


def start_tsords(bed) -> None:
    if bed.node_a.tsord is None:
        port = bed.api.port
        bed.node_a.start_tsord(kubeconfig=k8s.write_kubeconfig(os.path.join(bed.dir, "kc-a"), f"http://127.0.0.1:{port}"))
        bed.node_b.start_tsord(kubeconfig=k8s.write_kubeconfig(os.path.join(bed.dir, "kc-b"),
                                                               f"http://{bed.node_a.address}:{port}"))
        for n in (bed.node_a, bed.node_b):
            wait_file(n.metrics)


def serve_and_dial(bed, tag: str, srv, cli, cluster_ip: str) -> tuple[dict, dict]:
    """The echo server in a quark pod `srv`, the client in `cli` dialling cluster_ip:80."""
    bed.start("quark", f"{tag}-srv", bed.bundle(f"{tag}-srv", ["python3", "-c", SERVER.replace("k8s-", f"{tag}-")],
                                               srv))
    wait_file(bed.out(f"{tag}-server-ready"))
    client = CLIENT.replace("k8s-", f"{tag}-").replace(CLUSTER_IP, cluster_ip)
    r = bed.run("quark", f"{tag}-cli", bed.bundle(f"{tag}-cli", ["python3", "-c", client], cli))
    assert r.returncode == 0, r.stderr + srv.node.log()[-3000:] + cli.node.log()[-3000:]
    wait_file(bed.out(f"{tag}-server.json"))
    with open(bed.out(f"{tag}-client.json")) as f, open(bed.out(f"{tag}-server.json")) as g:
        return json.load(f), json.load(g)


def test_a_service_clusterip_reaches_a_quark_pod_over_the_local_path(bed):
    node, api = bed.node_a, bed.api
    srv, cli = node.pod("srv"), node.pod("cli")
    for p in (srv, cli):
        api.put("pods", k8s.pod(p.name, [p.ip], "a"))
    api.put("services", k8s.service("web", CLUSTER_IP, [("http", 80, 8080)]))
    api.put("endpointslices", k8s.endpoint_slice("web-1", "web", [(srv.ip, True, "a")], [("http", 8080)]))
    start_tsords(bed)
    before = local_connections(node)
    client, server = serve_and_dial(bed, "loc", srv, cli, CLUSTER_IP)
    assert client["answer"] == "echo:ping"
    assert client["peer"] == [CLUSTER_IP, 80]           # what the application dialled
    assert server["local"] == [srv.ip, 8080]             # the endpoint, as after kube-proxy's DNAT
    assert server["peer"] == client["local"] and client["local"][0] == cli.ip
    assert local_connections(node) == before + 1         # tsord's counter: the local path
    assert f"{CLUSTER_IP}:80 ({srv.ip}:8080): local" in node.log()


def test_a_service_clusterip_reaches_a_quark_pod_on_another_node_over_the_tcp_path(bed):
    api, a, bn = bed.api, bed.node_a, bed.node_b
    srv, cli = a.pod("srv2"), bn.pod("cli2")
    api.put("pods", k8s.pod(srv.name, [srv.ip], "a"))
    api.put("pods", k8s.pod(cli.name, [cli.ip], "b"))
    cluster_ip = f"10.{OCTET}.250.11"
    api.put("services", k8s.service("web2", cluster_ip, [(None, 80, 8080)]))
    api.put("endpointslices", k8s.endpoint_slice("web2-1", "web2", [(srv.ip, True, "a")], [(None, 8080)]))
    start_tsords(bed)
    tcp = 'tsor_connections_total{path="tcp"}'
    before = parse(fetch(bn.metrics)).get(tcp, 0.0)
    client, server = serve_and_dial(bed, "rem", srv, cli, cluster_ip)
    assert client["answer"] == "echo:ping" and client["peer"] == [cluster_ip, 80]
    assert server["local"] == [srv.ip, 8080] and server["peer"] == client["local"]
    assert parse(fetch(bn.metrics)).get(tcp, 0.0) == before + 1
    assert f"{cluster_ip}:80 ({srv.ip}:8080): tcp" in bn.log()
