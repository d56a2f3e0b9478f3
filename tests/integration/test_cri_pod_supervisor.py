"""Pods through containerd 1.6's CRI with one supervisor per pod (`supervisor: {scope: pod}`, the default).

The pod's sandbox (pause) container's supervisor serves the pod's other containers: one supervisor
process per pod, however many containers, and each container behaves as with a supervisor of its
own (exec, exit codes, its own mount and pid namespaces, stop and remove, a container that exits
while the others run). The later containers' inits are reaped by the sandbox factory; their exit
statuses reach CRI from their pidfds. A container that needs capabilities the pod's supervisor does not hold gets
a supervisor of its own. Nothing is left behind when the pod goes.
"""
from __future__ import annotations

import json
import os

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
    from tests.support.processes import alive, wait_gone


@pytest.fixture(scope="module")
def cd():
    with cri_env.running(with_quark_cni=False, quark_config="supervisor:\n  scope: pod\n") as d:
        yield d


@pytest.fixture
def cri(cd):
    with CriClient(cd.address, cgroup_parent=cd.cgroup_parent, log_root=str(cd.log_dir)) as c:
        yield c
        c.remove_all_pods()


def state(cd, cid: str) -> dict:
    with open(cd.state / "quark" / cri_env.NAMESPACE / cid / "state.json") as f:
        return json.load(f)


def supervisor_of(cd, cid: str) -> int:
    return state(cd, cid)["supervisor_pid"]


def parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def factory_pid() -> int:
    from qvisor.factory import wire
    with open(os.path.join(os.environ["QUARK_FACTORY_DIR"], wire.PID_NAME)) as f:
        return int(f.read())


def test_a_pods_containers_share_its_one_supervisor_and_each_behaves_as_its_own(cd, cri):
    pod, config = cri.run_pod("one-sup", "quark")
    a = cri.create_container(pod, config, "a", IMAGE, ["sleep", "300"])
    cri.start_container(a)
    b = cri.create_container(pod, config, "b", IMAGE, ["sh", "-c", "echo $$ > /tmp/pid; sleep 300"])
    cri.start_container(b)
    c = cri.create_container(pod, config, "c", IMAGE, ["sh", "-c", "exit 5"])
    cri.start_container(c)
    sup = supervisor_of(cd, pod)
    assert {supervisor_of(cd, cid) for cid in (a, b, c)} == {sup}
    # the sandbox's init is the supervisor's child; the others' the sandbox factory's, which reaps them
    # (their statuses: from their pidfds, below)
    assert parent(state(cd, pod)["pid"]) == sup
    assert {parent(state(cd, cid)["pid"]) for cid in (a, b)} == {factory_pid()}
    assert cri.exec_sync(a, ["echo", "in-a"]).stdout == b"in-a\n"
    assert cri.exec_sync(b, ["sh", "-c", "exit 7"]).exit_code == 7
    # each container keeps its own mount and pid namespaces
    assert cri.exec_sync(b, ["cat", "/tmp/pid"]).stdout == b"1\n"
    assert cri.exec_sync(a, ["ls", "/tmp/pid"]).exit_code != 0
    st = wait_for("c's exit", lambda: (lambda s: s if s.state == pb.CONTAINER_EXITED else None)(cri.container_status(c)))
    assert st.exit_code == 5
    cri.call("StopContainer", pb.StopContainerRequest(container_id=a, timeout=2))
    st = cri.container_status(a)
    assert st.state == pb.CONTAINER_EXITED and st.exit_code == 137, st
    cri.call("RemoveContainer", pb.RemoveContainerRequest(container_id=a))
    assert cri.exec_sync(b, ["echo", "in-b"]).stdout == b"in-b\n"   # the others are served on
    assert alive(sup)
    cri.teardown_pod(pod)
    wait_gone(sup, 10)


def test_a_container_needing_more_capabilities_gets_a_supervisor_of_its_own(cd, cri):
    pod, config = cri.run_pod("own-sup", "quark")
    plain = cri.create_container(pod, config, "plain", IMAGE, ["sleep", "300"])
    admin = cri.create_container(pod, config, "admin", IMAGE, ["sleep", "300"], add_capabilities=["NET_ADMIN"])
    for cid in (plain, admin):
        cri.start_container(cid)
    assert supervisor_of(cd, plain) == supervisor_of(cd, pod)
    assert supervisor_of(cd, admin) != supervisor_of(cd, pod)
    assert cri.exec_sync(admin, ["echo", "ok"]).stdout == b"ok\n"
    cri.teardown_pod(pod)
