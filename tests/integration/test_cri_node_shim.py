"""Pods through containerd 1.6's CRI with one shim for the node (`shim: {scope: node}`).

Every quark pod of the containerd is served by the same shim process, and each pod behaves as with
a shim of its own: its containers run, exec, report their exit codes; removing one pod leaves the
others running; containerd restarted under them finds them all; once the last pod is gone the shim
goes and its socket with it. A node shim killed ends every container it served, as a pod's shim
killed ends its pod's, and leaves nothing behind (the pods' state, mounts and processes).
"""
from __future__ import annotations

import os
import signal
import time

import pytest

try:
    from tests.integration import cri_env
except ImportError:  # pytest put tests/integration itself on sys.path
    import cri_env

pytestmark = [pytest.mark.root, pytest.mark.timeout(600),
              pytest.mark.skipif(cri_env.skip_reason() is not None, reason=cri_env.skip_reason() or "")]

if cri_env.skip_reason() is None:
    from tests.integration.test_cri import IMAGE, wait_for
    from tests.support.cri import cri_v1_pb2 as pb
    from tests.support.cri.client import CriClient
    from tests.support.processes import alive


@pytest.fixture(scope="module")
def cd():
    with cri_env.running(with_quark_cni=False, quark_config="shim:\n  scope: node\n") as d:
        yield d


@pytest.fixture
def cri(cd):
    with CriClient(cd.address, cgroup_parent=cd.cgroup_parent, log_root=str(cd.log_dir)) as c:
        yield c
        c.remove_all_pods()


def bundle(cd, cid: str):
    return cd.state / "io.containerd.runtime.v2.task" / cri_env.NAMESPACE / cid


def shim_pid(cd, cid: str) -> int:
    return int((bundle(cd, cid) / "shim.pid").read_text())


def pod_with(cri, name: str, command: list[str]) -> tuple[str, str]:
    pod, config = cri.run_pod(name, "quark")
    cid = cri.create_container(pod, config, "main", IMAGE, command)
    cri.start_container(cid)
    return pod, cid


def test_pods_share_the_nodes_one_shim_and_each_behaves_as_on_its_own(cd, cri):
    a, ca = pod_with(cri, "node-a", ["sleep", "300"])
    b, cb = pod_with(cri, "node-b", ["sleep", "300"])
    c, cc = pod_with(cri, "node-c", ["sh", "-c", "exit 3"])
    pids = {shim_pid(cd, cid) for cid in (a, ca, b, cb, c, cc)}
    assert len(pids) == 1 and cd.shim_pids() == list(pids), (pids, cd.shim_pids())
    assert cri.exec_sync(ca, ["echo", "in-a"]).stdout == b"in-a\n"
    assert cri.exec_sync(cb, ["sh", "-c", "exit 7"]).exit_code == 7
    st = wait_for("c's exit", lambda: (lambda s: s if s.state == pb.CONTAINER_EXITED else None)(cri.container_status(cc)))
    assert st.exit_code == 3
    cri.teardown_pod(a)   # one pod gone: the others are served on
    assert cri.exec_sync(cb, ["echo", "in-b"]).stdout == b"in-b\n"
    assert cri.container_status(cb).state == pb.CONTAINER_RUNNING
    assert cd.shim_pids() == list(pids)


def test_containerd_restart_keeps_every_pod_on_the_nodes_shim(cd, cri):
    a, ca = pod_with(cri, "restart-a", ["sleep", "300"])
    b, cb = pod_with(cri, "restart-b", ["sleep", "300"])
    shim = shim_pid(cd, a)
    cd.restart()
    with CriClient(cd.address, cgroup_parent=cd.cgroup_parent, log_root=str(cd.log_dir)) as again:
        for pod, cid in ((a, ca), (b, cb)):
            assert again.pod_status(pod).status.state == pb.SANDBOX_READY
            assert again.exec_sync(cid, ["echo", "alive"]).stdout == b"alive\n"
    assert cd.shim_pids() == [shim]


def test_the_nodes_shim_goes_with_the_last_pod(cd, cri):
    pods = [pod_with(cri, f"last-{i}", ["sleep", "300"])[0] for i in range(2)]
    address = (bundle(cd, pods[0]) / "address").read_text()
    [shim] = cd.shim_pids()
    cri.teardown_pod(pods[0])
    time.sleep(2)
    assert cd.shim_pids() == [shim], "the node's shim went while a pod was left"
    cri.teardown_pod(pods[1])
    wait_for("the node's shim to exit", lambda: not cd.shim_pids())
    assert not os.path.exists(address.removeprefix("unix://"))
    again, cid = pod_with(cri, "after", ["sleep", "300"])   # the next pod gets a new one
    assert cri.exec_sync(cid, ["echo", "new"]).stdout == b"new\n"
    assert cd.shim_pids() == [shim_pid(cd, again)] != [shim]


def test_the_nodes_shim_killed_ends_every_container_it_served_and_leaves_nothing(cd, cri):
    served = [pod_with(cri, f"killed-{i}", ["sleep", "300"]) for i in range(2)]
    [shim] = cd.shim_pids()
    inits = [int((bundle(cd, cid) / "init.pid").read_text()) for pair in served for cid in pair]
    os.kill(shim, signal.SIGKILL)
    for pod, cid in served:
        wait_for(f"{cid[:12]} to be reported exited",
                 lambda cid=cid: cri.container_status(cid).state == pb.CONTAINER_EXITED)
        for gone in (pod, cid):
            wait_for(f"quark's state of {gone[:12]} to go",
                     lambda gone=gone: not (cd.state / "quark" / cri_env.NAMESPACE / gone).exists())
    wait_for("the containers' processes to end", lambda: not [p for p in inits if alive(p)])
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        assert not [line for line in f if any(cid in line for _, cid in served)]
