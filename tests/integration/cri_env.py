"""A private containerd with its CRI plugin on, for driving pods the way kubelet does.

`CriContainerd` is `containerd_env.Containerd` with the CRI plugin enabled and configured:
runtime handlers `quark` (io.containerd.quark.v1, privileged_without_host_devices and pod_annotations as in
deploy/containerd/quark.toml)
and `runc` (io.containerd.runc.v2); sandbox_image a pause image built here from a static C program;
CNI with its own conf and bin dirs: bridge + host-local (Debian's containernetworking-plugins) on a
subnet and bridge of this worktree's own, plus `quark-cni` chained after them when it is installed
(`QUARK_CNI` names it, else PATH). The stream server (Exec/Attach/PortForward URLs) listens on
127.0.0.1 on a free port. Images are imported with `ctr -n k8s.io images import`; nothing is pulled.

What containerd's CRI makes outside the private tree (pod netns under /var/run/netns, the bridge and
veths, cgroups under its cgroup_parent) is removed by `close`: pods first through CRI, then whatever
is still there.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

try:
    from tests.integration import containerd_env as ce
except ImportError:  # pytest put tests/integration itself on sys.path
    import containerd_env as ce

REPO = str(Path(__file__).resolve().parents[2])
CNI_PLUGIN_DIR = "/usr/lib/cni"          # containernetworking-plugins
GCC = shutil.which("gcc")
NAMESPACE = "k8s.io"                     # the containerd namespace CRI uses
PAUSE_IMAGE = "quark.test/pause:w15f"
BUSYBOX_IMAGE = "quark.test/busybox:w15f"
REDIS_IMAGE = "quark.test/redis:w15i"    # busybox + the host's redis-server/-benchmark (bench/cri_redis.py)
BRIDGE = "qw15f-cri0"                    # names and subnet of our own: other sessions share the host
SUBNET = "10.215.15.0/24"
CGROUP_PARENT = "/quark-w15f-cri"       # each containerd's pods go under CGROUP_PARENT-<its tree's suffix>
NETWORK_NAME = "quark-w15f"

# A pause process as kubelet's pause image has: PID 1 of the pod, exits on SIGINT/SIGTERM, reaps.
PAUSE_C = r"""
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>
static void quit(int s) { (void)s; _exit(0); }
static void reap(int s) { (void)s; while (waitpid(-1, NULL, WNOHANG) > 0) {} }
int main(void) {
    struct sigaction q = {.sa_handler = quit}, r = {.sa_handler = reap, .sa_flags = SA_NOCLDSTOP};
    sigaction(SIGINT, &q, NULL);
    sigaction(SIGTERM, &q, NULL);
    sigaction(SIGCHLD, &r, NULL);
    for (;;) pause();
}
"""


def skip_reason() -> str | None:
    """Why CRI tests cannot run here, or None."""
    reason = ce.skip_reason()
    if reason:
        return reason
    for plugin in ("bridge", "host-local", "loopback"):
        if not os.access(os.path.join(CNI_PLUGIN_DIR, plugin), os.X_OK):
            return f"{CNI_PLUGIN_DIR}/{plugin} missing (apt-get install containernetworking-plugins)"
    if not GCC:
        return "gcc missing (the pause image is compiled here with gcc -static)"
    try:
        import grpc  # noqa: F401
    except ImportError:
        return "grpcio not installed (pip install -e '.[test]')"
    return None


def quark_cni() -> str | None:
    """The quark-cni plugin to chain after bridge, when installed (QUARK_CNI, else PATH)."""
    path = os.environ.get("QUARK_CNI") or shutil.which("quark-cni", path=f"{ce.VENV_BIN}:{os.environ.get('PATH', '')}")
    if not path or not os.access(path, os.X_OK):
        return None
    # present means working: it answers the CNI VERSION command (a console script whose module this
    # checkout lacks does not)
    probe = subprocess.run([path], input=b"{}", capture_output=True, timeout=30,
                           env=dict(os.environ, CNI_COMMAND="VERSION"))
    return path if probe.returncode == 0 and b"supportedVersions" in probe.stdout else None


def tsor_skip_reason() -> str | None:
    """Why TSoR-through-CRI tests cannot run here (skip_reason's, or quark-cni or QKernel's TSoR
    wiring missing), or None."""
    reason = skip_reason()
    if reason:
        return reason
    if quark_cni() is None:
        return "quark-cni is not installed (QUARK_CNI or PATH; pip install -e . provides the console script)"
    import qkernel.request
    if not hasattr(qkernel.request, "InstallFd"):
        return "QKernel's TSoR wiring (fd installation, sys_socket handlers) is not in this tree yet"
    return None


def conflist(quark_cni_path: str | None, quark_cni_conf: dict | None = None, bridge: str = BRIDGE,
             subnet: str = SUBNET) -> dict:
    """The CNI network: bridge + host-local on `subnet`, then quark-cni when given (the hook), with
    `failOpen: true` unless quark_cni_conf (its own keys: failOpen, tsorSocket) says otherwise."""
    plugins: list[dict] = [{
        "type": "bridge", "bridge": bridge, "isGateway": True, "ipMasq": False, "hairpinMode": True,
        "ipam": {"type": "host-local", "ranges": [[{"subnet": subnet}]], "routes": [{"dst": "0.0.0.0/0"}],
                 "dataDir": "DATADIR"},
    }]
    if quark_cni_path:
        plugins.append({"type": "quark-cni", "failOpen": True, **(quark_cni_conf or {})})
    return {"cniVersion": "1.0.0", "name": NETWORK_NAME, "plugins": plugins}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CriContainerd(ce.Containerd):
    """containerd with CRI on (handlers quark and runc), private CNI, locally built images."""

    def __init__(self, with_quark_cni: bool = True, quark_cni_path: str | None = None,
                 shim_dir: str | None = None, quark_cni_conf: dict | None = None, *,
                 bridge: str = BRIDGE, subnet: str = SUBNET, netns: str | None = None) -> None:
        """`quark_cni_conf`: quark-cni's keys in the conflist (e.g. a test's own tsord:
        {"failOpen": False, "tsorSocket": PATH}); default failOpen true, tsord's default socket.
        `netns`: a named network namespace (a "node") containerd runs in (nsenter --net: the mount
        namespace stays the host's, so pod netns under /var/run/netns are seen by everyone); the
        bridge plugin, run by containerd, then makes `bridge` and the pods' veths in there."""
        super().__init__(namespace=NAMESPACE)
        self.bridge, self.subnet, self.netns = bridge, subnet, netns
        if netns:
            self.wrap = ["nsenter", f"--net=/var/run/netns/{netns}", "--"]
        # another containerd-shim-quark-v1 first on containerd's PATH (QUARK_SHIM_DIR, e.g. a main
        # checkout's build/bin: the C front end, served by the sandbox factory)
        shim_dir = shim_dir or os.environ.get("QUARK_SHIM_DIR")
        if shim_dir:
            self.env["PATH"] = f"{shim_dir}:{self.env['PATH']}"
        # short: quark keeps <state>/quark/k8s.io/<64-hex id>/sv.sock, and sun_path holds 107 bytes
        # (/run/containerd, containerd's default, leaves room; a /tmp/qct-* tree must be as short)
        self.state = self.base / "s"
        self.cni_conf = self.base / "cni" / "net.d"
        self.cni_bin = self.base / "cni" / "bin"
        self.cni_conf.mkdir(parents=True)
        self.cni_bin.mkdir(parents=True)
        self.log_dir = self.base / "logs"
        self.cgroup_parent = f"{CGROUP_PARENT}-{self.base.name.removeprefix('qct-')}"
        self.log_dir.mkdir()
        for plugin in os.listdir(CNI_PLUGIN_DIR):
            os.symlink(os.path.join(CNI_PLUGIN_DIR, plugin), self.cni_bin / plugin)
        self.quark_cni = (quark_cni_path or quark_cni()) if with_quark_cni else None
        if self.quark_cni:
            os.symlink(self.quark_cni, self.cni_bin / "quark-cni")
        net = conflist(self.quark_cni, quark_cni_conf, bridge, subnet)
        net["plugins"][0]["ipam"]["dataDir"] = str(self.base / "cni" / "ipam")
        (self.cni_conf / "10-quark-w15f.conflist").write_text(json.dumps(net, indent=2))
        self.stream_port = _free_port()
        self.config.write_text(f"""version = 2
root = "{self.root}"
state = "{self.state}"

[grpc]
  address = "{self.address}"

[debug]
  level = "debug"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  stream_server_address = "127.0.0.1"
  stream_server_port = "{self.stream_port}"
  enable_selinux = false
  # the pause container's oom_score_adj is -998; where this test runs may not lower it (runc then
  # fails "can't get final child's PID"): clamp to containerd's own, as in rootless set-ups
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    default_runtime_name = "runc"
    snapshotter = "overlayfs"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.quark]
      runtime_type = "{ce.RUNTIME}"
      privileged_without_host_devices = true
      pod_annotations = ["io.quark.*"]
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{self.cni_bin}"
    conf_dir = "{self.cni_conf}"
    max_conf_num = 1
""")

    def start(self) -> None:
        """containerd up, then its CRI service too (it answers "server is not initialized yet" while
        it loads its state, e.g. the pods that ran before a restart)."""
        super().start()
        from tests.support.cri.client import CriClient
        deadline = time.monotonic() + 60
        with CriClient(self.address) as cri:
            while True:
                try:
                    cri.list_pods()
                    return
                except Exception as e:  # grpc.RpcError; grpc is imported only where the tests run
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"containerd's CRI did not come up: {e}\n{self.log_tail()}") from None
                    time.sleep(0.1)

    def import_images(self, redis: bool = False) -> None:
        """Build the pause and busybox images (and the redis one, when asked) here and import them
        into the k8s.io namespace."""
        img = self.base / "img"
        img.mkdir(exist_ok=True)
        self.ctr("images", "import", str(pause_image_tar(img / "pause.tar")))
        self.ctr("images", "import", str(ce.busybox_image_tar(img / "busybox.tar", BUSYBOX_IMAGE)))
        if redis:
            self.ctr("images", "import", str(redis_image_tar(img / "redis.tar")), timeout=180)

    def close(self) -> None:
        """Remove every pod through CRI, then stop containerd and remove what CRI left on the host."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                from tests.support.cri.client import CriClient
                with CriClient(self.address) as cri:
                    cri.remove_all_pods()
            except Exception:  # containerd wedged: the sweep below still runs
                pass
        # only the netns this containerd made (its log names each in the CNI result; read before
        # the tree goes): other sessions' containerds make cni-* ones in the same directory
        made = set(re.findall(r"/var/run/netns/(cni-[0-9a-f-]+)", self.log_tail(lines=10**9)))
        self.stop()
        self.kill_leftovers()
        super().close()
        for ns in made:
            if ns in _netns():
                subprocess.run(["umount", f"/var/run/netns/{ns}"], capture_output=True)
                subprocess.run(["ip", "netns", "delete", ns], capture_output=True)
        subprocess.run(["ip", *(["-n", self.netns] if self.netns else []), "link", "delete", self.bridge],
                       capture_output=True)
        remove_cgroups(self.cgroup_parent)
        from tsor import sockopt_offload
        sockopt_offload.remove_if_unused()   # quark's socket cgroup, once nothing is in it (others may be)


    def kill_leftovers(self) -> None:
        """SIGKILL what outlived containerd (killed, or wedged): the processes in its pods' cgroups
        (containers of runc and quark alike) and those naming this tree (quark's supervisors, runc's
        shims)."""
        pids: set[int] = set()
        for procs in Path(f"/sys/fs/cgroup/pids{self.cgroup_parent}").rglob("cgroup.procs"):
            try:
                pids.update(int(p) for p in procs.read_text().split())
            except OSError:
                pass
        marker = str(self.base).encode()
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    if marker in Path(f"/proc/{entry}/cmdline").read_bytes():
                        pids.add(int(entry))
                except OSError:
                    pass
        pids.discard(os.getpid())
        for pid in sorted(pids):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in pids):
            time.sleep(0.05)


@contextlib.contextmanager
def running(env: dict[str, str] | None = None, quark_config: str | None = None, **kw) -> Iterator[CriContainerd]:
    """A CriContainerd(**kw) started (with `env` added to its environment), its images imported;
    closed (everything removed) on leaving. `quark_config`: quark's host configuration (YAML) for
    its shims and their quark (QUARK_CONFIG)."""
    d = CriContainerd(**kw)
    d.env.update(env or {})
    if quark_config is not None:
        path = d.base / "quark-config.yaml"
        path.write_text(quark_config)
        d.env["QUARK_CONFIG"] = str(path)
    try:
        d.start()
        d.import_images()
        yield d
    finally:
        d.close()


def _netns() -> list[str]:
    try:
        return os.listdir("/var/run/netns")
    except FileNotFoundError:
        return []


def remove_cgroups(parent: str) -> None:
    """rmdir parent (and what is under it) in every cgroup v1 hierarchy or the v2 tree."""
    roots = [f"/sys/fs/cgroup/{d}" for d in os.listdir("/sys/fs/cgroup")] if os.path.isdir("/sys/fs/cgroup") else []
    for root in roots + ["/sys/fs/cgroup"]:
        top = Path(root + parent)
        if not top.is_dir():
            continue
        for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(str(p)), reverse=True):
            _rmdir_retry(d)
        _rmdir_retry(top)


def _rmdir_retry(d: Path) -> None:
    for _ in range(20):
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)


REDIS_PROGRAMS = ("/usr/bin/redis-server", "/usr/bin/redis-benchmark")


def redis_image_skip_reason() -> str | None:
    missing = [p for p in REDIS_PROGRAMS if not os.access(p, os.X_OK)]
    return f"{', '.join(missing)} missing (apt-get install redis-server redis-tools)" if missing else None


def redis_image_tar(path: Path, name: str = REDIS_IMAGE) -> Path:
    """The busybox image plus the host's redis-server and redis-benchmark with the shared objects
    `ldd` names for them (built here from what is installed: nothing is pulled)."""
    files: dict[str, tuple[bytes, int]] = {}
    dirs: set[str] = set()
    for prog in REDIS_PROGRAMS:
        files[prog.lstrip("/")] = (Path(prog).read_bytes(), 0o755)
        ldd = subprocess.run(["ldd", prog], capture_output=True, text=True, check=True).stdout
        for lib in re.findall(r"(/\S+\.so[.\d]*) \(0x", ldd):   # "name => /path (0x..)" and "/lib64/ld-..."
            files[lib.lstrip("/")] = (Path(lib).resolve().read_bytes(), 0o755)
            parent = os.path.dirname(lib.lstrip("/"))
            while parent and parent not in dirs:
                dirs.add(parent)
                parent = os.path.dirname(parent)
    return ce.busybox_image_tar(path, name, extra_files=files,
                                extra_dirs=tuple(sorted(d for d in dirs if d not in ("usr", "usr/bin"))))


def pause_image_tar(path: Path, name: str = PAUSE_IMAGE) -> Path:
    """An OCI image layout tar of one static binary /pause (compiled here), entrypoint /pause."""
    src = path.with_suffix(".c")
    exe = path.with_suffix(".bin")
    src.write_text(PAUSE_C)
    subprocess.run([GCC, "-static", "-Os", "-s", "-o", str(exe), str(src)], check=True, capture_output=True)
    return ce.oci_image_tar(path, name, files={"pause": (exe.read_bytes(), 0o755)},
                            dirs=("dev", "proc", "sys", "etc"), entrypoint=["/pause"], cmd=[])


class Tsord:
    """One tsord of a test's (or benchmark's) own, as a node's in the host network namespace, run
    from this checkout (`python -m tsor.daemon`); socket, metrics socket and state_dir under `base`;
    stopped by pid."""

    def __init__(self, base: Path, node: str) -> None:
        self.base, self.node = base, node
        self.socket = str(base / "tsord.sock")
        self.metrics = str(base / "metrics.sock")
        self.state_dir = base / "state"
        self.log_path = base / "tsord.log"
        self.proc: subprocess.Popen | None = None
        self.local_path: str | None = None

    def start(self, kubeconfig: str | None = None, debug: bool = True, local_path: str | None = None) -> None:
        """`debug`: a log line per connection (the tests read them; a benchmark runs without).
        `local_path`: tsor.yaml's (default: tsord's, socketpair)."""
        cfg = self.base / "tsor.yaml"
        self.local_path = local_path
        cfg.write_text(json.dumps({"node": self.node, "socket": self.socket, "metrics": f"unix:{self.metrics}",
                                   "state_dir": str(self.state_dir),
                                   **({"kubernetes": {"kubeconfig": kubeconfig}} if kubeconfig else {}),
                                   **({"local_path": local_path} if local_path else {})}))
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "tsor.daemon", "--config", str(cfg),
                                          *(["--debug"] if debug else [])],
                                         stdout=log, stderr=log, stdin=subprocess.DEVNULL, cwd=REPO,
                                         env=dict(os.environ, PYTHONPATH=REPO))
        deadline = time.monotonic() + 60   # the kubernetes client takes seconds to import on a busy host
        while not (os.path.exists(self.socket) and os.path.exists(self.metrics)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"tsord did not start:\n{self.log()}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is None:
            return
        p, self.proc = self.proc, None
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
        for path in (self.socket, self.metrics):
            if os.path.exists(path):
                os.unlink(path)
        from tsor import sockmap, sockopt_offload
        sockopt_offload.remove_if_unused()
        if self.local_path == "sockmap":   # tsord leaves its programs attached for the connections they carry
            sockmap.remove_attached(sockopt_offload.cgroup2_root())

    def counters(self) -> dict[str, float]:
        from tsor.metrics import fetch, parse
        return parse(fetch(self.metrics))

    def registered(self) -> dict[str, dict]:
        """The pods quark-cni registered, by sandbox id, as tsord keeps them (state_dir/pods.json)."""
        try:
            saved = json.loads((self.state_dir / "pods.json").read_text())
        except FileNotFoundError:
            return {}
        return {p["sandbox"]: p for p in saved["pods"]}

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
