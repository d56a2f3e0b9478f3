"""quark installed on a fresh node, as the DaemonSet's installer does it, and taken off again.

The node (tests/support/fresh_node.py) is a Debian root from Debian's archive with only containerd,
runc, the CNI plugins and iproute2 — no Python — booted in namespaces of its own (Debian 12, and
Debian 13, whose glibc is newer than the one the payload brings), with a bridge +
host-local network configuration as a cluster's network plugin leaves one. The payload is built
from this tree (deploy/payload.py) and installed with --host-root, as the init container does; then,
on the node, containerd runs two pods with handler `quark` through CRI (the project's grpcio client),
tsord runs from /opt/quark, and one pod reaches the other's server through quark-cni's registration
and TSoR's local path. The uninstall puts every file of the root back as it was.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from tests.support import fresh_node

try:
    from tests.integration import containerd_env as ce, cri_env
except ImportError:  # pytest put tests/integration itself on sys.path
    import containerd_env as ce
    import cri_env

REPO = Path(__file__).resolve().parents[2]
SKIP = cri_env.skip_reason() or (
    None if os.path.exists(REPO / "qkernel/_fastpath.so") else "the fast path is not built (make install)")
pytestmark = [pytest.mark.root, pytest.mark.timeout(900), pytest.mark.skipif(SKIP is not None, reason=SKIP or "")]
if SKIP is None:
    from tests.integration.test_cri import log_text, wait_for
    from tests.support.cri import cri_v1_pb2 as pb

IMAGE = cri_env.BUSYBOX_IMAGE
SUBNET = "10.88.0.0/16"
NETWORK = {"cniVersion": "1.0.0", "name": "cbr0", "plugins": [
    {"type": "bridge", "bridge": "cni0", "isGateway": True, "ipMasq": True, "hairpinMode": True,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": SUBNET}]], "routes": [{"dst": "0.0.0.0/0"}]}},
    {"type": "portmap", "capabilities": {"portMappings": True}}]}
TSOR_YAML = {"node": "node-a", "socket": "/run/quark/tsord.sock", "metrics": "unix:/run/quark/metrics.sock",
             "state_dir": "/run/quark/tsord"}
LOCAL = 'tsor_connections_total{path="local"}'


@pytest.fixture(scope="module")
def payload(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("payload") / "opt-quark"
    r = subprocess.run([sys.executable, str(REPO / "deploy/payload.py"), str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(params=fresh_node.SUITES)
def node(request, tmp_path):
    reason = fresh_node.skip_reason(request.param)
    if reason:
        pytest.skip(reason)
    n = fresh_node.FreshNode(tmp_path, request.param)
    try:
        n.unpack()
        n.write("/etc/cni/net.d/10-cbr0.conflist", json.dumps(NETWORK, indent=2) + "\n")
        n.start()
        yield n
    finally:
        print(n.log()[-6000:])   # shown when the test fails
        n.close()


def installer(node, payload: Path, *args: str, config: Path | None = None) -> subprocess.CompletedProcess:
    """deploy/install.py against the node's root, as the init container runs it."""
    argv = [sys.executable, "-m", "deploy.install", "--host-root", str(node.root), "--payload", str(payload),
            "--host-pid", str(node.pid), "--restart-containerd", fresh_node.RESTART, *args]
    if config:
        argv += ["--config", str(config)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=REPO)


def restarted(node, before: int) -> int:
    """containerd's new pid, once the node's init has restarted it and it answers."""
    deadline = time.monotonic() + 60
    while node.containerd_pid() == before:
        assert time.monotonic() < deadline, "containerd was not restarted"
        time.sleep(0.1)
    node.wait_containerd()
    return node.containerd_pid()


class NodeCri:
    """CRI on the node's containerd socket; logs and cgroups in the node's own view."""

    def __init__(self, node) -> None:
        from tests.support.cri.client import CriClient
        self.node = node
        self.client = CriClient(str(node.path("/run/containerd/containerd.sock")), cgroup_parent="/kubepods",
                                log_root="/tmp/pods")

    def run_pod(self, name: str, handler: str = "quark"):
        config = self.client.sandbox_config(name)
        self.node.path(config.log_directory).mkdir(parents=True)
        pod = self.client.call("RunPodSandbox", pb.RunPodSandboxRequest(config=config, runtime_handler=handler))
        return pod.pod_sandbox_id, config, self.client.pod_status(pod.pod_sandbox_id).status.network.ip

    def run(self, pod, config, name: str, command: list[str]) -> str:
        cid = self.client.create_container(pod, config, name, IMAGE, command, envs={"NAME": name})
        self.client.start_container(cid)
        return cid

    def log(self, config, name: str) -> str:
        return log_text(config, name, root=f"/proc/{self.node.pid}/root")


def sandbox_image(node) -> str:
    """The pause image the node's containerd runs pods with (its version's default)."""
    dump = tomllib.loads(node.run(["containerd", "config", "dump"]).stdout)
    return dump["plugins"]["io.containerd.grpc.v1.cri"]["sandbox_image"]


def metrics(node) -> dict[str, float]:
    from tsor.metrics import fetch, parse
    return parse(fetch(str(node.path("/run/quark/metrics.sock"))))


def test_install_on_a_fresh_node_run_quark_pods_through_cri_and_uninstall(node, payload, tmp_path):
    root = node.root
    assert not list((root / "usr/bin").glob("python*")) and not (root / "usr/lib/python3").exists()
    before = fresh_node.snapshot(root)
    config = tmp_path / "config"
    config.mkdir()
    (config / "tsor.yaml").write_text(json.dumps(TSOR_YAML))
    (config / "tsor-secret").write_text("s" * 32)

    # install: payload, quark's runtimes in containerd's config, quark-cni linked and chained, tsor
    # config, one containerd restart
    pid = node.containerd_pid()
    r = installer(node, payload, config=config)
    assert r.returncode == 0, r.stdout + r.stderr
    pid = restarted(node, pid)
    assert (root / "opt/quark/bin/quark").exists() and os.readlink(root / "usr/lib/cni/quark-cni") == \
        "/opt/quark/bin/quark-cni"
    chained = json.loads((root / "etc/cni/net.d/10-cbr0.conflist").read_text())
    assert chained["plugins"][:2] == NETWORK["plugins"] and chained["plugins"][2]["type"] == "quark-cni"
    assert os.readlink(root / "usr/local/bin/containerd-shim-quark-v1") == "/opt/quark/bin/containerd-shim-quark-v1"
    runtimes = tomllib.loads((root / "etc/containerd/config.toml").read_text())["plugins"][
        "io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]
    assert runtimes["quark"]["runtime_type"] == "io.containerd.quark.v1" and "runc" in runtimes
    assert oct((root / "etc/quark/tsor-secret").stat().st_mode & 0o777) == "0o600"
    # again: nothing changes, nothing restarts
    r = installer(node, payload, config=config)
    assert r.returncode == 0 and "0 paths changed, 0 host commands" in r.stdout, r.stdout + r.stderr
    assert node.containerd_pid() == pid

    # the node's containerd, with the node's own configuration and quark's runtimes (its CRI plugin
    # loads only while the default runtime, runc, is still configured: the pods below show it did)
    images = tmp_path / "images"
    images.mkdir()
    pause = sandbox_image(node)   # under the name the node's containerd looks for (nothing is pulled)
    for tar in (cri_env.pause_image_tar(images / "pause.tar", pause), ce.busybox_image_tar(images / "bb.tar", IMAGE)):
        node.path(f"/tmp/{tar.name}").write_bytes(tar.read_bytes())
        node.run(["ctr", "-n", "k8s.io", "images", "import", f"/tmp/{tar.name}"])
    tsord = node.spawn(["/opt/quark/bin/tsord", "--config", "/etc/quark/tsor.yaml", "--debug"], "/run/tsord.log")
    wait_for("tsord", lambda: node.path("/run/quark/metrics.sock").exists(), timeout=120)

    cri = NodeCri(node)
    try:
        srv, srv_conf, srv_ip = cri.run_pod("srv")
        cli, cli_conf, _ = cri.run_pod("cli")
        registered = json.loads(node.path("/run/quark/tsord/pods.json").read_text())["pods"]
        assert {p["sandbox"] for p in registered} == {srv, cli}   # quark-cni's ADD, chained by the installer
        httpd = cri.run(srv, srv_conf, "srv", ["sh", "-c", "mkdir -p /www && echo hello-$NAME > /www/index.html "
                                                           "&& exec httpd -f -p 8080 -h /www"])
        wait_for("httpd", lambda: cri.client.exec_sync(httpd, ["sh", "-c", "netstat -ltn | grep -q :8080"]).exit_code == 0,
                 timeout=120)
        before_local = metrics(node).get(LOCAL, 0.0)
        cri.run(cli, cli_conf, "cli", ["sh", "-c", f"wget -qO- http://{srv_ip}:8080/"])
        assert wait_for("the client's answer", lambda: cri.log(cli_conf, "cli"), timeout=120) == "hello-srv\n"
        assert metrics(node).get(LOCAL, 0.0) == before_local + 1, node.path("/run/tsord.log").read_text()[-3000:]
        # the sandboxes run on the payload's Python and libraries, none of the node's: the current
        # version's tree (deploy/versions.py)
        tree = "/opt/quark/" + os.path.realpath(root / "opt/quark/current")[len(str(root / "opt/quark")) + 1:]
        assert tree.startswith("/opt/quark/versions/"), tree
        supervisors = [p for p in Path(f"/proc/{node.pid}/root/proc").iterdir() if p.name.isdigit()
                       and _exe(p) == f"{tree}/bin/python3.11"]
        assert supervisors
        for p in supervisors:
            libs = {line.split()[-1] for line in (p / "maps").read_text().splitlines() if ".so" in line}
            assert libs and all(lib.startswith(tree + "/") for lib in libs), libs
        # no uninstall under running sandboxes: their shims and supervisors run from /opt/quark
        r = installer(node, payload, "--uninstall")
        assert r.returncode == 1 and "quark still runs on this node" in r.stderr, r.stdout + r.stderr
        assert (root / "opt/quark/bin/quark").exists()
        cri.client.remove_all_pods()
    finally:
        cri.client.close()
    node.kill(tsord)   # as deleting the quark-node DaemonSet does

    # uninstall: every file as it was, containerd restarted once more
    r = installer(node, payload, "--uninstall")
    assert r.returncode == 0, r.stdout + r.stderr
    restarted(node, pid)
    after = fresh_node.snapshot(root)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert changed == [], changed[:20]


def _exe(proc: Path) -> str:
    try:
        return os.readlink(proc / "exe")
    except OSError:
        return ""
