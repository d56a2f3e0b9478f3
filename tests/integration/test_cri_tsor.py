"""TSoR through CRI: quark pods run by the real containerd (tests/integration/cri_env.py) talk over
TSoR's local path, and quark-cni registers them with the node's tsord.

The test runs a tsord of its own (socket, metrics socket and state_dir under its tmp dir, host
network namespace, as a node's) and a containerd whose conflist chains quark-cni after bridge +
host-local with `failOpen: false` and `tsorSocket` naming that tsord, so a pod starts only once
tsord holds its registration. The pods carry the annotation `io.quark.tsor.socket` (it reaches the
bundle through the quark handler's pod_annotations), so their sandboxes register with that tsord
too. What proves the path is tsord's own counter, `tsor_connections_total{path="local"}`; without
the annotation the same connection is plain TCP and the counter stays where it was. With routes from
Kubernetes (the API stand-in, tests/support/fake_kube_api.py) a client dials a Service ClusterIP
that only the stand-in knows (no kube-proxy here): only TSoR can carry it, over the local path.
NetworkPolicy through CRI: the stand-in holds a policy denying the client's ingress to the server,
and the test installs the node's enforcement of it (no policy agent runs here: an iptables REJECT in
the server pod's netns); the quark pod's connection goes native (tsor_policy_native_total{verdict=
"deny"}) and fails exactly as a runc pod's does; once the policy allows it, the local path; a policy
tsord cannot decide (an ipBlock covering a pod address) leaves it native ({verdict="unknown"}).
With tsor.yaml's `local_path: sockmap` nothing is trapped: the server pod's eth0 counters show the
bytes of a quark pod's connection skipped it while a runc pod's crossed it. Two nodes through CRI:
test_cri_tsor_nodes.py.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

try:
    from tests.integration import cri_env
except ImportError:  # pytest put tests/integration itself on sys.path
    import cri_env

NODE = "w15g-node"                  # tsord's node name, and the pods' nodeName in the API stand-in
# a ClusterIP no interface holds, inside the pods' own subnet (host-local hands out addresses from the
# bottom; a test makes a handful): should TSoR not carry it, the connect dies on the bridge's ARP
# instead of leaving the host
CLUSTER_IP = "10.215.15.250"
LOCAL = 'tsor_connections_total{path="local"}'


SKIP = cri_env.tsor_skip_reason()
pytestmark = [pytest.mark.root, pytest.mark.timeout(900), pytest.mark.skipif(SKIP is not None, reason=SKIP or "")]

if SKIP is None:
    from tests.integration.test_cri import IMAGE, CheckedCri, log_text, start_httpd, wait_for
    from tests.support import fake_kube_api as k8s
    from tests.support.cri import cri_v1_pb2 as pb
    from tsor import SOCKET_ANNOTATION


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tsor")


@pytest.fixture(scope="module")
def cd(base):
    # quark-cni fails closed here: a pod starts only once this test's tsord holds its registration
    with cri_env.running(quark_cni_conf={"failOpen": False, "tsorSocket": str(base / "tsord.sock")}) as d:
        yield d


@pytest.fixture
def tsord(base):
    t = cri_env.Tsord(base, NODE)
    try:
        yield t
    finally:
        t.stop()
        print(t.log()[-4000:])   # shown when the test fails


@pytest.fixture
def cri(cd, tsord):
    with CheckedCri(cd) as c:
        yield c
        c.remove_all_pods()   # while tsord still runs: quark-cni's DEL deregisters


def tsor_pod(cri, name: str, annotate_socket: str | None) -> tuple[str, pb.PodSandboxConfig, str]:
    """RunPodSandbox (handler quark), with the annotation naming `annotate_socket` when given:
    (pod id, config, pod IP)."""
    annotations = {SOCKET_ANNOTATION: annotate_socket} if annotate_socket else {}
    pod, config = cri.run_pod(name, "quark", annotations=annotations)
    return pod, config, cri.pod_status(pod).status.network.ip


def run_script(cri, pod: str, config, name: str, script: str) -> tuple[int, str]:
    """A container in `pod` running `sh -c script` to its end: (exit code, its log's text)."""
    cid = cri.create_container(pod, config, name, IMAGE, ["sh", "-c", script])
    cri.start_container(cid)
    st = wait_for(f"{name} to exit", lambda: (lambda s: s if s.state == pb.CONTAINER_EXITED else None)(
        cri.container_status(cid)), timeout=120)
    return st.exit_code, log_text(config, name)


def run_client(cri, pod: str, config, name: str, urls: list[str]) -> str:
    """A container in `pod` that fetches each URL once (busybox wget) and exits: its log."""
    code, out = run_script(cri, pod, config, name, "; ".join(f"wget -qO- {u} || echo FAILED-{u}" for u in urls))
    assert code == 0, out
    return out


def routes_synced(m: dict[str, float]) -> bool:
    """tsord's route source has listed every kind and holds both pods and the Service."""
    synced = [v for k, v in m.items() if k.startswith("tsor_route_source_synced")]
    return m.get("tsor_route_pods") == 2 and m.get("tsor_route_services", 0) >= 1 and bool(synced) and all(synced)


def test_two_quark_pods_use_the_local_path_and_quark_cni_registers_them(cd, tsord, cri):
    tsord.start()
    before = tsord.counters()
    srv, srv_conf, srv_ip = tsor_pod(cri, "tsor-srv", tsord.socket)
    cli, cli_conf, cli_ip = tsor_pod(cri, "tsor-cli", tsord.socket)
    # quark-cni's ADD: each pod by its sandbox id, netns, CRI's pod IP, and its name/namespace/uid
    # from CNI_ARGS, checked by tsord against the kernel
    pods = tsord.registered()
    for pod, conf, ip in ((srv, srv_conf, srv_ip), (cli, cli_conf, cli_ip)):
        assert pod in pods, f"{conf.metadata.name} not registered: {pods}"
        reg = pods[pod]
        assert (reg["name"], reg["namespace"], reg["uid"], reg["ips"]) == \
            (conf.metadata.name, "default", conf.metadata.uid, [ip]), reg
        assert reg["netns"].startswith("/var/run/netns/cni-") and reg["ifname"] == "eth0", reg
    assert tsord.counters()["tsor_pods"] == before["tsor_pods"] + 2

    start_httpd(cri, srv, srv_conf, "srv")
    n = 3
    out = run_client(cri, cli, cli_conf, "cli", [f"http://{srv_ip}:8080/"] * n)
    assert out == "hello-srv\n" * n, out
    after = tsord.counters()
    # every connection took the local path (an AF_UNIX pair tsord handed out), none went native
    assert after.get(LOCAL, 0.0) == before.get(LOCAL, 0.0) + n, tsord.log()[-3000:]
    assert f"{srv_ip}:8080: local" in tsord.log()

    # quark-cni's DEL at StopPodSandbox/RemovePodSandbox: the registrations go with the pods
    for pod in (srv, cli):
        cri.teardown_pod(pod)
    assert not {srv, cli} & set(tsord.registered())
    assert tsord.counters()["tsor_pods"] == before["tsor_pods"]


def test_without_the_socket_annotation_pods_talk_plain_tcp(cd, tsord, cri):
    # the control: the same pods and connections, but their sandboxes are not told of this tsord
    # (no tsord at the default socket either), so the connection is native TCP over the bridge;
    # quark-cni registers the pods all the same: the conflist, not the pod, decides that
    tsord.start()
    before = tsord.counters()
    srv, srv_conf, srv_ip = tsor_pod(cri, "plain-srv", None)
    cli, cli_conf, _ = tsor_pod(cri, "plain-cli", None)
    assert {srv, cli} <= set(tsord.registered())
    start_httpd(cri, srv, srv_conf, "srv")
    assert run_client(cri, cli, cli_conf, "cli", [f"http://{srv_ip}:8080/"]) == "hello-srv\n"
    after = tsord.counters()
    assert after.get(LOCAL, 0.0) == before.get(LOCAL, 0.0)
    assert after["tsor_sandboxes"] == 0


def test_a_service_clusterip_reaches_a_quark_pod_over_the_local_path(cd, tsord, cri, base):
    api = k8s.FakeKubeAPI()
    try:
        api.put("nodes", k8s.node(NODE, "10.215.15.1", [cri_env.SUBNET]))
        tsord.start(kubeconfig=api.kubeconfig(str(base / "kubeconfig")))   # before the pods: quark-cni fails closed
        srv, srv_conf, srv_ip = tsor_pod(cri, "web-0", tsord.socket)
        cli, cli_conf, cli_ip = tsor_pod(cri, "shop-0", tsord.socket)
        # what the API server would hold for these pods on this node: runtimeClassName quark, their
        # CRI addresses, and a Service selecting the server with its EndpointSlice
        api.put("pods", k8s.pod("web-0", [srv_ip], NODE, labels={"app": "web"}))
        api.put("pods", k8s.pod("shop-0", [cli_ip], NODE, labels={"app": "shop"}))
        api.put("services", k8s.service("web", CLUSTER_IP, [("http", 80, 8080)]))
        api.put("endpointslices", k8s.endpoint_slice("web-1", "web", [(srv_ip, True, NODE)], [("http", 8080)]))
        wait_for("tsord's routes from the API stand-in", lambda: routes_synced(tsord.counters()), timeout=120)
        start_httpd(cri, srv, srv_conf, "web")
        before = tsord.counters().get(LOCAL, 0.0)
        out = run_client(cri, cli, cli_conf, "shop", [f"http://{CLUSTER_IP}:80/"])
        assert out == "hello-web\n", out + tsord.log()[-3000:]
        assert tsord.counters().get(LOCAL, 0.0) == before + 1
        assert f"{CLUSTER_IP}:80 ({srv_ip}:8080): local" in tsord.log()
    finally:
        api.stop()


def refuse_in_pod(netns: str, sources: list[str], port: int, undo: bool = False) -> None:
    """The node's enforcement of a denying NetworkPolicy, as a policy agent would install it (none
    runs here): in the destination pod's network namespace, TCP to `port` from `sources` is
    refused (REJECT with a reset: the client fails at once instead of timing out)."""
    for src in sources:
        subprocess.run(["nsenter", f"--net={netns}", "iptables", "-D" if undo else "-I", "INPUT", "-p", "tcp",
                        "-s", src, "--dport", str(port), "-j", "REJECT", "--reject-with", "tcp-reset"],
                       check=not undo, capture_output=True)


def test_network_policy_through_cri_deny_goes_native_where_the_node_refuses_it_allow_local_undecided_native(
        cd, tsord, cri, base):
    from kubernetes.client import (V1IPBlock, V1LabelSelector, V1NetworkPolicyIngressRule, V1NetworkPolicyPeer,
                                   V1NetworkPolicySpec)

    def policy(allowed_app: str) -> dict:
        """Ingress of app=web allowed only from pods labelled app=`allowed_app`."""
        return k8s.network_policy("web-ingress", V1NetworkPolicySpec(
            pod_selector=V1LabelSelector(match_labels={"app": "web"}), policy_types=["Ingress"],
            ingress=[V1NetworkPolicyIngressRule(
                _from=[V1NetworkPolicyPeer(pod_selector=V1LabelSelector(match_labels={"app": allowed_app}))])]))

    def policy_events() -> float:
        return tsord.counters().get('tsor_route_source_events_total{kind="networkpolicies"}', 0.0)

    api = k8s.FakeKubeAPI()
    srv_netns, refused = None, []
    try:
        api.put("nodes", k8s.node(NODE, "10.215.15.1", [cri_env.SUBNET]))
        api.put("namespaces", k8s.namespace("default"))
        api.put("networkpolicies", policy("frontend"))    # denies the shop pods below
        tsord.start(kubeconfig=api.kubeconfig(str(base / "kubeconfig")))
        srv, srv_conf, srv_ip = tsor_pod(cri, "web-0", tsord.socket)
        cli, cli_conf, cli_ip = tsor_pod(cri, "shop-0", tsord.socket)
        ref, ref_conf = cri.run_pod("shop-1", "runc")     # the reference: the same client under runc
        ref_ip = cri.pod_status(ref).status.network.ip
        api.put("pods", k8s.pod("web-0", [srv_ip], NODE, labels={"app": "web"}))
        api.put("pods", k8s.pod("shop-0", [cli_ip], NODE, labels={"app": "shop"}))
        api.put("pods", k8s.pod("shop-1", [ref_ip], NODE, labels={"app": "shop"}, runtime_class=None))

        def synced() -> bool:
            m = tsord.counters()
            flags = [v for k, v in m.items() if k.startswith("tsor_route_source_synced")]
            return m.get("tsor_route_pods") == 2 and len(flags) >= 6 and all(flags)
        wait_for("tsord's routes and policies from the API stand-in", synced, timeout=120)
        start_httpd(cri, srv, srv_conf, "web")
        srv_netns = tsord.registered()[srv]["netns"]
        refused = [cli_ip, ref_ip]
        refuse_in_pod(srv_netns, refused, 8080)

        # denied: the quark pod's connection is not carried by TSoR (which would pass the node's
        # enforcement by): it goes native and meets the refusal exactly as the runc pod does
        before = tsord.counters()
        script = f"wget -qO- http://{srv_ip}:8080/ 2>&1; echo exit=$?"
        q_code, q_out = run_script(cri, cli, cli_conf, "denied", script)
        r_code, r_out = run_script(cri, ref, ref_conf, "denied", script)
        assert "Connection refused" in r_out and "exit=1" in r_out, r_out
        assert (q_code, q_out) == (r_code, r_out), (q_out, r_out, tsord.log()[-3000:])
        after = tsord.counters()
        assert after.get(LOCAL, 0.0) == before.get(LOCAL, 0.0)
        deny = 'tsor_policy_native_total{verdict="deny"}'
        assert after.get(deny, 0.0) == before.get(deny, 0.0) + 1, tsord.log()[-3000:]
        assert f"{srv_ip}:8080 native: deny" in tsord.log()

        # allowed: the policy now admits app=shop, and the node's enforcement follows it; the same
        # connection takes the local path
        seen = policy_events()
        api.put("networkpolicies", policy("shop"))
        wait_for("tsord to see the allowing policy", lambda: policy_events() > seen, timeout=60)
        refuse_in_pod(srv_netns, refused, 8080, undo=True)
        refused = []
        before = tsord.counters()
        assert run_client(cri, cli, cli_conf, "allowed", [f"http://{srv_ip}:8080/"]) == "hello-web\n"
        after = tsord.counters()
        assert after.get(LOCAL, 0.0) == before.get(LOCAL, 0.0) + 1, tsord.log()[-3000:]
        assert after.get(deny, 0.0) == before.get(deny, 0.0)

        # cannot decide: an ipBlock covering the client's pod address (whether such a block applies
        # to pod traffic is each network implementation's choice): native, and here nothing refuses it
        seen = policy_events()
        api.put("networkpolicies", k8s.network_policy("web-ingress", V1NetworkPolicySpec(
            pod_selector=V1LabelSelector(match_labels={"app": "web"}), policy_types=["Ingress"],
            ingress=[V1NetworkPolicyIngressRule(_from=[V1NetworkPolicyPeer(
                ip_block=V1IPBlock(cidr=cri_env.SUBNET))])])))
        wait_for("tsord to see the ipBlock policy", lambda: policy_events() > seen, timeout=60)
        before = tsord.counters()
        assert run_client(cri, cli, cli_conf, "undecided", [f"http://{srv_ip}:8080/"]) == "hello-web\n"
        after = tsord.counters()
        unknown = 'tsor_policy_native_total{verdict="unknown"}'
        assert after.get(LOCAL, 0.0) == before.get(LOCAL, 0.0)
        assert after.get(unknown, 0.0) == before.get(unknown, 0.0) + 1, tsord.log()[-3000:]
    finally:
        if srv_netns and refused:
            refuse_in_pod(srv_netns, refused, 8080, undo=True)
        api.stop()


def test_sockmap_local_path_through_cri_quark_pods_skip_the_veth_runc_pods_and_refusals_take_the_stack(
        cd, tsord, cri):
    # tsor.yaml's local_path: sockmap, through CRI as kubelet drives it: between two quark pods
    # nothing is trapped (tsord's local counter stays) and a file's bytes arrive intact without
    # crossing the server pod's eth0 (busybox httpd listens on [::]: its end is an AF_INET6 socket
    # with IPv4-mapped addresses); a runc pod of the same conflist (quark-cni registered it too)
    # is not carried; and the node's refusal still decides a quark pod's connection
    from tests.support.testbed import eth0_bytes, sockmap_skip_reason
    if sockmap_skip_reason():
        pytest.skip(sockmap_skip_reason())
    size = 4 << 20
    tsord.start(local_path="sockmap")
    srv, srv_conf, srv_ip = tsor_pod(cri, "sm-srv", tsord.socket)
    cli, cli_conf, cli_ip = tsor_pod(cri, "sm-cli", tsord.socket)
    ref, ref_conf = cri.run_pod("sm-ref", "runc")
    assert {srv, cli, ref} <= set(tsord.registered())
    cid = cri.create_container(srv, srv_conf, "srv", IMAGE, [
        "sh", "-c", f"mkdir -p /www && head -c {size} /dev/urandom > /www/big && exec httpd -f -p 8080 -h /www"])
    cri.start_container(cid)
    wait_for("srv's httpd", lambda: cri.exec_sync(cid, ["sh", "-c", "netstat -ltn | grep -q :8080"]).exit_code == 0)
    want = cri.exec_sync(cid, ["md5sum", "/www/big"]).stdout.split()[0].decode()
    srv_netns = tsord.registered()[srv]["netns"]
    fetch = f"wget -qO- http://{srv_ip}:8080/big | md5sum; echo exit=$?"

    before, b0 = tsord.counters(), eth0_bytes(srv_netns)
    code, out = run_script(cri, cli, cli_conf, "quark-fetch", fetch)
    crossed = eth0_bytes(srv_netns) - b0
    assert (code, out.split()[0], out.split()[-1]) == (0, want, "exit=0"), out
    assert crossed < size // 16, f"{crossed} bytes crossed eth0 for a {size}-byte file\n{tsord.log()[-3000:]}"
    assert tsord.counters().get(LOCAL, 0.0) == before.get(LOCAL, 0.0)   # no connect was trapped

    b0 = eth0_bytes(srv_netns)
    code, out = run_script(cri, ref, ref_conf, "runc-fetch", fetch)
    assert (code, out.split()[0]) == (0, want), out
    assert eth0_bytes(srv_netns) - b0 >= size   # the runc pod's connection took the veth

    refuse_in_pod(srv_netns, [cli_ip], 8080)
    try:
        code, out = run_script(cri, cli, cli_conf, "refused", f"wget -qO- http://{srv_ip}:8080/big 2>&1; echo exit=$?")
    finally:
        refuse_in_pod(srv_netns, [cli_ip], 8080, undo=True)
    assert "Connection refused" in out and "exit=1" in out, out
