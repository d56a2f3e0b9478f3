"""A fresh Kubernetes node to install quark on: a Debian root made from Debian's archive with only
what a node brings (containerd, runc, the CNI plugins, iproute2; no Python), booted in namespaces of
its own.

    make node-root                        # builds the roots' tarballs (mmdebstrap), once
    python -m tests.support.fresh_node --build

Two suites: Debian 12 (bookworm: containerd 1.6, the glibc the payload is built with) and Debian 13
(trixie: containerd 1.7, a newer glibc than the payload's).

`FreshNode` unpacks it into a directory, gives it a network configuration as a cluster's network
plugin would (bridge + host-local), and boots it: new mount, pid, network, UTS, IPC and cgroup
namespaces, the root pivoted to that directory, fresh proc, sysfs and cgroup hierarchies (the
cgroup namespace's root is a cgroup of its own on the host, so the node's pods and anything tsord
attaches stay inside it), tmpfs /run and /tmp, its mounts shared among themselves as systemd makes a
node's (a pod's HostToContainer volume needs it; nothing propagates to or from the host's
namespace), and /bin/sh as its init: it runs the node's containerd
and restarts it on SIGHUP, as systemd would on `systemctl restart containerd` (the node has no
systemd; the installer is told this command with --restart-containerd). `stop` ends the node (its pid
namespace goes with its init, its mounts and network with its last process) and removes its
cgroups; `close` its files as well.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

from tests.integration.cri_env import remove_cgroups

SUITES = ("bookworm", "trixie")
PACKAGES = ("containerd", "runc", "containernetworking-plugins", "iproute2")
CACHE = Path("/var/cache/quark-node")
# what the node itself writes at run time, not the installer: left out of snapshots
RUNTIME_DIRS = ("proc", "sys", "dev", "run", "tmp", "mnt", "var/lib/containerd", "var/lib/cni", "var/log",
                "var/lib/kubelet")
RESTART = "sh -c 'kill -HUP 1'"   # the node init's restart of containerd (--restart-containerd)
# `systemctl restart containerd`, the installer's default restart (what the DaemonSet's init
# container runs), as this node's init does it: a stand-in for systemd's command for that one use
SYSTEMCTL = """#!/bin/sh
# systemctl stand-in of a test node (tests/support/fresh_node.py): its init restarts containerd on SIGHUP
if [ "$*" = "restart containerd" ]; then kill -HUP 1; exit $?; fi
echo "systemctl stand-in: only 'restart containerd' is done here, not: $*" >&2
exit 1
"""
NODE_INIT = r"""
mount --make-rshared /
ip link set lo up
start() { containerd >>/run/containerd.log 2>&1 & echo $! >/run/containerd.pid.new; mv /run/containerd.pid.new /run/containerd.pid; }
stop() { p=$(cat /run/containerd.pid); kill $p; wait $p; }
trap 'stop; start' HUP
trap 'stop; exit 0' TERM
start
while :; do sleep 1 & wait $!; done
"""


CAP_SYS_RESOURCE = 24


def has_capability(cap: int) -> bool:
    with open("/proc/self/status") as f:
        eff = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
    return bool(eff >> cap & 1)


def tarball(suite: str) -> Path:
    return CACHE / f"{suite}-{hashlib.sha256(' '.join(PACKAGES).encode()).hexdigest()[:12]}.tar"


def skip_reason(suite: str) -> str | None:
    if os.geteuid() != 0:
        return "needs root (namespaces, mounts, cgroups)"
    if not tarball(suite).exists():
        return f"no node root at {tarball(suite)} (make node-root builds it with mmdebstrap)"
    for tool in ("unshare", "nsenter", "pivot_root"):
        if not shutil.which(tool):
            return f"{tool} missing (util-linux)"
    return None


def build(suite: str) -> Path:
    """The node root's tarball, made with mmdebstrap from Debian's archive when missing."""
    from deploy.image import mmdebstrap_tar
    return mmdebstrap_tar(tarball(suite), suite, ("--variant=minbase", f"--include={','.join(PACKAGES)}"),
                          f"{suite}-*.tar")   # (an earlier package list's removed)


def cgroup_mounts() -> list[tuple[str, str, str]]:
    """The host's cgroup hierarchies: (directory under /sys/fs/cgroup, fs type, options)."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, right = line.split(" - ")
            point = left.split()[4]
            fstype, _, opts = right.split()[:3]
            if fstype in ("cgroup", "cgroup2") and point.startswith("/sys/fs/cgroup"):
                keep = [o for o in opts.split(",") if o not in ("rw", "ro")]
                found.append((os.path.relpath(point, "/sys/fs/cgroup"), fstype, ",".join(keep) or "defaults"))
    return found


def snapshot(root: Path) -> dict[str, tuple]:
    """Every file of the root but RUNTIME_DIRS': type, mode, owner and content (hash) or link target."""
    out: dict[str, tuple] = {}
    skip = {str(root / d) for d in RUNTIME_DIRS}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if os.path.join(dirpath, d) not in skip]
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                what = os.readlink(path)
            elif stat.S_ISREG(st.st_mode):
                with open(path, "rb") as f:
                    what = hashlib.file_digest(f, "sha256").hexdigest()
            else:
                what = ""
            out[os.path.relpath(path, root)] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode),
                                                st.st_uid, st.st_gid, what)
    return out


class FreshNode:
    def __init__(self, base: Path, suite: str = SUITES[0], name: str = "node-a") -> None:
        self.base, self.suite, self.name = base, suite, name
        self.root = base / "root"
        self.cgroup = f"quark-node-{os.getpid()}-{base.name}"
        self.proc: subprocess.Popen | None = None
        self.pid = 0   # the node's init, as the host sees it

    def unpack(self) -> None:
        self.root.mkdir(parents=True)
        subprocess.run(["tar", "-xf", str(tarball(self.suite)), "--numeric-owner", "-C", str(self.root)], check=True)

    def restrict_oom_score_adj(self) -> None:
        """Where this host withholds CAP_SYS_RESOURCE (this machine does), no process of the node
        may lower its OOM score below containerd's, and CRI gives a runc pod's sandbox -998: set
        containerd's own option for such hosts (restrict_oom_score_adj, as rootless and nested
        nodes do), which clamps it to containerd's score. quark's pods never asked for it."""
        if has_capability(CAP_SYS_RESOURCE):
            return
        path = self.root / "etc/containerd/config.toml"
        section = '[plugins."io.containerd.grpc.v1.cri"]\n'
        text = path.read_text()
        if section not in text:
            raise RuntimeError(f"{path}: no CRI section to add restrict_oom_score_adj to")
        path.write_text(text.replace(section, section + "    restrict_oom_score_adj = true\n", 1))

    def write(self, path: str, text: str, mode: int = 0o644) -> None:
        dest = self.root / path.lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(text)
        dest.chmod(mode)

    # ---- boot and stop -------------------------------------------------------------------------
    def start(self) -> None:
        mounts = cgroup_mounts()
        join = "; ".join(
            f"mkdir -p /sys/fs/cgroup/{d}/{self.cgroup}"
            + (f"; cat /sys/fs/cgroup/{d}/cpuset.cpus > /sys/fs/cgroup/{d}/{self.cgroup}/cpuset.cpus"
               f"; cat /sys/fs/cgroup/{d}/cpuset.mems > /sys/fs/cgroup/{d}/{self.cgroup}/cpuset.mems"
               if "cpuset" in opts.split(",") else "")
            + f"; echo $$ > /sys/fs/cgroup/{d}/{self.cgroup}/cgroup.procs"
            for d, _, opts in mounts)
        r = shlex.quote(str(self.root))
        inner = "; ".join([
            "set -e", f"mount --bind {r} {r}", f"mount -t proc proc {r}/proc", f"mount -t sysfs sysfs {r}/sys",
            f"mount -t tmpfs -o mode=755 cgroup {r}/sys/fs/cgroup",
            *(f"mkdir -p {r}/sys/fs/cgroup/{d}; mount -t {t} -o {o} {t} {r}/sys/fs/cgroup/{d}" for d, t, o in mounts),
            f"mount -t bpf bpf {r}/sys/fs/bpf", f"mount --rbind /dev {r}/dev",
            f"mount -t tmpfs -o mode=755 run {r}/run", f"mount -t tmpfs -o mode=1777 tmp {r}/tmp",
            f"hostname {self.name}", f"cd {r}", "pivot_root . mnt",
            "exec chroot . /bin/sh -c 'umount -l /mnt && exec /bin/sh -c \"$NODE_INIT\"'",
        ])
        script = (f"set -e; {join}; exec unshare --cgroup --mount --pid --net --uts --ipc --fork "
                  f"--propagation private -- bash -c {shlex.quote(inner)}")
        # the init traps HUP and TERM, which a shell cannot do to a signal ignored when it started
        # (a test run under nohup ignores HUP): env gives them back their default first
        self.proc = subprocess.Popen(["env", "--default-signal=HUP,TERM,INT", "bash", "-c", script],
                                     env={**os.environ, "NODE_INIT": NODE_INIT},
                                     stdin=subprocess.DEVNULL, stdout=open(self.base / "node.log", "ab"),
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 30
        while not self.pid:
            try:
                children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
            except FileNotFoundError:
                children = []
            if children and Path(f"/proc/{children[0]}/root/run/containerd.pid").exists():
                self.pid = int(children[0])
            elif self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the node did not boot:\n{self.log()}")
            else:
                time.sleep(0.05)
        self.wait_containerd()

    def wait_containerd(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.run(["ctr", "version"], check=False).returncode != 0:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the node's containerd does not answer:\n{self.log()}")
            time.sleep(0.2)

    def containerd_pid(self) -> int:
        # the node's init renames the file into place, so a read never sees it half written
        return int(self.path("/run/containerd.pid").read_text())

    def stop(self) -> None:
        if self.proc is not None:
            p, self.proc = self.proc, None
            if self.pid:
                os.kill(self.pid, signal.SIGTERM)
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                if self.pid:
                    os.kill(self.pid, signal.SIGKILL)
                p.wait(30)
            self.pid = 0
        remove_cgroups("/" + self.cgroup)   # the node's, in every hierarchy, deepest first

    def close(self) -> None:
        self.stop()
        if self.root.exists():
            if any(str(self.root) in line for line in open("/proc/self/mountinfo")):
                raise RuntimeError(f"{self.root} still has mounts in the host's namespace")
            shutil.rmtree(self.root)

    # ---- inside --------------------------------------------------------------------------------
    def path(self, path: str) -> Path:
        """A path of the node's own view (its /run, /tmp), from the host."""
        return Path(f"/proc/{self.pid}/root") / path.lstrip("/")

    def run(self, argv: list[str], check: bool = True, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
        """argv in every namespace of the node, its root and working directory (nsenter)."""
        r = subprocess.run(["nsenter", "-t", str(self.pid), "-a", "-r", "-w", "--", *argv], capture_output=True,
                           text=True, timeout=timeout, **kw)
        if check and r.returncode != 0:
            raise RuntimeError(f"{shlex.join(argv)} on the node: exit {r.returncode}\n{r.stdout}{r.stderr}")
        return r

    def spawn(self, argv: list[str], log: str) -> int:
        """argv in the background on the node, its output in the node's `log`: its pid there."""
        pidfile = f"/run/{os.path.basename(log)}.pid"
        self.run(["sh", "-c", f"{shlex.join(argv)} >>{shlex.quote(log)} 2>&1 </dev/null & echo $! >{pidfile}"])
        return int(self.path(pidfile).read_text())

    def kill(self, pid: int, timeout: float = 30) -> None:
        """SIGTERM to a process of the node (its pid there), and wait for its end."""
        self.run(["sh", "-c", f"kill {pid}"])
        deadline = time.monotonic() + timeout
        while self.path(f"/proc/{pid}").exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"pid {pid} on the node did not end")
            time.sleep(0.05)

    def log(self) -> str:
        text = (self.base / "node.log").read_text(errors="replace") if (self.base / "node.log").exists() else ""
        if self.pid and self.path("/run/containerd.log").exists():
            text += "\n--- containerd ---\n" + self.path("/run/containerd.log").read_text(errors="replace")[-6000:]
        return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build", action="store_true", help="make the node roots' tarballs if missing")
    args = p.parse_args(argv)
    if args.build:
        for suite in SUITES:
            print(build(suite))
    return 0


if __name__ == "__main__":
    sys.exit(main())
