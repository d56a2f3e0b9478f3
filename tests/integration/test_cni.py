"""quark-cni chained after the real bridge and host-local plugins (Debian's containernetworking-plugins),
run as a runtime runs a conflist (tests/support/cni.py), with tsord checking each registration
against the pod's network namespace. The bridge lives in a network namespace of the test's own
("the node"); pods are namespaces the test makes and removes."""
from __future__ import annotations

import json
import os
import subprocess
import uuid

import pytest

from tests.integration.conftest import needs_root
from tests.support import cni
from tsor.config import Config
from tsor.daemon import Daemon

NODE = "qcni-node"
SUBNET = "10.213.0.0/24"
K8S = ("IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME={name};K8S_POD_INFRA_CONTAINER_ID={cid};"
       "K8S_POD_UID=uid-{name}")


def _skip_reason() -> str | None:
    if not os.path.exists(os.path.join(cni.SYSTEM_PLUGINS, "bridge")):
        return f"needs the CNI plugins in {cni.SYSTEM_PLUGINS} (apt containernetworking-plugins)"
    if not os.access(cni.quark_cni(), os.X_OK):
        return f"{cni.quark_cni()} is not installed (make install)"
    return None


pytestmark = [pytest.mark.root, pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")]


def netns_path(name: str) -> str:
    return f"/var/run/netns/{name}"


class Bed:
    def __init__(self, tmp) -> None:
        self.dir = tmp
        self.cni_path = cni.bin_dir(str(tmp / "bin"))
        self.pods: list[str] = []
        self.tsord: Daemon | None = None
        self.cfg = Config(node="qcni", socket=str(tmp / "tsord.sock"), state_dir=str(tmp / "state"))

    def conflist(self, **quark) -> dict:
        return {"cniVersion": "1.0.0", "name": "quarknet", "plugins": [
            {"type": "bridge", "bridge": "qcni0", "isGateway": True,
             "ipam": {"type": "host-local", "ranges": [[{"subnet": SUBNET}]], "dataDir": str(self.dir / "ipam")}},
            {"type": "quark-cni", "tsorSocket": self.cfg.socket, **quark}]}

    def chain(self, **quark) -> cni.Chain:
        return cni.Chain(self.conflist(**quark), self.cni_path, in_netns=NODE)

    def pod(self, name: str) -> tuple[str, str]:
        ns = f"qcni-{name}-{uuid.uuid4().hex[:6]}"
        subprocess.run(["ip", "netns", "add", ns], check=True)
        self.pods.append(ns)
        return f"sb-{name}", netns_path(ns)

    def start_tsord(self) -> Daemon:
        self.tsord = Daemon(self.cfg)
        self.tsord.start()
        return self.tsord

    def stop_tsord(self) -> None:
        if self.tsord is not None:
            self.tsord.stop()
            self.tsord = None

    def close(self) -> None:
        self.stop_tsord()
        for ns in self.pods:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.fixture
def bed(tmp_path):
    needs_root()
    subprocess.run(["ip", "netns", "add", NODE], check=True)
    b = Bed(tmp_path)
    try:
        b.start_tsord()
        yield b
    finally:
        b.close()
        subprocess.run(["ip", "netns", "del", NODE], capture_output=True)   # its bridge and veths go with it


def registered(bed: Bed) -> dict[str, dict]:
    with open(os.path.join(bed.cfg.state_dir, "pods.json")) as f:
        return {f"{p['sandbox']}/{p['ifname']}": p for p in json.load(f)["pods"]}


def test_add_registers_the_pod_and_passes_the_result_through(bed):
    cid, ns = bed.pod("cart")
    final, results = bed.chain().add(cid, ns, K8S.format(name="cart", cid=cid))
    assert final == results[0]   # bridge's result, unchanged
    ip = next(i["address"].split("/")[0] for i in final["ips"])
    pod = registered(bed)[f"{cid}/eth0"]
    assert (pod["name"], pod["namespace"], pod["uid"], pod["netns"]) == ("cart", "shop", "uid-cart", ns)
    assert pod["ips"] == [ip] and pod["netns_inode"] == os.stat(ns).st_ino
    assert all(rc == 0 for rc, _, _ in bed.chain().check(cid, ns, final))
    assert [rc for rc, _, _ in bed.chain().delete(cid, ns, final)] == [0, 0]
    assert registered(bed) == {} and len(bed.tsord.pods) == 0
    assert [rc for rc, _, _ in bed.chain().delete(cid, ns, final)] == [0, 0]   # DEL again: still success


def test_check_fails_for_a_pod_tsord_does_not_know(bed):
    cid, ns = bed.pod("ghost")
    final, _ = bed.chain().add(cid, ns)
    bed.tsord.pods.remove(f"{cid}/eth0")
    rc, out, _ = bed.chain().check(cid, ns, final)[1]
    assert rc == 1 and out["code"] == 100 and "not registered" in out["details"], out
    bed.chain().delete(cid, ns, final)


def test_addresses_that_are_not_the_pods_are_refused(bed):
    cid, ns = bed.pod("liar")
    forged = {"cniVersion": "1.0.0", "interfaces": [{"name": "eth0", "sandbox": ns}],
              "ips": [{"address": "10.213.0.77/24", "interface": 0}]}   # nothing configured it there
    conf = {**bed.conflist()["plugins"][1], "name": "quarknet", "cniVersion": "1.0.0", "prevResult": forged}
    rc, out, _ = cni.invoke(bed.cni_path, "ADD", conf, container=cid, netns=ns, in_netns=NODE)
    assert rc == 1 and out["code"] == 100 and "10.213.0.77" in out["details"], out
    assert len(bed.tsord.pods) == 0


def test_the_nodes_own_namespace_is_refused(bed):
    conf = {**bed.conflist()["plugins"][1], "name": "quarknet", "cniVersion": "1.0.0",
            "prevResult": {"cniVersion": "1.0.0", "ips": []}}
    own = f"/proc/{os.getpid()}/ns/net"   # tsord runs in this process, in the node's own namespace
    rc, out, _ = cni.invoke(bed.cni_path, "ADD", conf, container="host", netns=own)
    assert rc == 1 and out["code"] == 100 and "node's own" in out["details"], out


def test_registrations_survive_a_tsord_restart_less_pods_gone_meanwhile(bed):
    keep_cid, keep_ns = bed.pod("keep")
    gone_cid, gone_ns = bed.pod("gone")
    bed.chain().add(keep_cid, keep_ns)
    gone_result, _ = bed.chain().add(gone_cid, gone_ns)
    bed.stop_tsord()
    bed.chain().delete(gone_cid, gone_ns, gone_result)           # tsord down: DEL still succeeds
    subprocess.run(["ip", "netns", "del", os.path.basename(gone_ns)], check=True)
    d = bed.start_tsord()
    assert d.pods.get(f"{keep_cid}/eth0") is not None
    assert d.pods.get(f"{gone_cid}/eth0") is None                # its namespace went while tsord was down


def test_tsord_down_try_again_or_fail_open(bed):
    bed.stop_tsord()
    cid, ns = bed.pod("late")
    chain = bed.chain()
    prev, _ = cni.Chain({**bed.conflist(), "plugins": bed.conflist()["plugins"][:1]}, bed.cni_path, NODE).add(cid, ns)
    conf = {**bed.conflist()["plugins"][1], "name": "quarknet", "cniVersion": "1.0.0", "prevResult": prev}
    rc, out, _ = cni.invoke(bed.cni_path, "ADD", conf, container=cid, netns=ns, in_netns=NODE)
    assert rc == 1 and out["code"] == 11, out
    rc, out, err = cni.invoke(bed.cni_path, "ADD", {**conf, "failOpen": True}, container=cid, netns=ns,
                              in_netns=NODE)
    assert rc == 0 and out == prev and "without TSoR" in err
    chain.delete(cid, ns, prev)


def test_status_and_gc_speak_cni_1_1(bed):
    a_cid, a_ns = bed.pod("a")
    b_cid, b_ns = bed.pod("b")
    a_res, _ = bed.chain().add(a_cid, a_ns)
    b_res, _ = bed.chain().add(b_cid, b_ns)
    base = {"cniVersion": "1.1.0", "name": "quarknet", "type": "quark-cni", "tsorSocket": bed.cfg.socket}
    assert cni.invoke(bed.cni_path, "STATUS", base)[:2] == (0, None)
    gc = {**base, "cni.dev/valid-attachments": [{"containerID": a_cid, "ifname": "eth0"}]}
    assert cni.invoke(bed.cni_path, "GC", gc)[:2] == (0, None)
    assert set(registered(bed)) == {f"{a_cid}/eth0"}
    bed.stop_tsord()
    rc, out, _ = cni.invoke(bed.cni_path, "STATUS", base)
    assert rc == 1 and out["code"] == 50
    for cid, ns, res in ((a_cid, a_ns, a_res), (b_cid, b_ns, b_res)):
        bed.chain().delete(cid, ns, res)
