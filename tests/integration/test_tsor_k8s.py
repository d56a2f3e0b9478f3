"""Routes from Kubernetes, end to end: two real quark pods on one testbed node whose tsord takes its
routes from the API stand-in (tests/support/fake_kube_api.py, served inside the node's network
namespace). A client connects to a Service ClusterIP that exists only in the stand-in (an address of
the testbed's own 10.<octet>/16 range that no interface holds: no kube-proxy here, so only TSoR can
carry it); the connection reaches the server pod over the local path, and the client's getpeername()
answers the ClusterIP:port it dialled."""
from __future__ import annotations

import json
import os

import pytest

from tests.integration.conftest import needs_root
from tests.integration.test_tsor import needs_tsor_in_qkernel
from tests.support import fake_kube_api as k8s
from tests.support.testbed import local_connections, wait_file

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
    from tsor._sys import socket_in_netns
    b = Testbed(prefix="qk15c", octet=OCTET)
    api = None
    try:
        node = b.node("a")
        # the stand-in listens on the node's own loopback, where its tsord runs
        fd = os.open(f"/var/run/netns/{node.netns}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            listener = socket_in_netns(fd, 2)
        finally:
            os.close(fd)
        listener.setblocking(True)
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        api = k8s.FakeKubeAPI(listener)
        b.api, b.node_a = api, node
        yield b
    finally:
        if api is not None:
            api.stop()
        b.close()


def test_a_service_clusterip_reaches_a_quark_pod_over_the_local_path(bed):
    node, api = bed.node_a, bed.api
    srv, cli = node.pod("srv"), node.pod("cli")
    api.put("nodes", k8s.node("a", "10.0.0.1", [node.subnet]))
    for p in (srv, cli):
        api.put("pods", k8s.pod(p.name, [p.ip], "a"))
    api.put("services", k8s.service("web", CLUSTER_IP, [("http", 80, 8080)]))
    api.put("endpointslices", k8s.endpoint_slice("web-1", "web", [(srv.ip, True, "a")], [("http", 8080)]))
    node.start_tsord(kubeconfig=api.kubeconfig(os.path.join(bed.dir, "kubeconfig")))
    wait_file(node.metrics)
    before = local_connections(node)
    bed.start("quark", "k8s-srv", bed.bundle("k8s-srv", ["python3", "-c", SERVER], srv))
    wait_file(bed.out("k8s-server-ready"))
    r = bed.run("quark", "k8s-cli", bed.bundle("k8s-cli", ["python3", "-c", CLIENT], cli))
    assert r.returncode == 0, r.stderr + node.log()[-3000:]
    with open(bed.out("k8s-client.json")) as f:
        client = json.load(f)
    wait_file(bed.out("k8s-server.json"))
    with open(bed.out("k8s-server.json")) as f:
        server = json.load(f)
    assert client["answer"] == "echo:ping"
    assert client["peer"] == [CLUSTER_IP, 80]           # what the application dialled
    assert server["local"] == [srv.ip, 8080]             # the endpoint, as after kube-proxy's DNAT
    assert server["peer"] == client["local"] and client["local"][0] == cli.ip
    assert local_connections(node) == before + 1         # tsord's counter: the local path
    assert f"{CLUSTER_IP}:80 ({srv.ip}:8080): local" in node.log()
