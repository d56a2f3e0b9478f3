"""Pods on quark through containerd 1.6's CRI, driven as kubelet drives them (gRPC, CRI v1).

A private containerd with the CRI plugin on (tests/integration/cri_env.py): runtime handlers `quark`
and `runc`, a locally built pause image, bridge + host-local CNI on a private subnet. Covered:
the pod lifecycle (RunPodSandbox .. RemovePodSandbox, with the pod IP from CNI), containers in a pod
(status, logs, stats, ExecSync, streaming Exec with and without a terminal, Attach, PortForward),
two containers sharing the pod's network namespace, TCP between a quark pod and a runc pod both
ways, exit codes and reasons (Error, Completed after StopContainer, OOMKilled), DNS/hostname/env/
user/read-only hostPath from the configs, UpdateContainerResources, a terminal container's log,
shared-PID and host-network pods, and the faults: RemovePodSandbox under running containers, bad
container specs, containerd restarted under a running pod.
"""
from __future__ import annotations

import ipaddress
import re
import os
import time

import pytest

try:
    from tests.integration import cri_env
except ImportError:  # pytest put tests/integration itself on sys.path
    import cri_env

pytestmark = [pytest.mark.root, pytest.mark.timeout(600),
              pytest.mark.skipif(cri_env.skip_reason() is not None, reason=cri_env.skip_reason() or "")]

if cri_env.skip_reason() is None:
    import grpc

    from tests.support.cri import cri_v1_pb2 as pb
    from tests.support.cri.client import CriClient, log_text
    from tests.support.cri.stream import ERROR, STDERR, STDIN, STDOUT, Stream

IMAGE = cri_env.BUSYBOX_IMAGE
HTTPD = ["sh", "-c", "mkdir -p /www && echo hello-$NAME > /www/index.html && exec httpd -f -p 8080 -h /www"]


@pytest.fixture(scope="module", params=["container", "pod"], ids=["supervisor-per-container", "supervisor-per-pod"])
def cd(request):
    """This module's containerd (and test_cri_pod_features.py's), once with each supervisor scope:
    every test passes with a supervisor per container (`supervisor: {scope: container}`) and with
    one per pod (the default, docs/kubernetes.md)."""
    with cri_env.running(quark_config=f"supervisor:\n  scope: {request.param}\n") as d:
        yield d


@pytest.fixture
def cri(cd):
    with CheckedCri(cd) as c:
        yield c
        c.remove_all_pods()


if cri_env.skip_reason() is None:
    class CheckedCri(CriClient):
        """A CriClient whose RunPodSandbox checks that a `quark` pod is a quark sandbox (its state is
        under quark's root for this containerd) and a `runc` pod is not."""

        def __init__(self, cd) -> None:
            super().__init__(cd.address, cgroup_parent=cd.cgroup_parent, log_root=str(cd.log_dir))
            self.cd = cd

        def call(self, name: str, request, timeout: float = 120.0):
            resp = super().call(name, request, timeout)
            if name == "RunPodSandbox":
                is_quark = os.path.isdir(quark_state(self.cd, resp.pod_sandbox_id))
                handler = request.runtime_handler
                assert is_quark == (handler == "quark"), f"a {handler} pod; a quark sandbox: {is_quark}"
            return resp


def quark_state(cd, cid: str) -> str:
    """Where quark keeps a container's state under this containerd (shim/paths.py's quark_root)."""
    return str(cd.state / "quark" / cri_env.NAMESPACE / cid)


def wait_for(what, predicate, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def http_get(cri, cid: str, url: str) -> str:
    # no `wget -T`: Debian busybox-static 1.35's dies of SIGSEGV with it (on the host too); ExecSync's timeout bounds it
    r = cri.exec_sync(cid, ["wget", "-qO-", url], timeout=30)
    assert r.exit_code == 0, f"wget {url}: {r.stderr!r}"
    return r.stdout.decode()


def start_httpd(cri, pod, config, name: str) -> str:
    cid = cri.create_container(pod, config, name, IMAGE, HTTPD, envs={"NAME": name})
    cri.start_container(cid)
    wait_for(f"{name}'s httpd", lambda: cri.exec_sync(cid, ["sh", "-c", "netstat -ltn | grep -q :8080"]).exit_code == 0)
    return cid


def create(cri, pod, sandbox, name: str, command: list[str], **config) -> str:
    """CreateContainer with ContainerConfig fields of the test's choosing (envs, mounts, linux, tty...)."""
    conf = pb.ContainerConfig(metadata=pb.ContainerMetadata(name=name), image=pb.ImageSpec(image=IMAGE),
                              command=command, log_path=f"{name}/0.log", **config)
    return cri.call("CreateContainer", pb.CreateContainerRequest(pod_sandbox_id=pod, config=conf,
                                                                 sandbox_config=sandbox)).container_id


def exited(cri, cid: str) -> tuple[int, str]:
    """(exit code, reason) once the container has exited."""
    st = wait_for(f"{cid[:12]} to exit", lambda: (lambda s: s if s.state == pb.CONTAINER_EXITED else None)(
        cri.container_status(cid)))
    # (not finished_at >= started_at: containerd stamps started_at when Start returns, and a fast
    # program's real exit time can precede it, with runc too)
    assert st.finished_at > 0 and st.started_at > 0
    return st.exit_code, st.reason


def test_pod_lifecycle_on_quark(cd, cri):
    pod, config = cri.run_pod("life", "quark")
    status = cri.pod_status(pod).status
    assert status.state == pb.SANDBOX_READY and status.runtime_handler == "quark"
    assert ipaddress.ip_address(status.network.ip) in ipaddress.ip_network(cri_env.SUBNET)
    assert os.path.isdir(quark_state(cd, pod)), "the pause container is not a quark container"

    cid = cri.create_container(pod, config, "main", IMAGE, ["sh", "-c", "echo first-line; hostname; exec sleep 300"])
    assert cri.container_status(cid).state == pb.CONTAINER_CREATED
    cri.start_container(cid)
    st = cri.container_status(cid)
    assert st.state == pb.CONTAINER_RUNNING and st.started_at > 0 and st.image.image == IMAGE
    assert os.path.isdir(quark_state(cd, cid))
    assert wait_for("the container's output", lambda: "first-line\nlife\n" in log_text(config, "main"))

    listed = {c.id: c for c in cri.list_containers(pod)}
    assert listed[cid].state == pb.CONTAINER_RUNNING and listed[cid].metadata.name == "main"
    assert [p.id for p in cri.list_pods()] == [pod]

    stats = cri.call("ContainerStats", pb.ContainerStatsRequest(container_id=cid)).stats
    assert stats.attributes.id == cid
    assert stats.memory.working_set_bytes.value > 0 and stats.cpu.usage_core_nano_seconds.value > 0

    cri.stop_pod(pod)
    assert cri.container_status(cid).state == pb.CONTAINER_EXITED
    assert cri.pod_status(pod).status.state == pb.SANDBOX_NOTREADY
    cri.stop_pod(pod)   # kubelet repeats it: must stay a no-op
    cri.remove_pod(pod)
    assert cri.list_pods() == [] and cri.list_containers() == []
    assert not os.path.exists(quark_state(cd, cid)) and not os.path.exists(quark_state(cd, pod))
    with pytest.raises(grpc.RpcError) as e:
        cri.pod_status(pod)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    cri.remove_pod(pod)  # idempotent


def test_exec_sync_output_and_exit_code(cri):
    pod, config = cri.run_pod("execsync", "quark")
    cid = cri.create_container(pod, config, "main", IMAGE, ["sleep", "300"])
    cri.start_container(cid)
    r = cri.exec_sync(cid, ["sh", "-c", "echo out; echo err >&2; exit 7"])
    assert (r.stdout, r.stderr, r.exit_code) == (b"out\n", b"err\n", 7)
    r = cri.exec_sync(cid, ["sh", "-c", "tty; cat /proc/1/cmdline | tr '\\0' ' '"])
    assert r.stdout == b"not a tty\nsleep 300 ", r   # its own PID namespace: PID 1 is its command
    with pytest.raises(grpc.RpcError) as e:
        cri.exec_sync(cid, ["/no/such/program"])
    assert "/no/such/program" in e.value.details()
    # an exec probe past its timeout: DeadlineExceeded, and the process is killed, not left behind
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        cri.exec_sync(cid, ["sleep", "31"], timeout=2)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - t0 < 15
    wait_for("the timed-out exec to be killed",
             lambda: "sleep 31" not in cri.exec_sync(cid, ["ps", "-o", "args"]).stdout.decode())


def test_exec_stream_with_and_without_tty(cri):
    pod, config = cri.run_pod("exec", "quark")
    cid = cri.create_container(pod, config, "main", IMAGE, ["sleep", "300"])
    cri.start_container(cid)
    url = cri.call("Exec", pb.ExecRequest(container_id=cid, cmd=["sh", "-c", "tty; echo out; echo err >&2; exit 3"],
                                          stdout=True, stderr=True)).url
    with Stream(url) as s:
        out = s.read_until_close()
        assert (out.get(STDOUT), out.get(STDERR)) == (b"not a tty\nout\n", b"err\n")
        assert s.status()["details"]["causes"][0]["message"] == "3"
    # with a terminal, as `kubectl exec -it`: stdin in, one merged stream out
    url = cri.call("Exec", pb.ExecRequest(container_id=cid, cmd=["sh", "-c", "tty; read x; echo got-$x; exit 4"],
                                          tty=True, stdin=True, stdout=True)).url
    with Stream(url) as s:
        s.send(STDIN, b"hi\r")
        out = s.read_until_close()
        assert b"/dev/pts/" in out.get(STDOUT, b"") and b"got-hi" in out.get(STDOUT, b""), out
        assert s.status()["details"]["causes"][0]["message"] == "4"


def test_attach_to_container_stdin_and_stdout(cri):
    pod, config = cri.run_pod("attach", "quark")
    cid = cri.create_container(pod, config, "cat", IMAGE, ["cat"], stdin=True)
    cri.start_container(cid)
    url = cri.call("Attach", pb.AttachRequest(container_id=cid, stdin=True, stdout=True, stderr=True)).url
    with Stream(url) as s:
        s.send(STDIN, b"ping-attach\n")
        assert b"ping-attach\n" in s.read_until(STDOUT, b"ping-attach\n", 30), s.out
        assert ERROR not in s.out
    assert wait_for("the attached input in the log", lambda: "ping-attach" in log_text(config, "cat"))


def test_port_forward_into_quark_pod(cri):
    pod, config = cri.run_pod("pf", "quark")
    start_httpd(cri, pod, config, "pf")
    url = cri.call("PortForward", pb.PortForwardRequest(pod_sandbox_id=pod, port=[8080])).url
    with Stream(url) as s:
        s.send(0, b"GET / HTTP/1.0\r\n\r\n")
        data = s.read_until_close(30).get(0, b"")
    assert data[:2] == (8080).to_bytes(2, "little")   # the port, first on each of its channels
    assert data[2:].startswith(b"HTTP/1.") and data.endswith(b"\r\n\r\nhello-pf\n"), data


def test_two_containers_share_the_pod_network(cri):
    pod, config = cri.run_pod("pair", "quark")
    ip = cri.pod_status(pod).status.network.ip
    srv = start_httpd(cri, pod, config, "srv")
    cli = cri.create_container(pod, config, "cli", IMAGE, ["sleep", "300"])
    cri.start_container(cli)
    assert http_get(cri, cli, "http://127.0.0.1:8080/") == "hello-srv\n"
    assert http_get(cri, cli, f"http://{ip}:8080/") == "hello-srv\n"
    # one network namespace: both see the pod's one address
    for cid in (srv, cli):
        assert f"inet {ip}/" in cri.exec_sync(cid, ["ip", "-4", "addr", "show", "eth0"]).stdout.decode()


def test_quark_pod_and_runc_pod_talk_tcp_both_ways(cri):
    qpod, qconf = cri.run_pod("qpod", "quark")
    rpod, rconf = cri.run_pod("rpod", "runc")
    assert cri.pod_status(rpod).status.runtime_handler == "runc"
    qip, rip = (cri.pod_status(p).status.network.ip for p in (qpod, rpod))
    assert qip != rip
    qsrv = start_httpd(cri, qpod, qconf, "quark")
    rsrv = start_httpd(cri, rpod, rconf, "runc")
    assert http_get(cri, qsrv, f"http://{rip}:8080/") == "hello-runc\n"
    assert http_get(cri, rsrv, f"http://{qip}:8080/") == "hello-quark\n"


def test_remove_pod_with_running_containers_leaves_nothing(cd, cri):
    pod, config = cri.run_pod("gone", "quark")
    netns = cri.pod_status(pod, verbose=True).info.get("info", "")
    cids = [cri.create_container(pod, config, f"c{i}", IMAGE, ["sleep", "300"]) for i in range(2)]
    for cid in cids:
        cri.start_container(cid)
    netns_before = set(os.listdir("/var/run/netns"))
    assert any(ns.startswith("cni-") and ns in netns for ns in netns_before)
    cri.remove_pod(pod)   # no StopPodSandbox first: it must stop what runs
    assert cri.list_pods() == [] and cri.list_containers() == []
    for cid in [pod, *cids]:
        assert not os.path.exists(quark_state(cd, cid)), cid
    assert not [ns for ns in os.listdir("/var/run/netns") if ns in netns]
    cgroups = [f"/sys/fs/cgroup/{h}{config.linux.cgroup_parent}/{cid}" for h in os.listdir("/sys/fs/cgroup")
               for cid in [pod, *cids]]
    assert [c for c in cgroups if os.path.exists(c)] == []
    wait_for("the pod's shim to exit", lambda: not cd.shim_pids())
    leftover = [p for p in _proc_cmdlines() if pod in p or any(c in p for c in cids)]
    assert leftover == []


def _proc_cmdlines() -> list[str]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                out.append(open(f"/proc/{entry}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace"))
            except OSError:
                pass
    return out


def test_bad_container_specs_give_clear_grpc_errors(cri):
    pod, config = cri.run_pod("bad", "quark")
    with pytest.raises(grpc.RpcError) as e:
        cri.create_container(pod, config, "noimage", "quark.test/not-there:1", ["true"])
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "quark.test/not-there:1" in e.value.details()
    # a spec the runtime must refuse: the program does not exist in the image
    cid = cri.create_container(pod, config, "noprog", IMAGE, ["/no/such/program"])
    with pytest.raises(grpc.RpcError) as e:
        cri.start_container(cid)
    assert "/no/such/program" in e.value.details(), e.value.details()
    assert cri.container_status(cid).state != pb.CONTAINER_RUNNING
    # the pod is not harmed
    ok = cri.create_container(pod, config, "ok", IMAGE, ["sleep", "300"])
    cri.start_container(ok)
    assert cri.exec_sync(ok, ["echo", "fine"]).stdout == b"fine\n"
    # and goes away whole (the failed container's task was once left "created" and blocked this)
    cri.teardown_pod(pod)
    assert cri.list_pods() == [] and cri.list_containers() == []


def test_exit_codes_stop_and_oom_reasons(cri):
    pod, config = cri.run_pod("reasons", "quark")
    failing = create(cri, pod, config, "failing", ["sh", "-c", "echo bye; exit 3"])
    cri.start_container(failing)
    assert exited(cri, failing) == (3, "Error")
    # StopContainer sends SIGTERM and waits up to the timeout: a handler that exits 0 is "Completed"
    graceful = create(cri, pod, config, "graceful", ["sh", "-c", "trap 'echo got-term; exit 0' TERM; "
                                                                "while true; do sleep 0.1; done"])
    cri.start_container(graceful)
    time.sleep(0.5)
    cri.call("StopContainer", pb.StopContainerRequest(container_id=graceful, timeout=20))
    assert exited(cri, graceful) == (0, "Completed")
    assert wait_for("got-term in the log", lambda: "got-term\n" in log_text(config, "graceful"))
    cri.call("RemoveContainer", pb.RemoveContainerRequest(container_id=graceful))
    assert graceful not in [c.id for c in cri.list_containers(pod)]
    # over its memory limit: killed by the kernel's OOM killer, reported as kubelet expects
    hog = create(cri, pod, config, "hog", ["sh", "-c", "echo start; x=$(head -c 200000000 /dev/zero | tr '\\0' a)"],
                 linux=pb.LinuxContainerConfig(resources=pb.LinuxContainerResources(memory_limit_in_bytes=32 << 20)))
    cri.start_container(hog)
    assert exited(cri, hog) == (137, "OOMKilled")


def test_pod_and_container_config_reach_the_container(cd, cri):
    sandbox = cri.sandbox_config("conf")
    sandbox.dns_config.servers.append("10.215.15.53")
    sandbox.dns_config.searches.append("svc.cluster.local")
    os.makedirs(sandbox.log_directory, exist_ok=True)
    pod = cri.call("RunPodSandbox", pb.RunPodSandboxRequest(config=sandbox, runtime_handler="quark")).pod_sandbox_id
    host_dir = cd.base / "volume"
    host_dir.mkdir(mode=0o755)
    (host_dir / "f").write_text("from-the-host\n")
    cid = create(cri, pod, sandbox, "main", ["sleep", "300"], envs=[pb.KeyValue(key="FOO", value="bar")],
                 mounts=[pb.Mount(container_path="/data", host_path=str(host_dir), readonly=True)],
                 linux=pb.LinuxContainerConfig(security_context=pb.LinuxContainerSecurityContext(
                     run_as_user=pb.Int64Value(value=1000))))
    cri.start_container(cid)
    assert cri.exec_sync(cid, ["cat", "/etc/resolv.conf"]).stdout == \
        b"search svc.cluster.local\nnameserver 10.215.15.53\n"
    r = cri.exec_sync(cid, ["sh", "-c", "hostname; echo $FOO; id -u; cat /data/f; touch /data/x"])
    assert r.stdout == b"conf\nbar\n1000\nfrom-the-host\n" and b"Read-only file system" in r.stderr, r


def test_update_container_resources(cri):
    pod, config = cri.run_pod("update", "quark")
    cid = create(cri, pod, config, "main", ["sleep", "300"], linux=pb.LinuxContainerConfig(
        resources=pb.LinuxContainerResources(memory_limit_in_bytes=128 << 20, cpu_period=100000, cpu_quota=50000)))
    cri.start_container(cid)
    limit = ["cat", "/sys/fs/cgroup/memory/memory.limit_in_bytes"] if not os.path.exists(
        "/sys/fs/cgroup/cgroup.controllers") else ["cat", "/sys/fs/cgroup/memory.max"]
    assert cri.exec_sync(cid, limit).stdout == b"134217728\n"
    cri.call("UpdateContainerResources", pb.UpdateContainerResourcesRequest(
        container_id=cid, linux=pb.LinuxContainerResources(memory_limit_in_bytes=64 << 20, cpu_period=100000,
                                                           cpu_quota=20000)))
    assert cri.exec_sync(cid, limit).stdout == b"67108864\n"


def test_tty_container_output_reaches_the_log(cri):
    pod, config = cri.run_pod("ttyc", "quark")
    cid = create(cri, pod, config, "t", ["sh", "-c", "tty; echo tty-out; exec sleep 300"], tty=True, stdin=True)
    cri.start_container(cid)
    assert wait_for("the terminal's output in the log", lambda: "tty-out" in log_text(config, "t"))
    assert log_text(config, "t").startswith("/dev/pts/")


def test_containerd_restart_keeps_pods(cd, cri):
    pod, config = cri.run_pod("restart", "quark")
    cid = cri.create_container(pod, config, "main", IMAGE, ["sleep", "300"])
    cri.start_container(cid)
    cd.restart()
    with CheckedCri(cd) as again:   # a new connection, as kubelet's after containerd restarts
        assert cri_state(again, pod) == pb.SANDBOX_READY
        assert {c.id: c.state for c in again.list_containers(pod)} == {cid: pb.CONTAINER_RUNNING}
        assert again.exec_sync(cid, ["echo", "alive"]).stdout == b"alive\n"
        again.teardown_pod(pod)
        assert again.list_pods() == []


@pytest.mark.parametrize("kind", ["shared-pid", "host-network"])
def test_pod_namespace_options(cri, kind):
    # shareProcessNamespace: the pod's containers see each other and the pause process; hostNetwork:
    # no pod netns, no pod IP, the node's interfaces (kubelet leaves such a pod's hostname empty)
    ns = (pb.NamespaceOption(network=pb.POD, pid=pb.POD, ipc=pb.POD) if kind == "shared-pid"
          else pb.NamespaceOption(network=pb.NODE, pid=pb.CONTAINER, ipc=pb.POD))
    sandbox = cri.sandbox_config(kind)
    sandbox.linux.security_context.namespace_options.CopyFrom(ns)
    if kind == "host-network":
        sandbox.hostname = ""
    os.makedirs(sandbox.log_directory, exist_ok=True)
    pod = cri.call("RunPodSandbox", pb.RunPodSandboxRequest(config=sandbox, runtime_handler="quark")).pod_sandbox_id
    linux = pb.LinuxContainerConfig(security_context=pb.LinuxContainerSecurityContext(namespace_options=ns))
    cids = [create(cri, pod, sandbox, n, ["sleep", secs], linux=linux) for n, secs in (("a", "301"), ("b", "302"))]
    for cid in cids:
        cri.start_container(cid)
    procs = cri.exec_sync(cids[1], ["ps", "-o", "args"]).stdout.decode().split("\n")
    addrs = cri.exec_sync(cids[1], ["ip", "-4", "-o", "addr"]).stdout.decode()
    ip = cri.pod_status(pod).status.network.ip
    if kind == "shared-pid":
        assert {"/pause", "sleep 301", "sleep 302"} <= set(procs), procs
        assert f"inet {ip}/" in addrs
    else:
        assert "sleep 301" not in procs and "sleep 302" in procs
        assert ip == "" and f"{cri_env.BRIDGE}    inet " in addrs, addrs


def cri_state(cri, pod: str) -> int:
    return cri.pod_status(pod).status.state


FAKE_QUARK_CNI = """#!/usr/bin/python3
# stands in for quark-cni: records each call, passes prevResult through (as quark-cni's ADD does)
import json, os, sys
conf = json.load(sys.stdin)
cmd = os.environ.get("CNI_COMMAND", "")
with open(%r, "a") as log:
    ips = " ".join(ip["address"] for ip in conf.get("prevResult", {}).get("ips", []))
    log.write(f"{cmd} {os.environ.get('CNI_CONTAINERID', '')} {os.environ.get('CNI_NETNS', '')} "
              f"{conf.get('failOpen')} {ips}\\n")
if cmd == "VERSION":
    print(json.dumps({"cniVersion": "1.0.0", "supportedVersions": ["0.4.0", "1.0.0"]}))
elif cmd == "ADD":
    print(json.dumps(conf["prevResult"]))
"""


def test_quark_cni_is_chained_after_bridge_when_present(tmp_path):
    # the hook for quark-cni: when a working one is installed it runs after bridge + host-local
    # with their result, on ADD and DEL of every pod
    log = tmp_path / "calls.log"
    plugin = tmp_path / "quark-cni"
    plugin.write_text(FAKE_QUARK_CNI % str(log))
    plugin.chmod(0o755)
    assert cri_env.conflist(None)["plugins"][-1]["type"] == "bridge"
    d = cri_env.CriContainerd(quark_cni_path=str(plugin))
    try:
        d.start()
        d.import_images()
        with CheckedCri(d) as cri:
            pod, _ = cri.run_pod("chained", "quark")
            ip = cri.pod_status(pod).status.network.ip
            cri.teardown_pod(pod)
    finally:
        d.close()
    calls = [line.split() for line in log.read_text().splitlines()]
    # DEL comes more than once (containerd 1.6: at StopPodSandbox, and again, without a netns, at
    # RemovePodSandbox): quark-cni's DEL must succeed when repeated
    cmds = [c[:2] for c in calls if c[0] != "VERSION"]
    assert cmds[0] == ["ADD", pod] and len(cmds) >= 2 and set(map(tuple, cmds[1:])) == {("DEL", pod)}, calls
    add = next(c for c in calls if c[0] == "ADD")
    assert add[2].startswith("/var/run/netns/cni-") and add[3] == "True" and add[4] == f"{ip}/24"


def test_cleanup_after_containerd_is_killed():
    # the test set-up's own promise: even when containerd dies under running pods (both runtimes),
    # closing it leaves no process, mount, netns, bridge or cgroup behind
    d = cri_env.CriContainerd(with_quark_cni=False)
    try:
        d.start()
        d.import_images()
        with CheckedCri(d) as cri:
            for handler in ("quark", "runc"):
                pod, config = cri.run_pod(f"killed-{handler}", handler)
                cri.start_container(cri.create_container(pod, config, "main", IMAGE, ["sleep", "777"]))
        d.proc.kill()
        d.proc.wait()
    finally:
        base = str(d.base)
        made = set(re.findall(r"/var/run/netns/(cni-[0-9a-f-]+)", d.log_tail(lines=10**9)))
        d.close()
    assert len(made) == 2
    assert [p for p in _proc_cmdlines() if base in p or p.startswith("sleep 777")] == []
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        assert [line for line in f if base in line] == []
    assert made.isdisjoint(os.listdir("/var/run/netns"))
    assert not os.path.exists(f"/sys/class/net/{cri_env.BRIDGE}")
    assert [h for h in os.listdir("/sys/fs/cgroup") if os.path.exists(f"/sys/fs/cgroup/{h}{d.cgroup_parent}")] == []
