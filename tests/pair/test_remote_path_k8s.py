"""The kernel-chosen remote path with routes from Kubernetes (the API stand-in,
tests/support/fake_kube_api.py, served on guest a's wire address): node a's tsord learns the nodes,
the quark pods, a Service and NetworkPolicies from it; node b is guest b's (tests/pair/peer.py).
NetworkPolicy decides which of a pod's connects take the pump (egress policies of the client's
namespace, ingress policies of the server pod's, both decided by the client's node, which knows
every pod's policies); a denied one stays native, where the nodes' packet filters decide it (the
lane has none, so it succeeds there: what is checked is that it did not take the pump). A Service
with endpoints on both nodes is balanced at connect(), each connection then taking its endpoint's
path: the sockmap path to the pod on node a, the pump to the pod on node b."""
from __future__ import annotations

import json
import os
import socket

import pytest

from tests.pair import remote_node
from tests.pair.test_remote_path import counters
from tests.support import fake_kube_api as k8s
from tests.support.testbed import wait_file

CLUSTER_IP = f"10.{remote_node.OCTET}.250.10"
API_PORT = 7690

# a quark pod's client: one connect to warm tsord's verdict up (a connect with no verdict is native,
# and asks for one), then N connections to ip:port, each b"R" + 1 KiB and the server's report back
CLIENT = ("import hashlib, json, os, socket, sys, time\n"
          "ip, port, n, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]\n"
          "socket.create_connection((ip, port), timeout=60).close(); time.sleep(1)\n"
          "got = []\n"
          "for _ in range(n):\n"
          " s = socket.create_connection((ip, port), timeout=60)\n"
          " ends = {'sock': s.getsockname(), 'peer': s.getpeername()}\n"
          " data = os.urandom(1024); s.sendall(b'R' + data); s.shutdown(socket.SHUT_WR)\n"
          " reply = b''\n"
          " while d := s.recv(1 << 16): reply += d\n"
          " got.append({**ends, 'sha': hashlib.sha256(data).hexdigest(), 'server': json.loads(reply)}); s.close()\n"
          "json.dump(got, open(out, 'w'))\n")


@pytest.fixture(scope="module")
def cluster(peer):
    from kubernetes.client import V1LabelSelector, V1NetworkPolicyIngressRule, V1NetworkPolicyPeer, V1NetworkPolicySpec
    self_wire, _ = remote_node.wire()
    listener = socket.create_server((self_wire, API_PORT))
    api = k8s.FakeKubeAPI(listener)
    a = None
    try:
        for name, k in sorted(remote_node.INDEX.items()):
            api.put("nodes", k8s.node(name, f"10.{remote_node.OCTET}.0.{k}", [f"10.{remote_node.OCTET}.{k}.0/24"]))
        api.put("namespaces", k8s.namespace("default"))
        # ingress of the server pod (app=srv) only from pods labelled role=ok
        api.put("networkpolicies", k8s.network_policy("srv-ingress", V1NetworkPolicySpec(
            pod_selector=V1LabelSelector(match_labels={"app": "srv"}), policy_types=["Ingress"],
            ingress=[V1NetworkPolicyIngressRule(
                _from=[V1NetworkPolicyPeer(pod_selector=V1LabelSelector(match_labels={"role": "ok"}))])])))
        # pods labelled role=walled may send nothing at all (egress, the client's side)
        api.put("networkpolicies", k8s.network_policy("walled-egress", V1NetworkPolicySpec(
            pod_selector=V1LabelSelector(match_labels={"role": "walled"}), policy_types=["Egress"], egress=[])))
        kubeconfig = k8s.write_kubeconfig(os.path.join(os.environ["QUARK_PAIR_DIR"], "kubeconfig-a"),
                                          f"http://{self_wire}:{API_PORT}")
        a = remote_node.PairNode("a", *remote_node.wire(), kubeconfig=kubeconfig)
        server_ip = remote_node.wait_for_b_pod()
        api.put("pods", k8s.pod("srv", [server_ip], "b", labels={"app": "srv"}))
        remote_node.wait_for_b(a)
        yield a, api, server_ip
    finally:
        if a is not None:
            a.close()
        api.stop()


def run_client(a, api, name: str, labels: dict, dst: tuple[str, int], n: int) -> list[dict]:
    pod = a.node.pod(name)
    api.put("pods", k8s.pod(name, [pod.ip], "a", labels=labels))
    r = a.bed.run("quark", name, a.bed.bundle(name, ["python3", "-c", CLIENT, dst[0], str(dst[1]), str(n),
                                                     f"/out/{name}.json"], pod))
    assert r.returncode == 0, r.stderr
    with open(a.out(f"{name}.json")) as f:
        got = json.load(f)
    for c in got:   # every byte, and the real addresses, whichever path it took
        assert c["server"]["sha"] == c["sha"] and tuple(c["server"]["accept"]) == tuple(c["sock"]), c
        assert c["sock"][0] == pod.ip
    return got


def pumped(a) -> float:
    return counters(a.node)["tsor_remote_path_accepted"]


@pytest.mark.parametrize("labels, carried", [({"role": "ok"}, True),         # allowed both ways: the pump
                                             ({"role": "other"}, False),      # the server's ingress denies
                                             ({"role": "walled"}, False)])    # the client's egress denies
def test_networkpolicy_decides_which_connects_take_the_pump(cluster, labels, carried):
    a, api, server_ip = cluster
    before = pumped(a)
    got = run_client(a, api, f"np-{labels['role']}", labels, (server_ip, remote_node.SERVER_PORT), 3)
    assert all(tuple(c["peer"]) == (server_ip, remote_node.SERVER_PORT) for c in got)
    assert pumped(a) - before == (3 if carried else 0)


def test_a_service_with_endpoints_on_both_nodes_is_balanced_and_each_takes_its_endpoints_path(cluster):
    a, api, server_ip = cluster
    local = a.pod("loc", remote_node.SERVER)
    api.put("pods", k8s.pod("loc", [local.ip], "a", labels={"app": "loc"}))
    api.put("services", k8s.service("web", CLUSTER_IP, [("http", 80, remote_node.SERVER_PORT)]))
    api.put("endpointslices", k8s.endpoint_slice("web-1", "web", [(server_ip, True, "b"), (local.ip, True, "a")],
                                                 [("http", remote_node.SERVER_PORT)]))
    wait_file(a.out("server-ready"))
    before = pumped(a)
    got = run_client(a, api, "svc", {"role": "ok"}, (CLUSTER_IP, 80), 30)
    assert all(tuple(c["peer"]) == (CLUSTER_IP, 80) for c in got)       # what the application dialled
    reached = [c["server"]["sock"][0] for c in got]
    assert set(reached) == {server_ip, local.ip}, reached                  # random among both
    # those to node b's pod took the pump, but for the first of them if its verdict was not yet
    # there (the warm-up connect may have gone to the local endpoint)
    assert reached.count(server_ip) - 1 <= pumped(a) - before <= reached.count(server_ip)
