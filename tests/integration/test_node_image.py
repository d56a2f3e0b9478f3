"""The node image (`make image`, deploy/image.py), built from this tree and run as a cluster runs it.

- The same tree builds the same image, digest for digest; its layers are the slim Debian base and
  the payload at /opt/quark, file for file.
- On a fresh Debian 12 node (tests/support/fresh_node.py: containerd, runc, the CNI plugins, no
  Python), the image is imported into the node's containerd and deploy/daemonset.yaml's pod runs
  through CRI as kubelet runs it (tests/support/kubelet.py: hostNetwork, hostPID, privileged, the
  hostPath volumes, the ConfigMap of the manifest and the Secret as files, NODE_NAME from the
  downward API, the service account against an HTTPS API stand-in): the init container installs
  quark and restarts containerd through `systemctl` in the host's namespaces, labels the node, and
  tsord serves from the image with its routes from the API. Two quark pods then talk over TSoR.
- Upgrade: the DaemonSet moved to an image of the next version, as a rolling update does it (the
  old pod deleted, the new one run): the quark pods keep running and their open connection keeps
  carrying data; a pod created afterwards is created by the new quark, and the new tsord carries
  its connection.
- deploy/cleanup/daemonset.yaml's pod then takes quark off: the label is gone and every file of
  the node is as it was, but for the empty directories the hostPath volumes made (as kubelet
  leaves them; docs/kubernetes.md, "Removing quark").
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from qlib.version import VERSION
from tests.support import fresh_node

try:
    from tests.integration import containerd_env as ce, cri_env
except ImportError:  # pytest put tests/integration itself on sys.path
    import containerd_env as ce
    import cri_env

REPO = Path(__file__).resolve().parents[2]
SUITE = "bookworm"
NEXT = VERSION + ".post1"   # the upgrade's image: this tree stamped as the next version


def _skip() -> str | None:
    from deploy import image
    return (cri_env.skip_reason() or fresh_node.skip_reason(SUITE)
            or (None if os.path.exists(REPO / "qkernel/_fastpath.so") else "the fast path is not built (make install)")
            or (None if image.base_tarball_if_built() else
                "the image's base layer is not built (make node-root builds it with mmdebstrap)"))


SKIP = _skip() if os.geteuid() == 0 else "needs root (namespaces, mounts, cgroups)"
pytestmark = [pytest.mark.root, pytest.mark.timeout(1500), pytest.mark.skipif(SKIP is not None, reason=SKIP or "")]
if SKIP is None:
    from tests.integration.test_cri import wait_for
    from tests.integration.test_node_install import IMAGE, NETWORK, NodeCri, sandbox_image
    from tests.support import fake_kube_api as k8s
    from tests.support import kubelet


def build_image(out: Path, version: str) -> tuple[Path, Path]:
    """(the payload, the image archive) of this tree, stamped `version`, as `make image` builds them."""
    payload, archive = out / "payload", out / f"quark-node-{version}.oci.tar"
    for argv in ([sys.executable, str(REPO / "deploy/payload.py"), "--version", version, str(payload)],
                 [sys.executable, "-m", "deploy.image", "--payload", str(payload), "--version", version,
                  "--out", str(archive)]):
        r = subprocess.run(argv, capture_output=True, text=True, cwd=REPO)
        assert r.returncode == 0, r.stderr[-3000:]
    return payload, archive


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    return {v: build_image(tmp_path_factory.mktemp(f"image-{v}"), v) for v in (VERSION, NEXT)}


def read_archive(path: Path) -> dict[str, bytes]:
    with tarfile.open(path) as t:
        return {m.name: t.extractfile(m).read() for m in t.getmembers() if m.isfile()}


def test_the_same_tree_builds_the_same_image_of_base_and_payload(images, tmp_path):
    payload, archive = images[VERSION]
    _, again = build_image(tmp_path, VERSION)
    assert hashlib.sha256(again.read_bytes()).digest() == hashlib.sha256(archive.read_bytes()).digest()

    files = read_archive(archive)
    index = json.loads(files["index.json"])
    (desc,) = index["manifests"]
    assert desc["annotations"]["io.containerd.image.name"] == f"docker.io/quark/node:{VERSION}"
    manifest = json.loads(files["blobs/sha256/" + desc["digest"].split(":")[1]])
    config = json.loads(files["blobs/sha256/" + manifest["config"]["digest"].split(":")[1]])
    assert config["config"]["Labels"]["org.opencontainers.image.version"] == VERSION
    assert json.loads(files["manifest.json"])[0]["RepoTags"] == [f"quark/node:{VERSION}"]   # docker load's
    base, top = (tarfile.open(fileobj=io.BytesIO(files["blobs/sha256/" + layer["digest"].split(":")[1]]))
                 for layer in manifest["layers"])
    names = set(base.getnames())
    # what the installer (nsenter) and the cleanup pod (sleep) run from the base
    assert {"./usr/bin/nsenter", "./usr/bin/sleep", "./usr/bin/sh"} <= names or \
        {"./usr/bin/nsenter", "./bin/sleep", "./bin/sh"} <= names, sorted(names)[:50]
    assert not any(n.startswith("./usr/share/man/") and n.count("/") > 4 for n in names)   # slim
    # the payload layer is the payload, file for file, owned by root, dated the tree's last commit
    members = {m.name: m for m in top.getmembers()}
    expected = {os.path.join("opt/quark", os.path.relpath(os.path.join(d, n), payload))
                for d, dirs, fs in os.walk(payload) for n in dirs + fs}
    assert set(members) == expected | {"opt", "opt/quark"}
    assert {(m.uid, m.gid, m.uname) for m in members.values()} == {(0, 0, "")}
    assert len({m.mtime for m in members.values()}) == 1
    version_py = top.extractfile(members["opt/quark/lib/python3/dist-packages/qlib/version.py"]).read().decode()
    assert f'VERSION = "{VERSION}"' in version_py


# ---- the DaemonSet on a node ---------------------------------------------------------------------
NODE = "node-a"
API_IP = "10.96.0.1"   # the `kubernetes` Service's ClusterIP in a default cluster
NAMESPACE = "quark-system"
SRV_PORT = 9000


class Bed:
    """The node, the API stand-in in its network namespace (HTTPS), the images imported, CRI."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.api, self.cri = tmp, None, None
        self.node = fresh_node.FreshNode(tmp, SUITE, name=NODE)

    def start(self, images: dict[str, tuple[Path, Path]]) -> None:
        from tsor.kernel_sockets import socket_at
        n = self.node
        n.unpack()
        n.write("/etc/cni/net.d/10-cbr0.conflist", json.dumps(NETWORK, indent=2) + "\n")
        n.write("/usr/bin/systemctl", fresh_node.SYSTEMCTL, 0o755)
        n.restrict_oom_score_adj()   # the DaemonSet's pods run on runc
        n.start()
        listener = socket_at(f"/proc/{n.pid}/ns/net")
        # the API server's Service address, reached from the host network and from pods alike: a
        # ClusterIP that is a local address of the node, as kube-proxy's IPVS mode makes it (there on
        # a dummy device, kube-ipvs0; this kernel has no dummy driver, so on the node's loopback)
        n.run(["ip", "addr", "add", f"{API_IP}/32", "dev", "lo"])
        listener.bind((API_IP, 0))
        listener.listen(16)
        tls = k8s.make_tls(str(self.tmp), API_IP)
        self.api = k8s.FakeKubeAPI(listener, tls=tls)
        self.api.put("nodes", k8s.node(NODE, "10.88.0.1", [NETWORK["plugins"][0]["ipam"]["ranges"][0][0]["subnet"]]))
        self.sa = k8s.write_service_account(str(self.tmp / "serviceaccount"), tls[0], NAMESPACE)
        tars = [cri_env.pause_image_tar(self.tmp / "pause.tar", sandbox_image(n)),
                ce.busybox_image_tar(self.tmp / "bb.tar", IMAGE)] + [archive for _, archive in images.values()]
        for tar in tars:
            n.path(f"/tmp/{tar.name}").write_bytes(tar.read_bytes())
            n.run(["ctr", "-n", "k8s.io", "images", "import", f"/tmp/{tar.name}"], timeout=300)
            n.path(f"/tmp/{tar.name}").unlink()
        self.pods = NodeCri(n)   # quark pods, as tests/integration/test_node_install.py runs them
        self.cri = self.pods.client

    def close(self) -> None:
        try:
            if self.cri is not None:
                try:
                    self.cri.remove_all_pods()
                finally:
                    self.cri.close()
        finally:
            if self.api is not None:
                self.api.stop()
            self.node.close()

    def metrics(self) -> dict[str, float]:
        """tsord's metrics, from the node's loopback (the ConfigMap's `metrics: 127.0.0.1:9470`)."""
        from tsor.metrics import parse
        r = self.node.run(["/opt/quark/bin/python3", "-c", "import urllib.request; print(urllib.request.urlopen("
                           "'http://127.0.0.1:9470/metrics', timeout=5).read().decode())"], check=False)
        return parse(r.stdout) if r.returncode == 0 else {}

    def label(self) -> str | None:
        return self.api.objects["nodes"][("", NODE)]["metadata"].get("labels", {}).get("quark.io/runtime")

    def states(self, cid: str) -> list[dict]:
        """quark's state of container `cid` on the node (under the shim's --root)."""
        return [json.loads(p.read_text()) for p in self.node.path("/run").rglob(f"{cid}/state.json")]


@pytest.fixture
def bed(images, tmp_path):
    b = Bed(tmp_path)
    try:
        b.start(images)
        yield b
    finally:
        print(b.node.log()[-6000:])   # shown when the test fails
        b.close()


LOCAL = 'tsor_connections_total{path="local"}'
RUNNING = 1   # CRI's CONTAINER_RUNNING


def test_daemonset_installs_serves_upgrades_and_cleans_up_a_fresh_node(bed, images):
    from deploy import install
    root, node = bed.node.root, bed.node
    before = fresh_node.snapshot(root)
    docs = kubelet.load_manifests(REPO / "deploy/daemonset.yaml")
    _, template = kubelet.daemonset_template(docs, "quark-node")
    configmap = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "quark-tsor")
    objects = {("ConfigMap", NAMESPACE, "quark-tsor"): configmap["data"],
               ("Secret", NAMESPACE, "quark-tsor-secret"): {"tsor-secret": "c2VjcmV0LXNlY3JldC1zZWNyZXQtc2VjcmV0LXNl\n"}}
    runner = kubelet.PodRunner(node, bed.cri, NODE, objects, api=(API_IP, bed.api.port),
                               service_account=bed.sa)

    # v1: the init container installs (one containerd restart), labels the node; tsord serves
    containerd = node.containerd_pid()
    v1 = runner.run(template, "quark-node-v1", NAMESPACE)
    assert "quark-install: installed" in runner.log(v1, "install"), runner.log(v1, "install")
    assert node.containerd_pid() != containerd
    node.wait_containerd()
    assert bed.label() == "true"
    assert node.run(["/opt/quark/bin/quark", "--version"]).stdout.startswith(f"quark {VERSION} ")
    shim = "bin/containerd-shim-quark-v1"
    assert os.readlink(root / "usr/local" / shim) == f"{install.QUARK_HOME}/{shim}"
    # quark's host configuration from the ConfigMap: the node's sandbox factory never exits when idle
    assert (root / "etc/quark/config.yaml").read_text() == configmap["data"]["config.yaml"]
    assert "idle_seconds: 0" in configmap["data"]["config.yaml"]
    wait_for("tsord's metrics", bed.metrics, timeout=120)
    assert runner.status(v1.containers["tsord"]).state == RUNNING

    # two quark pods; the client keeps one connection to the server's echo open
    cri = bed.pods
    srv, srv_conf, srv_ip = cri.run_pod("srv")
    cli, cli_conf, cli_ip = cri.run_pod("cli")
    for name, ip in (("srv", srv_ip), ("cli", cli_ip)):
        bed.api.put("pods", k8s.pod(name, [ip], NODE))
    echo = cri.run(srv, srv_conf, "srv", ["nc", "-ll", "-p", str(SRV_PORT), "-e", "cat"])
    wait_for("the echo server", lambda: bed.cri.exec_sync(
        echo, ["sh", "-c", f"netstat -ltn | grep -q :{SRV_PORT}"]).exit_code == 0, timeout=120)
    local_before = bed.metrics().get(LOCAL, 0.0)
    client = cri.run(cli, cli_conf, "cli", ["sh", "-c", f"touch /in; tail -f /in | nc {srv_ip} {SRV_PORT} > /out"])

    def said(word: str) -> bool:
        bed.cri.exec_sync(client, ["sh", "-c", f"echo {word} >> /in"])
        return wait_for(f"{word!r} echoed", lambda: word in bed.cri.exec_sync(client, ["cat", "/out"]).stdout.decode(),
                        timeout=60)

    try:
        wait_for("the client's connection", lambda: bed.metrics().get(LOCAL, 0.0) == local_before + 1, timeout=60)
    except AssertionError:
        raise AssertionError(f"{bed.metrics()}\n{runner.log(v1, 'tsord')[-4000:]}") from None
    assert said("one")
    assert [s["version"] for s in bed.states(client)] == [VERSION]

    # a program of v1 that imports a module and loads a library only after the upgrade (as a
    # supervisor does for a hibernation, a shim for a pod's next container)
    probe_log = "/run/probe.log"
    node.spawn(["/opt/quark/bin/python3.11", "-c", LATE_IMPORTS], probe_log)

    # the rolling update: the v1 pod deleted (tsord stops), the v2 pod run (the installer puts v2's
    # files beside v1's; containerd's configuration is the same, so no restart)
    runner.delete(v1)
    containerd = node.containerd_pid()
    v2 = runner.run(template, "quark-node-v2", NAMESPACE, image=f"quark/node:{NEXT}")
    assert node.containerd_pid() == containerd
    assert node.run(["/opt/quark/bin/quark", "--version"]).stdout.startswith(f"quark {NEXT} ")
    wait_for("v2's tsord", bed.metrics, timeout=120)
    # the pods kept running, and their connection carries data still
    assert bed.cri.container_status(client).state == bed.cri.container_status(echo).state == RUNNING
    assert said("two")
    # v1's programs import and load v1's files still; v1's tree stays while they run
    trees = {v: (images[v][0] / "PAYLOAD_ID").read_text().strip() for v in (VERSION, NEXT)}
    assert sorted(os.listdir(root / "opt/quark/versions")) == sorted(trees.values())
    node.run(["touch", "/run/probe-go"])
    late = wait_for("the probe's late imports", lambda: node.path(probe_log).read_text().split(), timeout=60)
    assert late[0] == VERSION and len(late) >= 3, late
    assert all(p.startswith(f"/opt/quark/versions/{trees[VERSION]}/") for p in late[1:]), late
    # a pod created now is created by v2's quark, and v2's tsord carries its connection
    new, new_conf, new_ip = cri.run_pod("cli2")
    bed.api.put("pods", k8s.pod("cli2", [new_ip], NODE))
    local_before = bed.metrics().get(LOCAL, 0.0)
    one_shot = cri.run(new, new_conf, "cli2", ["sh", "-c", f"(echo three; sleep 1) | nc {srv_ip} {SRV_PORT}"])
    assert wait_for("cli2's answer", lambda: cri.log(new_conf, "cli2"), timeout=120) == "three\n"
    assert bed.metrics().get(LOCAL, 0.0) == local_before + 1
    assert [s["version"] for s in bed.states(one_shot)] == [NEXT]
    assert [s["version"] for s in bed.states(client)] == [VERSION]   # the old pod, on the old quark

    # quark's pods gone, the quark-node DaemonSet deleted, the cleanup DaemonSet run
    for pod in (srv, cli, new):
        bed.cri.teardown_pod(pod)
    runner.delete(v2)
    docs = kubelet.load_manifests(REPO / "deploy/cleanup/daemonset.yaml")
    _, cleanup_template = kubelet.daemonset_template(docs, "quark-cleanup")
    containerd = node.containerd_pid()
    cleanup = runner.run(cleanup_template, "quark-cleanup-1", NAMESPACE)
    assert "quark-install: removed" in runner.log(cleanup, "uninstall"), runner.log(cleanup, "uninstall")
    assert node.containerd_pid() != containerd
    node.wait_containerd()
    assert bed.label() is None
    runner.delete(cleanup)

    after = fresh_node.snapshot(root)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    host_paths = {v["hostPath"]["path"].lstrip("/") for t in (template, cleanup_template)
                  for v in t["spec"]["volumes"] if "hostPath" in v}
    made = {p for hp in host_paths for p in _parents(hp)}
    assert all(k in made and k not in before and after[k][0] == 0o040000 for k in changed), changed
    # empty but for each other
    assert all(os.path.join(k, child) in changed for k in changed for child in os.listdir(root / k)), changed


LATE_IMPORTS = """
import os, time
while not os.path.exists("/run/probe-go"):
    time.sleep(0.05)
import _ssl
from qlib import version
print(version.VERSION, version.__file__, *sorted({m.split()[-1] for m in open("/proc/self/maps") if "libssl" in m}))
"""


def _parents(path: str) -> list[str]:
    parts = path.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
