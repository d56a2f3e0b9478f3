"""Pod features through containerd's CRI, driven as kubelet drives them (tests/integration/cri_env.py:
handlers `quark` and `runc`, a pause image built here, bridge CNI):

* idle hibernation from a pod annotation (`io.quark.hibernate.idle-after`, passed on by the quark
  handler's pod_annotations): the pod's container hibernates itself, wakes for a TCP connection from
  another pod (the server answers) and for ExecSync (the command runs, its output comes back); idle
  is the pod's: a quiet container waits while another container of its pod works;
* a privileged pod mounts inside its own mount namespace (a bind mount and a tmpfs, which quark's
  supervisor makes), volumes with PROPAGATION_PRIVATE and PROPAGATION_HOST_TO_CONTAINER behave as
  Kubernetes means them, and PROPAGATION_BIDIRECTIONAL is refused naming the field, leaving nothing;
* seccomp: pods with profile Unconfined, with no profile at all (what kubelet sends by default) and
  RuntimeDefault, each beside the same pod on runc: what /proc/PID/status shows, and a call quark's
  base policy denies staying denied;
* containerd's log: a quark pod's life (a bind mount of /etc, a container that exits, an exec, stop
  and removal) leaves no error there, as a runc pod's does not.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

try:
    from tests.integration import containerd_env as ce
    from tests.integration import cri_env
except ImportError:  # pytest put tests/integration itself on sys.path
    import containerd_env as ce
    import cri_env

pytestmark = [pytest.mark.root, pytest.mark.timeout(600),
              pytest.mark.skipif(cri_env.skip_reason() is not None, reason=cri_env.skip_reason() or "")]

if cri_env.skip_reason() is None:
    import grpc

    # the module's containerd and the checked client are test_cri.py's fixtures
    from tests.integration.test_cri import (IMAGE, _proc_cmdlines, cd, create, cri, http_get,  # noqa: F401
                                            quark_state, start_httpd, wait_for)
    from tests.support.cri import cri_v1_pb2 as pb

QUARK = os.path.join(os.path.dirname(ce.SHIM), "quark")   # the CLI beside the shim containerd runs
IDLE = "io.quark.hibernate.idle-after"
OWN_PID_NS = {"network": 0, "pid": 1, "ipc": 0}           # kubelet's: POD network and IPC, CONTAINER pid


def quark_cli(cd, *args: str) -> subprocess.CompletedProcess:
    """The quark CLI against the root the shim keeps this containerd's containers in (shim/paths.py)."""
    return subprocess.run([QUARK, "--root", str(cd.state / "quark" / cri_env.NAMESPACE), *args],
                          capture_output=True, text=True, timeout=60)


def snapshot_row(cd, cid: str) -> dict | None:
    """The container's row of `quark snapshot list` (it lists the hibernated containers only)."""
    r = quark_cli(cd, "snapshot", "list", "-f", "json")
    assert r.returncode == 0, r.stderr
    return next((row for row in json.loads(r.stdout) if row["id"] == cid), None)


def wait_hibernated(cd, cid: str) -> dict:
    return wait_for(f"{cid[:12]} to hibernate itself", lambda: snapshot_row(cd, cid), timeout=30)


def supervisor_log(cd, cid: str) -> str:
    """The container's supervisor log: under the shim, the --log file in containerd's bundle
    (shim/runtime.py)."""
    with open(cd.state / "io.containerd.runtime.v2.task" / cri_env.NAMESPACE / cid / "quark-log.json",
              errors="replace") as f:
        return f.read()


def security_context(**kw) -> pb.LinuxContainerSecurityContext:
    return pb.LinuxContainerSecurityContext(namespace_options=pb.NamespaceOption(**OWN_PID_NS), **kw)


# --- idle hibernation ------------------------------------------------------------------------------

def test_idle_pod_hibernates_and_wakes_on_connect_and_on_exec_sync(cd, cri):
    pod, config = cri.run_pod("sleepy", "quark", annotations={IDLE: "1s"})
    srv = start_httpd(cri, pod, config, "sleepy")
    ip = cri.pod_status(pod).status.network.ip
    row = wait_hibernated(cd, srv)
    assert row["reason"] == "idle"
    state = json.loads(quark_cli(cd, "state", srv).stdout)
    assert state["status"] == "paused" and "io.quark.hibernated" in state["annotations"]
    assert cri.container_status(srv).state == pb.CONTAINER_RUNNING   # to kubelet it still runs
    wakes = row["wakes"]

    # (i) a TCP connection from another pod (runc's: any peer) wakes it, and the server answers
    client_pod, client_config = cri.run_pod("client", "runc")
    client = cri.create_container(client_pod, client_config, "client", IMAGE, ["sleep", "300"])
    cri.start_container(client)
    assert http_get(cri, client, f"http://{ip}:8080/") == "hello-sleepy\n"
    assert "woke (connection)" in supervisor_log(cd, srv)
    row = wait_hibernated(cd, srv)          # and it sleeps again once idle
    assert row["wakes"] == wakes + 1, row
    wakes = row["wakes"]

    # (ii) ExecSync (`crictl exec`, an exec probe) wakes it: the command runs, its output comes back
    r = cri.exec_sync(srv, ["sh", "-c", "echo awake; cat /www/index.html"])
    assert (r.exit_code, r.stdout) == (0, b"awake\nhello-sleepy\n"), r
    row = wait_hibernated(cd, srv)
    assert row["wakes"] == wakes + 1, row


def test_a_pod_is_idle_when_every_container_is(cd, cri):
    """Idle is the pod's: a quiet container of a pod whose other container works stays awake, and
    the pod's containers hibernate once all of it is quiet."""
    pod, config = cri.run_pod("pair", "quark", annotations={IDLE: "1s"})
    quiet = cri.create_container(pod, config, "quiet", IMAGE, ["sleep", "300"])
    cri.start_container(quiet)
    busy = cri.create_container(pod, config, "busy", IMAGE, ["sh", "-c", "while :; do :; done"])
    cri.start_container(busy)
    time.sleep(4)   # four idle periods of the quiet one's own
    assert snapshot_row(cd, quiet) is None and snapshot_row(cd, busy) is None
    cri.call("StopContainer", pb.StopContainerRequest(container_id=busy, timeout=1))
    assert wait_hibernated(cd, quiet)["reason"] == "idle"
    cri.teardown_pod(pod)


# --- a privileged pod's mounts and its volumes' propagation -----------------------------------------

def host_mounts_under(base: Path) -> set[str]:
    """The host's mount points under `base` (this containerd's tree: its volumes, rootfs, shm)."""
    with open("/proc/self/mountinfo") as f:
        return {line.split()[4] for line in f if line.split()[4].startswith(str(base))}


def shared_volume(base: Path, name: str) -> Path:
    """A host directory that is a shared mount of its own, as kubelet's volumes are on systemd hosts
    (containerd requires a shared source for Bidirectional, shared or slave for HostToContainer)."""
    v = base / name
    (v / "sub").mkdir(parents=True)
    subprocess.run(["mount", "--bind", str(v), str(v)], check=True)
    subprocess.run(["mount", "--make-shared", str(v)], check=True)
    return v


def run_privileged_pod(cri, name: str) -> tuple[str, pb.PodSandboxConfig]:
    sandbox = cri.sandbox_config(name)
    sandbox.linux.security_context.privileged = True   # containerd refuses a privileged container otherwise
    os.makedirs(sandbox.log_directory, exist_ok=True)
    pod = cri.call("RunPodSandbox", pb.RunPodSandboxRequest(config=sandbox, runtime_handler="quark")).pod_sandbox_id
    return pod, sandbox


def test_privileged_pod_mounts_inside_and_volume_propagation(cd, cri):
    vols = {}
    try:
        for name in ("slave", "private", "bidir"):
            vols[name] = shared_volume(cd.base, f"vol-{name}")
        pod, sandbox = run_privileged_pod(cri, "privmounts")
        linux = pb.LinuxContainerConfig(security_context=security_context(privileged=True))
        cid = create(cri, pod, sandbox, "main", ["sleep", "300"], linux=linux, mounts=[
            pb.Mount(container_path="/slave", host_path=str(vols["slave"]),
                     propagation=pb.PROPAGATION_HOST_TO_CONTAINER),
            pb.Mount(container_path="/private", host_path=str(vols["private"]), propagation=pb.PROPAGATION_PRIVATE)])
        cri.start_container(cid)
        before = host_mounts_under(cd.base)

        # a bind mount and a tmpfs in its own mount namespace; a new proc stays refused
        r = cri.exec_sync(cid, ["sh", "-c",
                                "mkdir -p /mnt/a /mnt/b /mnt/t /mnt/p /slave/sub/in && touch /mnt/a/marker && "
                                "mount --bind /mnt/a /mnt/b && ls /mnt/b && "
                                "mount -t tmpfs -o size=1m tmpfs /mnt/t && echo data > /mnt/t/f && cat /mnt/t/f && "
                                "grep ' /mnt/t ' /proc/self/mountinfo | sed 's/.* - //' && "
                                "mount -t tmpfs tmpfs /slave/sub/in && mount --rbind /etc /mnt/p && ls /mnt/p/hosts; "
                                "mount -t proc proc /mnt/p 2>&1; "
                                # containerd's /etc binds are not locked: /etc binds non-recursively,
                                # as Kubernetes' mount-propagation checks do it; /proc, holding
                                # quark's masks and read-only paths, does not (the locked mounts)
                                "mkdir -p /mnt/e /mnt/q && mount --bind /etc /mnt/e && ls /mnt/e/hosts; "
                                "mount --bind /proc /mnt/q 2>&1; echo end"])
        assert r.exit_code == 0 and r.stdout.decode().splitlines() == [
            "marker", "data", "tmpfs tmpfs rw,size=1024k", "/mnt/p/hosts",
            "mount: permission denied (are you root?)", "/mnt/e/hosts",
            "mount: mounting /proc on /mnt/q failed: Invalid argument", "end"], r
        # nothing of it reached the host, not even what it mounted under its HostToContainer volume
        assert host_mounts_under(cd.base) == before
        assert os.listdir(vols["slave"] / "sub") == ["in"]

        # mounts the host makes under the volumes after the container started: HostToContainer (rslave)
        # carries them in, Private does not
        for name in ("slave", "private"):
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(vols[name] / "sub")], check=True)
            (vols[name] / "sub" / "f").write_text(f"from-the-host-{name}\n")
        r = cri.exec_sync(cid, ["sh", "-c", "cat /slave/sub/f; ls -A /private/sub | wc -l"])
        assert r.stdout == b"from-the-host-slave\n0\n", r

        # Bidirectional (rshared): refused when the container starts (containerd creates the task then),
        # naming the field; no state, mount or process of it is left, and the pod carries on
        bidir = create(cri, pod, sandbox, "bidir", ["sleep", "300"], linux=linux, mounts=[
            pb.Mount(container_path="/bidir", host_path=str(vols["bidir"]), propagation=pb.PROPAGATION_BIDIRECTIONAL)])
        with pytest.raises(grpc.RpcError) as e:
            cri.start_container(bidir)
        assert re.search(r"mounts\[\d+\]\.options: rshared \(/bidir; Kubernetes' Bidirectional mount propagation\) "
                         r"is not supported by quark", e.value.details()), e.value.details()
        assert "Traceback" not in e.value.details()
        assert cri.container_status(bidir).state != pb.CONTAINER_RUNNING
        assert not os.path.exists(quark_state(cd, bidir))
        with open("/proc/self/mountinfo") as f:
            assert [line for line in f if bidir in line] == []
        assert [p for p in _proc_cmdlines() if bidir in p] == []
        assert cri.exec_sync(cid, ["echo", "still-here"]).stdout == b"still-here\n"
        cri.teardown_pod(pod)
        assert cri.list_pods() == []
    finally:
        for v in vols.values():
            subprocess.run(["umount", "-R", str(v)], check=False)


# --- containerd's log: a pod's life leaves no error there, as with runc ---------------------------------

LOG_ERRORS = re.compile(r'level=error msg="([^"]*)')


def containerd_errors(cd, since: int) -> list[str]:
    """The messages of containerd's error lines logged after byte `since` of its log, ids blanked."""
    with open(cd.log_path, errors="replace") as f:
        f.seek(since)
        text = f.read()
    return [re.sub(r"[0-9a-f]{64}", "ID", m.group(1)) for m in LOG_ERRORS.finditer(text)]


def pod_life(cd, cri, handler: str, failing: bool) -> list[str]:
    """A privileged pod's life as kubelet drives it (or, `failing`, a container whose create fails);
    the errors containerd logged meanwhile."""
    since = cd.log_path.stat().st_size
    sandbox = cri.sandbox_config(f"life-{handler}")
    sandbox.linux.security_context.privileged = True
    os.makedirs(sandbox.log_directory, exist_ok=True)
    pod = cri.call("RunPodSandbox", pb.RunPodSandboxRequest(config=sandbox, runtime_handler=handler)).pod_sandbox_id
    linux = pb.LinuxContainerConfig(security_context=security_context(privileged=True))
    if failing:
        bad = create(cri, pod, sandbox, "bad", ["/no/such/program"], linux=linux)
        with pytest.raises(grpc.RpcError):
            cri.start_container(bad)
    else:
        main = create(cri, pod, sandbox, "main", ["sh", "-c", "echo out; echo err >&2; exec sleep 300"], linux=linux)
        cri.start_container(main)
        # what Kubernetes' mount-propagation checks do, and a container that ends by itself
        r = cri.exec_sync(main, ["sh", "-c", "mkdir -p /mnt/e && mount --bind /etc /mnt/e && ls /mnt/e/hosts"])
        assert r.exit_code == 0 and r.stdout == b"/mnt/e/hosts\n", r
        done = create(cri, pod, sandbox, "done", ["sh", "-c", "echo bye; exit 3"], linux=linux)
        cri.start_container(done)
        wait_for("the container to exit", lambda: cri.container_status(done).state == pb.CONTAINER_EXITED)
        assert cri.container_status(done).exit_code == 3
        cri.call("StopContainer", pb.StopContainerRequest(container_id=main, timeout=1))
    cri.teardown_pod(pod)
    return containerd_errors(cd, since)


def test_a_pods_life_leaves_no_error_in_containerds_log_as_with_runc(cd, cri):
    """A privileged pod whose container bind-mounts /etc (as Kubernetes' mount-propagation checks
    do), a container that exits, an exec, a stop and the pod's removal: containerd logs no error
    ("Failed to pipe stdout", "copy shim log: file already closed", ...) for a quark pod, as for a
    runc pod. A container whose create fails makes containerd log its own errors for either runtime
    (its shim-log copy of the failed task); quark's are no more than runc's."""
    assert pod_life(cd, cri, "runc", failing=False) == []
    assert pod_life(cd, cri, "quark", failing=False) == []
    runc = pod_life(cd, cri, "runc", failing=True)
    quark = pod_life(cd, cri, "quark", failing=True)
    assert "copy shim log" in runc   # containerd's own, whatever the runtime: the test sees the log
    assert {m for m in quark if not m.startswith("StartContainer for")} <= set(runc), (quark, runc)


# --- seccomp: Unconfined, unset, RuntimeDefault, against runc -----------------------------------------

SECCOMP_CASES = {
    "unconfined": pb.SecurityProfile(profile_type=pb.SecurityProfile.Unconfined),
    "unset": None,   # kubelet's default: no profile in the CRI request; containerd then sets no linux.seccomp
    "runtime-default": pb.SecurityProfile(profile_type=pb.SecurityProfile.RuntimeDefault),
}
# what a process of the container sees (its init, PID 1, and an ExecSync'd shell), and whether a new
# user namespace, which quark's base policy denies, can be made
PROBE = ["sh", "-c", "for p in 1 self; do grep -E '^Seccomp(_filters)?:' /proc/$p/status | cut -f2 | tr '\\n' ' '; "
                     "done; unshare -U true 2>/dev/null; echo $?"]


def seccomp_probe(cri, handler: str, case: str) -> dict:
    pod, sandbox = cri.run_pod(f"{handler}-{case}", handler)
    sc = security_context()
    if SECCOMP_CASES[case] is not None:
        sc.seccomp.CopyFrom(SECCOMP_CASES[case])
    cid = create(cri, pod, sandbox, "main", ["sleep", "300"], linux=pb.LinuxContainerConfig(security_context=sc))
    cri.start_container(cid)
    r = cri.exec_sync(cid, PROBE)
    assert r.exit_code == 0, r
    init_mode, init_filters, exec_mode, exec_filters, newuser = map(int, r.stdout.split())
    return {"cid": cid, "init": (init_mode, init_filters), "exec": (exec_mode, exec_filters), "newuser": newuser}


@pytest.mark.parametrize("case", list(SECCOMP_CASES))
def test_seccomp_profile_as_the_pod_asked_with_quarks_base_policy_kept(cd, cri, case):
    runc = seccomp_probe(cri, "runc", case)
    quark = seccomp_probe(cri, "quark", case)
    profile = case == "runtime-default"
    # runc: the pod's profile or nothing; Unconfined and unset are the same (no linux.seccomp)
    assert runc["init"] == runc["exec"] == ((2, 1) if profile else (0, 0)), runc
    assert runc["newuser"] == (1 if profile else 0), runc   # Unconfined lets a new user namespace through
    # quark: always in seccomp filter mode; the pod's profile, if any, on top of quark's base policy
    # (one filter more than runc in the container's own processes), and an exec'd process also carries
    # the supervisor's filter, which it is forked from (one more)
    assert quark["init"] == (2, runc["init"][1] + 1), quark
    assert quark["exec"] == (2, runc["exec"][1] + 2), quark
    assert quark["newuser"] == 1, quark   # denied by the base policy, whatever the pod asked
    report = json.loads(quark_cli(cd, "state", quark["cid"]).stdout)["annotations"]["io.quark.security.seccomp"]
    assert report.startswith("quark's base policy and linux.seccomp, stacked" if profile
                             else "quark's base policy only: linux.seccomp is absent (Unconfined)"), report
