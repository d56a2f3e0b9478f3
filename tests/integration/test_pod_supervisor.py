"""One supervisor per pod through quark's CLI (`supervisor: {scope: pod}`): the sandbox container's
supervisor serves the containers that name its pod; each behaves as with a supervisor of its own;
the sandbox container can go first; a failed create in the pod leaves nothing and the others are
served on; the pod's supervisor takes nothing from a confined process or from a user other than
root, and reads nothing of what such a caller sends.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from qlib import procfs
from qvisor import cgroups
from tests.integration.conftest import cgroup_dirs, edit_config
from tests.support.processes import alive, wait_gone

pytestmark = [pytest.mark.root, pytest.mark.timeout(300)]

@pytest.fixture(autouse=True)
def pod_scope(tmp_path, monkeypatch):
    config = tmp_path / "config.yaml"
    config.write_text("supervisor:\n  scope: pod\n")
    monkeypatch.setenv("QUARK_CONFIG", str(config))   # read by every create


def annotate(quark, bundle: str, pod: str, kind: str, own_netns: bool = False) -> str:
    """A pod's container as containerd's CRI writes it: annotated and, unless it is the sandbox or
    `own_netns`, joining the sandbox's network namespace."""
    def edit(spec):
        spec["annotations"] = {"io.kubernetes.cri.container-type": kind, "io.kubernetes.cri.sandbox-id": pod}
        if kind != "sandbox" and not own_netns:
            for ns in spec["linux"]["namespaces"]:
                if ns["type"] == "network":
                    ns["path"] = f"/proc/{quark.state(pod)['pid']}/ns/net"
    edit_config(bundle, edit)
    return bundle


def run_detached(quark, cid: str, bundle: str) -> dict:
    quark("create", "--bundle", bundle, cid)
    quark("start", cid)
    return quark.state(cid)


def supervisor_of(quark, cid: str) -> int:
    with open(os.path.join(quark.root, cid, "state.json")) as f:
        return json.load(f)["supervisor_pid"]


def wait_status(quark, cid: str, status: str, timeout: float = 10) -> dict:
    deadline = time.monotonic() + timeout
    while (st := quark.state(cid))["status"] != status:
        assert time.monotonic() < deadline, st
        time.sleep(0.05)
    return st


def test_the_pods_containers_share_the_sandboxs_supervisor_and_outlive_the_sandbox(quark, bundle):
    run_detached(quark, "pod1", annotate(quark, bundle(["sleep", "300"]), "pod1", "sandbox"))
    sup = supervisor_of(quark, "pod1")
    c1 = run_detached(quark, "c1", annotate(quark, bundle(["sleep", "300"]), "pod1", "container"))
    c2 = run_detached(quark, "c2", annotate(quark, bundle(["sleep", "300"]), "pod1", "container"))
    assert supervisor_of(quark, "c1") == supervisor_of(quark, "c2") == sup
    assert c1["pid"] != c2["pid"] and alive(c1["pid"])
    r = quark("exec", "c1", "sh", "-c", "echo $$; exit 4", check=False)
    assert r.returncode == 4 and r.stdout.strip() != "1"
    quark("kill", "c2", "KILL")
    wait_status(quark, "c2", "stopped")
    with open(os.path.join(quark.root, "c2", "state.json")) as f:
        assert json.load(f)["exit_status"] == 137   # reaped by the pod's supervisor
    quark("delete", "c2")
    assert not os.path.exists(os.path.join(quark.root, "c2"))
    # the sandbox container goes first (as `ctr` may do it): its supervisor serves c1 on
    quark("kill", "pod1", "KILL")
    wait_status(quark, "pod1", "stopped")
    quark("delete", "pod1")
    assert alive(sup)
    assert quark("exec", "c1", "echo", "still").stdout == "still\n"
    quark("kill", "c1", "KILL")
    wait_status(quark, "c1", "stopped")
    with open(os.path.join(quark.root, "c1", "state.json")) as f:
        cgroup = json.load(f)["cgroup_path"]
    quark("delete", "c1")
    wait_gone(sup, 10)
    assert cgroup_dirs(cgroup) == []


def test_a_container_outside_the_pods_network_namespace_gets_a_supervisor_of_its_own(quark, bundle):
    """Its TSoR registration could not name the sandbox's init (tsor/identity.py): the pod's
    supervisor declines it, and it runs as any container does."""
    run_detached(quark, "pod5", annotate(quark, bundle(["sleep", "300"]), "pod5", "sandbox"))
    run_detached(quark, "own", annotate(quark, bundle(["sleep", "300"]), "pod5", "container", own_netns=True))
    assert supervisor_of(quark, "own") != supervisor_of(quark, "pod5")
    assert quark("exec", "own", "echo", "ok").stdout == "ok\n"
    for cid in ("own", "pod5"):
        quark("delete", "--force", cid)


def test_a_failed_create_in_the_pod_leaves_nothing_and_the_pod_is_served_on(quark, bundle):
    run_detached(quark, "pod2", annotate(quark, bundle(["sleep", "300"]), "pod2", "sandbox"))
    sup = supervisor_of(quark, "pod2")
    bad = annotate(quark, bundle(["sleep", "300"]), "pod2", "container")
    edit_config(bad, lambda spec: spec["process"].update(cwd="/no/such/dir", args=["/no/such/binary"]))
    edit_config(bad, lambda spec: spec["mounts"].append({"destination": "/x", "type": "bind",
                                                          "source": "/no/such/source", "options": ["bind"]}))
    r = quark("create", "--bundle", bad, "bad", check=False)
    assert r.returncode != 0 and "/no/such/source" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert not os.path.exists(os.path.join(quark.root, "bad"))
    assert not cgroup_dirs(cgroups.default_path("bad")) and alive(sup)
    run_detached(quark, "ok", annotate(quark, bundle(["sleep", "300"]), "pod2", "container"))
    assert supervisor_of(quark, "ok") == sup
    for cid in ("ok", "pod2"):
        quark("delete", "--force", cid)
    wait_gone(sup, 10)


CONNECT = """
import os, socket, sys
mode = sys.argv[2]
if mode == "confined":
    import seccomp
    seccomp.SyscallFilter(seccomp.ALLOW).load()
elif mode == "user":   # nobody, keeping only CAP_DAC_OVERRIDE to reach the socket: the supervisor must refuse
    sys.path.insert(0, sys.argv[3])
    from qlib import linux as L
    L.prctl(L.PR_SET_KEEPCAPS, 1)
    os.setgid(65534); os.setuid(65534)
    L.capset(1 << 1, 1 << 1, 0)
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(sys.argv[1])
s.settimeout(10)
try:   # the refusal may close the connection before our message goes, or with it unread
    s.send(b"\\x80\\x05garbage that must never be unpickled")
    print("answer:", s.recv(4096) or "closed")
except (BrokenPipeError, ConnectionResetError):
    print("answer: closed")
"""


def log_of(quark, cid: str) -> str:
    with open(os.path.join(quark.root, cid, "supervisor.log")) as f:
        return f.read()


@pytest.mark.parametrize("mode", ["confined", "user"])
def test_the_pod_supervisor_takes_nothing_from_a_confined_or_unprivileged_caller(quark, bundle, mode):
    run_detached(quark, "pod3", annotate(quark, bundle(["sleep", "300"]), "pod3", "sandbox"))
    sup = supervisor_of(quark, "pod3")
    path = os.path.join(quark.root, "pod3", "pod.sock")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", CONNECT, path, mode, repo], capture_output=True, text=True,
                         timeout=30)
    assert "answer: closed" in out.stdout, out.stdout + out.stderr   # closed on it, nothing read
    expected = "a confined process may not hand containers over" if mode == "confined" else "uid 65534 is not root"
    assert expected in log_of(quark, "pod3")
    assert alive(sup) and sorted(quark.ids()) == ["pod3"]
    # and the pod goes on taking its containers
    run_detached(quark, "c3", annotate(quark, bundle(["sleep", "300"]), "pod3", "container"))
    assert supervisor_of(quark, "c3") == sup
    for cid in ("c3", "pod3"):
        quark("delete", "--force", cid)
    wait_gone(sup, 10)


def test_a_stopped_factory_stays_as_the_reaper_of_the_inits_it_adopted(quark, bundle, tmp_path, monkeypatch):
    """A container handed to the pod's supervisor is reaped by the factory (its init is no child of
    the supervisor's). A factory that stops serving (a stop, its idle time, a code change) gives up
    its socket at once, so that another can serve, but stays until what it adopted has exited: the
    container's exit status still comes (7: the factory reaped it, the supervisor read its pidfd)."""
    from qvisor.factory import client, wire
    where = str(tmp_path / "factory")
    monkeypatch.setenv("QUARK_FACTORY_DIR", where)   # a factory of this test's own
    run_detached(quark, "pod6", annotate(quark, bundle(["sleep", "300"]), "pod6", "sandbox"))
    sup = supervisor_of(quark, "pod6")
    script = 'trap "exit 7" TERM; while :; do sleep 0.1; done'
    c = run_detached(quark, "c6", annotate(quark, bundle(["sh", "-c", script]), "pod6", "container"))
    assert supervisor_of(quark, "c6") == sup
    with open(os.path.join(where, wire.PID_NAME)) as f:
        factory = int(f.read())
    assert procfs.parent_pid(c["pid"]) == factory   # adopted when its stage 1 exited
    assert client.stop(where) == factory
    assert not os.path.exists(os.path.join(where, wire.SOCK_NAME))   # another may serve from now on
    time.sleep(0.5)
    assert alive(factory) and procfs.parent_pid(c["pid"]) == factory
    quark("kill", "c6", "TERM")
    st = wait_status(quark, "c6", "stopped")
    with open(os.path.join(quark.root, "c6", "state.json")) as f:
        assert json.load(f)["exit_status"] == 7, st
    for cid in ("c6", "pod6"):
        quark("delete", "--force", cid)
    wait_gone(sup, 10)
    wait_gone(factory, 10)   # nothing of its own left to reap: it exits
