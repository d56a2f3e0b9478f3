"""Pods and nodes on one machine, for TSoR's demo, tests and benchmark.

A *node* is a network namespace with a bridge (built by the real CNI `bridge` plugin with
`host-local` IPAM, as Kubernetes' default pod network is); a *pod* is a network namespace the
plugin wires to its node's bridge. Two nodes are joined by a veth pair with routes to each other's
pod subnets. Each node can run its own `tsord`. Containers run with `quark` or `runc` from
host-rootfs bundles (the host's /usr and /etc bind-mounted read-only, so python3, iperf3 and redis
are there). Everything is named with a prefix and removed by `close()`.
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from qvisor.spec import default_spec
from tests.support.busybox import make_bundle
from tsor import SOCKET_ANNOTATION

CNI_BIN = "/usr/lib/cni"
TSORD_PORT = 7470
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def sh(*args: str, check: bool = True, netns: str | None = None, **kw) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", netns] if netns else []) + list(args)
    return subprocess.run(cmd, check=check, capture_output=True, text=True, **kw)


def python_succeeds(netns: str, code: str, timeout: float, interval: float = 0.1) -> bool:
    """Run `python -c code` in `netns` until it exits 0 (True), or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sh(sys.executable, "-c", code, check=False, netns=netns).returncode == 0:
            return True
        time.sleep(interval)
    return False


def wait_file(path: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"timed out waiting for {path}"
        time.sleep(0.05)


def eth0_bytes(netns_path: str) -> int:
    """Bytes a pod's eth0 sent and received, read in its network namespace over netlink: which
    connections crossed the pod's veth (`netns_path`: testbed's Pod.netns_path, CNI's netns)."""
    out = subprocess.run(["nsenter", f"--net={netns_path}", "ip", "-j", "-s", "link", "show", "eth0"],
                         check=True, capture_output=True, text=True).stdout
    stats = json.loads(out)[0]["stats64"]
    return stats["rx"]["bytes"] + stats["tx"]["bytes"]


def sockmap_skip_reason() -> str | None:
    """Why a test of tsord's `local_path: sockmap` cannot run here, or None."""
    from tsor import sockmap
    from tsor.sockopt_offload import cgroup2_root
    root = cgroup2_root()
    if root is None:
        return "local_path: sockmap needs the unified cgroup hierarchy (cgroup2) mounted"
    running = sockmap.attached_names(root)
    if running:
        return f"a tsord with local_path: sockmap runs on this host ({', '.join(sorted(running))} attached)"
    return None


def metric(node: Node, name: str) -> float:
    """One of `node`'s tsord metrics, e.g. 'tsor_listeners' (0 before it is first counted)."""
    from tsor.metrics import fetch, parse
    return parse(fetch(node.metrics)).get(name, 0.0)


def wait_metric(node: Node, name: str, at_least: float, timeout: float = 10) -> float:
    """`metric` once it reaches `at_least`, or its value after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while (value := metric(node, name)) < at_least and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def local_connections(node: Node) -> float:
    """tsord's count of connections that took the local path on `node` (0 before the first)."""
    return metric(node, 'tsor_connections_total{path="local"}')


@dataclass
class Pod:
    name: str
    netns: str
    ip: str
    ip6: str | None
    node: Node

    @property
    def netns_path(self) -> str:
        return f"/var/run/netns/{self.netns}"

    def wait_listening(self, *ports: int, timeout: float = 30) -> None:
        """Until a socket of the pod listens on each port (its /proc/net/tcp*: nothing connects,
        so no connection is used up or counted)."""
        deadline = time.monotonic() + timeout
        while True:
            out = sh("cat", "/proc/net/tcp", "/proc/net/tcp6", netns=self.netns).stdout
            listening = {int(f[1].rsplit(":", 1)[1], 16) for f in (ln.split() for ln in out.splitlines()[1:])
                         if len(f) > 3 and f[3] == "0A"}
            if set(ports) <= listening:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"pod {self.name}: nothing listens on {sorted(set(ports) - listening)}")
            time.sleep(0.05)


@dataclass
class Node:
    name: str
    netns: str
    index: int
    bed: Testbed
    pods: list[Pod] = field(default_factory=list)
    tsord: subprocess.Popen | None = None
    address: str = ""            # on the node-to-node link

    @property
    def subnet(self) -> str:
        return f"10.{self.bed.octet}.{self.index}.0/24"

    @property
    def subnet6(self) -> str:
        return f"fd00:{self.bed.octet}:{self.index}::/64"

    @property
    def socket(self) -> str:
        return os.path.join(self.bed.dir, f"{self.name}-tsord.sock")

    @property
    def metrics(self) -> str:
        return os.path.join(self.bed.dir, f"{self.name}-metrics.sock")

    def _cni(self, command: str, pod: str) -> dict:
        conf = {"cniVersion": "1.0.0", "name": f"{self.bed.prefix}{self.index}", "type": "bridge",
                "bridge": f"{self.bed.prefix}br{self.index}", "isGateway": True, "ipMasq": False,
                "ipam": {"type": "host-local", "dataDir": os.path.join(self.bed.dir, "cni"),
                         "ranges": [[{"subnet": self.subnet}], [{"subnet": self.subnet6}]],
                         "routes": [{"dst": "0.0.0.0/0"}, {"dst": "::/0"}]}}
        env = dict(os.environ, CNI_COMMAND=command, CNI_CONTAINERID=pod, CNI_IFNAME="eth0",
                   CNI_NETNS=f"/var/run/netns/{pod}", CNI_PATH=CNI_BIN)
        r = sh(f"{CNI_BIN}/bridge", netns=self.netns, input=json.dumps(conf), env=env, check=False)
        if r.returncode != 0:
            raise RuntimeError(f"CNI {command} for {pod}: {r.stdout} {r.stderr}")
        return json.loads(r.stdout) if command == "ADD" else {}

    def pod(self, name: str) -> Pod:
        netns = f"{self.bed.prefix}p-{name}"
        sh("ip", "netns", "add", netns)
        self.bed.netns.append(netns)
        sh("ip", "-n", netns, "link", "set", "lo", "up")
        # no duplicate address detection: the address is usable at once, as on a pod network
        sh("sysctl", "-qw", "net.ipv6.conf.all.accept_dad=0", "net.ipv6.conf.default.accept_dad=0", netns=netns)
        result = self._cni("ADD", netns)
        ips = [i["address"].split("/")[0] for i in result["ips"]]
        ip = next(a for a in ips if ":" not in a)
        ip6 = next((a for a in ips if ":" in a), None)
        p = Pod(name, netns, ip, ip6, self)
        self.pods.append(p)
        return p

    def start_tsord(self, *, wait: bool = True, debug: bool = True, transport: str | None = None,
                    kubeconfig: str | None = None, local_path: str | None = None, peers: bool = True,
                    rdma: dict | None = None) -> None:
        """`debug`: tsord logs every connection (the tests read it); benchmarks run without, as a
        node does. `transport`: tsor.yaml's node-to-node transport (default: tsord's, auto).
        `kubeconfig`: routes from that API server (tsor/routes_k8s.py) instead of the bed's file.
        `local_path`: tsor.yaml's local_path (default: tsord's, socketpair). `rdma`: tsor.yaml's
        `rdma:` (device, port, gid_index, pump). `peers=False`: no
        cluster secret and no listen address, so no connection to another node's pods is carried
        (they fall back to the kernel's TCP)."""
        cfg = os.path.join(self.bed.dir, f"{self.name}-tsor.yaml")
        routes = {"kubernetes": {"kubeconfig": kubeconfig}} if kubeconfig else {"routes": self.bed.routes_file}
        with open(cfg, "w") as f:
            json.dump({"node": self.name, "socket": self.socket, "metrics": f"unix:{self.metrics}",
                       **routes, **({"cluster_secret_file": self.bed.secret_file} if peers else {}),
                       "state_dir": os.path.join(self.bed.dir, f"{self.name}-state"),
                       **({"listen": f"{self.address}:{TSORD_PORT}"} if self.address and peers else {}),
                       **({"transport": transport} if transport else {}),
                       **({"local_path": local_path} if local_path else {}),
                       **({"rdma": rdma} if rdma else {})}, f)
        log = open(os.path.join(self.bed.dir, f"{self.name}-tsord.log"), "a")
        # nsenter, not `ip netns exec`: that one also remounts /sys, which would hide the cgroup2
        # hierarchy tsord joins for the socket-option offload (tsor/sockopt_offload.py)
        self.tsord = subprocess.Popen(["nsenter", f"--net=/var/run/netns/{self.netns}", sys.executable, "-m",
                                       # softverbs is the tests' provider: the tsord that has it
                                       "tests.support.softverbs_tsord" if transport == "softverbs" else "tsor.daemon",
                                       "--config", cfg, *(["--debug"] if debug else [])],
                                      stdout=log, stderr=log, cwd=REPO,
                                      env=dict(os.environ, PYTHONPATH=REPO))
        log.close()
        if wait:
            # 30 s: in the RDMA lane's emulated guest (TCG) a cold start of tsord, imports and all,
            # once took longer than 10 s on a loaded host (its log still empty)
            deadline = time.monotonic() + 30
            while not os.path.exists(self.socket):
                if self.tsord.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"tsord {self.name} did not start: {self.log()}")
                time.sleep(0.02)

    def stop_tsord(self, sig: int = signal.SIGTERM) -> int | None:
        if self.tsord is None:
            return None
        p, self.tsord = self.tsord, None
        p.send_signal(sig)
        try:
            return p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            return p.wait()

    def log(self) -> str:
        try:
            with open(os.path.join(self.bed.dir, f"{self.name}-tsord.log")) as f:
                return f.read()
        except FileNotFoundError:
            return ""


class Testbed:
    """Owns every namespace, tsord and container it makes; `close()` removes them all."""

    def __init__(self, prefix: str = "qt", octet: int = 203) -> None:
        self.prefix, self.octet = prefix, octet
        self.dir = tempfile.mkdtemp(prefix=f"{prefix}-tsor-")
        self.netns: list[str] = []
        self.nodes: list[Node] = []
        self.routes_file = os.path.join(self.dir, "routes.yaml")
        # the cluster secret every node's tsord proves to the others (tsor/config.py)
        self.secret_file = os.path.join(self.dir, "cluster-secret")
        fd = os.open(self.secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, os.urandom(32).hex().encode())
        os.close(fd)
        self.runc: list[str] = []
        self.runc_root = os.path.join(self.dir, "runc")
        self._write_routes()

    def node(self, name: str, index: int | None = None) -> Node:
        """A node (a network namespace); `index` (default: the next) numbers its pod subnet."""
        n = Node(name, f"{self.prefix}n-{name}", index or len(self.nodes) + 1, self)
        sh("ip", "netns", "add", n.netns)
        self.netns.append(n.netns)
        sh("ip", "-n", n.netns, "link", "set", "lo", "up")
        sh("sysctl", "-qw", "net.ipv4.ip_forward=1", "net.ipv6.conf.all.forwarding=1", netns=n.netns)
        self.nodes.append(n)
        self._write_routes()
        return n

    def link(self, a: Node, b: Node) -> None:
        """A veth between two nodes, with routes to each other's pod subnets."""
        la, lb = f"{self.prefix}l{a.index}{b.index}", f"{self.prefix}l{b.index}{a.index}"
        sh("ip", "link", "add", la, "netns", a.netns, "type", "veth", "peer", "name", lb, "netns", b.netns)
        a.address, b.address = f"10.{self.octet}.0.{a.index}", f"10.{self.octet}.0.{b.index}"
        for n, dev, other in ((a, la, b), (b, lb, a)):
            sh("ip", "-n", n.netns, "addr", "add", f"{n.address}/24", "dev", dev)
            sh("ip", "-n", n.netns, "addr", "add", f"fd00:{self.octet}::{n.index}/64", "dev", dev, "nodad")
            sh("ip", "-n", n.netns, "link", "set", dev, "up")
            sh("ip", "-n", n.netns, "route", "add", other.subnet, "via", other.address)
            sh("ip", "-n", n.netns, "-6", "route", "add", other.subnet6, "via", f"fd00:{self.octet}::{other.index}")
        self._write_routes()

    def _write_routes(self) -> None:
        nodes = [{"name": n.name, "pods": [n.subnet, n.subnet6],
                  **({"address": f"{n.address}:{TSORD_PORT}"} if n.address else {})} for n in self.nodes]
        tmp = self.routes_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"nodes": nodes}, f)
        os.replace(tmp, self.routes_file)

    # ---- containers ------------------------------------------------------------------------------
    def bundle(self, name: str, args: list[str], pod: Pod, *, env: list[str] = (), tsor: bool = True,
               annotations: dict[str, str] | None = None) -> str:
        """A host-rootfs bundle running `args` in `pod`'s netns; /out is a writable shared dir."""
        bundle = os.path.join(self.dir, "bundles", name)
        rootfs = os.path.join(bundle, "rootfs")
        os.makedirs(rootfs, exist_ok=True)
        for d in ("usr", "etc", "proc", "sys", "dev", "tmp", "out", "repo", "run", "var"):
            os.makedirs(os.path.join(rootfs, d), exist_ok=True)
        for link in ("bin", "lib", "lib64", "sbin"):
            if not os.path.lexists(os.path.join(rootfs, link)):
                os.symlink(f"usr/{link}", os.path.join(rootfs, link))
        out = os.path.join(self.dir, "out")
        os.makedirs(out, exist_ok=True)
        spec = default_spec()
        mounts = spec["mounts"] + [
            {"destination": "/usr", "type": "bind", "source": "/usr", "options": ["rbind", "ro"]},
            {"destination": "/etc", "type": "bind", "source": "/etc", "options": ["rbind", "ro"]},
            {"destination": "/repo", "type": "bind", "source": REPO, "options": ["rbind", "ro"]},
            {"destination": "/out", "type": "bind", "source": out, "options": ["rbind", "rw"]},
            {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "nodev"]}]
        linux = spec["linux"]
        linux["namespaces"] = [ns if ns["type"] != "network" else {"type": "network", "path": pod.netns_path}
                               for ns in linux["namespaces"]]
        if not any(ns["type"] == "network" for ns in linux["namespaces"]):
            linux["namespaces"].append({"type": "network", "path": pod.netns_path})
        process = spec["process"]
        process["terminal"], process["args"] = False, list(args)
        process["env"] = list(process["env"]) + ["PYTHONPATH=/repo", "HOME=/tmp", *env]
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]   # as many fds as we may give
        process["rlimits"] = [{"type": "RLIMIT_NOFILE", "hard": nofile, "soft": nofile}]
        annotations = {**({SOCKET_ANNOTATION: pod.node.socket} if tsor else {}), **(annotations or {})}
        make_bundle(bundle, args, rootfs=rootfs, mounts=mounts, linux=linux, process=process,
                    annotations=annotations)
        return bundle

    def quark(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        return self._cli([os.path.join(os.path.dirname(sys.executable), "quark"),
                          "--root", os.path.join(self.dir, "quark")], args, check, timeout)

    def runc_cli(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        return self._cli(["runc", "--root", self.runc_root], args, check, timeout)

    @staticmethod
    def _cli(base: list[str], args, check: bool, timeout: float) -> subprocess.CompletedProcess:
        # files, not pipes: a detached container keeps the stdio it was given
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            p = subprocess.run(base + list(args), stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                               timeout=timeout)
            out.seek(0)
            err.seek(0)
            r = subprocess.CompletedProcess(p.args, p.returncode, out.read(), err.read())
        if check and r.returncode:
            raise RuntimeError(f"{' '.join(base[:1] + list(args))} exited {r.returncode}: {r.stderr}")
        return r

    def start(self, runtime: str, cid: str, bundle: str) -> None:
        """A detached container (quark or runc)."""
        if runtime == "quark":
            self.quark("run", "-d", "--bundle", bundle, cid)
        else:
            self.runc_cli("run", "-d", "--bundle", bundle, cid)
            self.runc.append(cid)

    def run(self, runtime: str, cid: str, bundle: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """A foreground container: returns when it exits."""
        if runtime == "quark":
            return self.quark("run", "--bundle", bundle, cid, check=False, timeout=timeout)
        r = self.runc_cli("run", "--bundle", bundle, cid, check=False, timeout=timeout)
        self.runc_cli("delete", "-f", cid, check=False)
        return r

    def stop(self, runtime: str, cid: str) -> None:
        if runtime == "quark":
            self.quark("delete", "--force", cid, check=False)
        else:
            self.runc_cli("delete", "-f", cid, check=False)
            if cid in self.runc:
                self.runc.remove(cid)

    def out(self, name: str) -> str:
        return os.path.join(self.dir, "out", name)

    # ---- clean-up --------------------------------------------------------------------------------
    def close(self) -> None:
        qroot = os.path.join(self.dir, "quark")
        if os.path.isdir(qroot):
            for cid in os.listdir(qroot):
                self.quark("delete", "--force", cid, check=False)
        for cid in list(self.runc):
            self.runc_cli("delete", "-f", cid, check=False)
        for n in self.nodes:
            n.stop_tsord()
            for p in n.pods:
                try:
                    n._cni("DEL", p.netns)
                except RuntimeError:
                    pass
        for ns in reversed(self.netns):
            sh("ip", "netns", "del", ns, check=False)
        shutil.rmtree(self.dir, ignore_errors=True)
        from tsor import sockopt_offload
        sockopt_offload.remove_if_unused()   # quark's socket cgroup, once nothing is in it (others may be)
