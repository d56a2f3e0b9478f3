"""docker and podman, each private to one test module or benchmark, driving runc and quark side by
side as their users would (a `runtimes` entry in daemon.json, podman's `--runtime`).

`Dockerd` is Debian's docker.io daemon with its own data root, exec root, socket and pid file, no
default bridge and `--iptables=false`, `--ip-forward=false`, `--ip-masq=false` (the host's firewall
and sysctls untouched); its containers' cgroups live under /quark-docker (tests/cleanup.py removes
them). `Podman` is Debian's podman with private storage, run root, tmp dir and runtime state, the
cgroupfs manager, a file events log and its containers' cgroups under /quark-podman. Neither pulls anything: `image_tar` makes a busybox root as
a tarball for `docker import` / `podman import`. `close` removes every container, stops the daemon,
unmounts and deletes the tree.
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

from tests.cleanup import quark_cgroup_dirs, remove_empty_since, unmount_under
from tests.support.busybox import make_rootfs

DOCKER = "/usr/bin/docker"   # Debian's client (another docker may come first on PATH)
DOCKERD = "/usr/sbin/dockerd"
PODMAN = "/usr/bin/podman"
CONMON = "/usr/bin/conmon"
RUNC = shutil.which("runc") or "/usr/sbin/runc"
IMAGE = "localhost/quark-busybox:test"
DOCKER_CGROUP_PARENT = "/quark-docker"
PODMAN_CGROUP_PARENT = "/quark-podman"
LIBPOD_CGROUP_PARENT = "libpod_parent"   # podman's own default parent


def docker_skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (dockerd, mounts, namespaces)"
    if not (os.access(DOCKERD, os.X_OK) and os.access(DOCKER, os.X_OK)):
        return "docker.io is not installed (make install installs it)"
    return None


def podman_skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (podman with the cgroupfs manager, mounts, namespaces)"
    if not (os.access(PODMAN, os.X_OK) and os.access(CONMON, os.X_OK)):
        return "podman is not installed (make install installs it)"
    return None


def image_tar(path: Path) -> Path:
    """A busybox root filesystem as a tarball (what `docker import` and `podman import` take)."""
    root = path.parent / (path.name + ".root")
    make_rootfs(str(root))
    with tarfile.open(path, "w") as tar:
        tar.add(root, arcname=".")
    shutil.rmtree(root)
    return path


def runtime_wrapper(directory: Path, quark: str, config: str) -> str:
    """A `quark` that reads its host config from `config` ($QUARK_CONFIG): neither docker nor podman
    passes its own environment on to the runtime; an operator edits /etc/quark/config.yaml instead."""
    config_path = directory / "quark-config.yaml"
    config_path.write_text(config)
    wrapper = directory / "quark-with-config"
    wrapper.write_text(f"#!/bin/sh\nQUARK_CONFIG={config_path} exec {quark} \"$@\"\n")
    wrapper.chmod(0o755)
    return str(wrapper)


class _Tree:
    def __init__(self, prefix: str) -> None:
        self.base = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))   # short: unix socket paths

    def _remove_tree(self) -> None:
        unmount_under(self.base)
        shutil.rmtree(self.base, ignore_errors=True)


class Dockerd(_Tree):
    def __init__(self, runtimes: dict[str, str]) -> None:
        super().__init__("qdk-")
        self.socket = self.base / "docker.sock"
        self.config = self.base / "daemon.json"
        self.config.write_text(json.dumps({
            "runtimes": {name: {"path": path} for name, path in runtimes.items()},
            "data-root": str(self.base / "data"), "exec-root": str(self.base / "exec"),
            "pidfile": str(self.base / "docker.pid"), "hosts": [f"unix://{self.socket}"],
            "iptables": False, "ip6tables": False, "ip-forward": False, "ip-masq": False, "bridge": "none",
            "cgroup-parent": DOCKER_CGROUP_PARENT, "log-driver": "json-file",
        }))
        self.log = open(self.base / "dockerd.log", "wb")
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60) -> None:
        self.proc = subprocess.Popen([DOCKERD, "--config-file", str(self.config)], stdin=subprocess.DEVNULL,
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dockerd exited {self.proc.returncode}: {self.log_tail()}")
            if self.socket.exists() and self(["version"], check=False, timeout=10).returncode == 0:
                return
            time.sleep(0.2)
        raise RuntimeError(f"dockerd did not answer in {timeout}s: {self.log_tail()}")

    def __call__(self, args: list[str], check: bool = True, timeout: float = 120,
                 **kw) -> subprocess.CompletedProcess:
        r = subprocess.run([DOCKER, "-H", f"unix://{self.socket}", *args], capture_output=True, text=True,
                           timeout=timeout, stdin=kw.pop("stdin", subprocess.DEVNULL), **kw)
        if check and r.returncode != 0:
            raise AssertionError(f"docker {' '.join(args)} exited {r.returncode}: {r.stderr}")
        return r

    def log_tail(self, lines: int = 30) -> str:
        self.log.flush()
        return "\n".join((self.base / "dockerd.log").read_text(errors="replace").splitlines()[-lines:])

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            ids = self(["ps", "-aq"], check=False, timeout=60).stdout.split()
            if ids:
                self(["rm", "-f", *ids], check=False, timeout=120)
            self.proc.send_signal(signal.SIGTERM)   # it stops its containerd and shims itself
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
        self._remove_tree()


class Podman(_Tree):
    def __init__(self, runtimes: dict[str, str]) -> None:
        super().__init__("qpm-")
        self.runtimes = runtimes   # name -> the runtime's path, for --runtime
        self.conf = self.base / "containers.conf"
        # podman's defaults for root (1048576 files and processes) are above this host's hard limits,
        # which runc and quark both refuse to raise (runc refuses the hard limit itself under conmon)
        nofile, nproc = (min(resource.getrlimit(r)[1], 4096) for r in (resource.RLIMIT_NOFILE, resource.RLIMIT_NPROC))
        self.conf.write_text(f"""[containers]
default_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]
[engine]
cgroup_manager = "cgroupfs"
events_logger = "file"
events_logfile_path = "{self.base}/events.log"
""")
        self.env = dict(os.environ, CONTAINERS_CONF=str(self.conf))
        # podman puts the conmons of commands without --cgroup-parent (an exec's) under /libpod_parent
        self._libpod_before = quark_cgroup_dirs(LIBPOD_CGROUP_PARENT)
        self.globals = ["--root", str(self.base / "storage"), "--runroot", str(self.base / "run"),
                        "--tmpdir", str(self.base / "tmp")]

    def __call__(self, args: list[str], runtime: str | None = None, check: bool = True, timeout: float = 120,
                 **kw) -> subprocess.CompletedProcess:
        r = subprocess.run(self.argv(args, runtime), capture_output=True, text=True, timeout=timeout, env=self.env,
                           stdin=kw.pop("stdin", subprocess.DEVNULL), **kw)
        if check and r.returncode != 0:
            raise AssertionError(f"podman {' '.join(args)} exited {r.returncode}: {r.stderr}")
        return r

    def argv(self, args: list[str], runtime: str | None = None) -> list[str]:
        """podman's command line (with `runtime` as its OCI runtime); the runtimes keep their state in
        their default roots, as podman runs them (/run/runc, /run/quark)."""
        return [PODMAN, *self.globals, *(["--runtime", runtime] if runtime else []), *args]

    def close(self) -> None:
        self(["rm", "-a", "-f", "-t", "0"], check=False, timeout=120)
        self._remove_tree()
        remove_empty_since(self._libpod_before, LIBPOD_CGROUP_PARENT)
