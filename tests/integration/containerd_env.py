"""A private containerd for tests: own config, root, state and sockets under one short tmp dir.

The quark shim is found through PATH, the way `make links` puts it there: the C front end
(build/bin, qvisor/frontend.c: containerd's `start` goes to the sandbox factory) when it is built,
else the venv's console script; runc's shim is Debian's. `busybox_image_tar` builds a one-layer OCI image from
busybox-static, to be imported with `ctr images import`.
"""
from __future__ import annotations

import io
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from deploy.image import write_archive
from tests.cleanup import unmount_under

CONTAINERD = shutil.which("containerd")
CTR = shutil.which("ctr")
BUSYBOX = "/bin/busybox"
VENV_BIN = os.path.dirname(sys.executable)
FRONT_BIN = str(Path(__file__).resolve().parents[2] / "build" / "bin")   # `make frontend`
_BIN = FRONT_BIN if os.access(os.path.join(FRONT_BIN, "containerd-shim-quark-v1"), os.X_OK) else VENV_BIN
SHIM = os.path.join(_BIN, "containerd-shim-quark-v1")
RUNTIME = "io.containerd.quark.v1"
IMAGE = "docker.io/library/quark-busybox:test"
DEPLOY_FRAGMENT = Path(__file__).resolve().parents[2] / "deploy" / "containerd" / "quark.toml"


def skip_reason() -> str | None:
    """Why these tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (containerd, mounts, namespaces)"
    if not CONTAINERD or not CTR:
        return "containerd/ctr not installed (apt-get install containerd)"
    if not os.access(SHIM, os.X_OK):
        return f"{SHIM} not installed (pip install -e . provides the console script)"
    if not os.path.exists(BUSYBOX):
        return "busybox-static not installed"
    return None


class Containerd:
    """One containerd process with private paths; restartable; `close` removes everything."""

    def __init__(self, namespace: str = "quarktest") -> None:
        self.base = Path(tempfile.mkdtemp(prefix="qct-", dir="/tmp"))  # short: unix socket paths
        self.root = self.base / "root"
        self.state = self.base / "state"
        self.address = str(self.base / "c.sock")
        self.config = self.base / "config.toml"
        self.log_path = self.base / "containerd.log"
        self.namespace = namespace
        self.proc: subprocess.Popen | None = None
        self.config.write_text(f"""version = 2
root = "{self.root}"
state = "{self.state}"
disabled_plugins = ["io.containerd.grpc.v1.cri"]

[grpc]
  address = "{self.address}"

[debug]
  level = "debug"
""")
        self.env = dict(os.environ, PATH=f"{_BIN}:{VENV_BIN}:{os.environ.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}")
        self.wrap: list[str] = []   # a command containerd runs under (e.g. nsenter into a node's netns)

    def start(self) -> None:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([*self.wrap, CONTAINERD, "--config", str(self.config)], env=self.env,
                                     stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        log.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"containerd exited {self.proc.returncode}:\n{self.log_tail()}")
            if os.path.exists(self.address) and self.ctr("version", check=False, timeout=10).returncode == 0:
                return
            time.sleep(0.1)
        raise RuntimeError(f"containerd did not come up:\n{self.log_tail()}")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def restart(self) -> None:
        self.stop()
        self.start()

    def ctr_tty(self, args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """`ctr ARGS` (one shell string, for -t runs) on a pseudo-terminal of its own (script(1))."""
        cmd = f"{CTR} --address {self.address} --namespace {self.namespace} {args}"
        return subprocess.run(["script", "-qec", cmd, "/dev/null"], capture_output=True, timeout=timeout,
                              stdin=subprocess.DEVNULL, env=self.env)

    def ctr(self, *args: str, input: bytes | None = None, timeout: float = 60,
            check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run([CTR, "--address", self.address, "--namespace", self.namespace, *args],
                              input=input, capture_output=True, timeout=timeout, env=self.env)
        if check and proc.returncode != 0:
            raise AssertionError(f"ctr {' '.join(args)} exited {proc.returncode}\nstdout: {proc.stdout.decode()}"
                                 f"\nstderr: {proc.stderr.decode()}\ncontainerd log:\n{self.log_tail()}")
        return proc

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def shim_pids(self) -> list[int]:
        """The quark shims serving this containerd (matched by their -address argument)."""
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(a.endswith(b"containerd-shim-quark-v1") for a in argv[:2]) and self.address.encode() in argv:
                pids.append(int(entry))
        return pids

    def close(self) -> None:
        """Delete what is left through containerd, stop it, and remove its tree."""
        if self.proc is not None and self.proc.poll() is None:
            tasks = self.ctr("tasks", "ls", "-q", check=False, timeout=30).stdout.decode().split()
            for t in tasks:
                self.ctr("tasks", "kill", "-a", "-s", "SIGKILL", t, check=False, timeout=30)
                self.ctr("tasks", "delete", "-f", t, check=False, timeout=30)
            for c in self.ctr("containers", "ls", "-q", check=False, timeout=30).stdout.decode().split():
                self.ctr("containers", "delete", c, check=False, timeout=30)
        self.stop()
        deadline = time.monotonic() + 5  # shims that were told to shut down finish on their own
        while self.shim_pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in self.shim_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        unmount_under(self.base)
        shutil.rmtree(self.base, ignore_errors=True)


def _tar_add(tar: tarfile.TarFile, name: str, *, data: bytes | None = None, mode: int = 0o755,
             kind: bytes = tarfile.DIRTYPE, link: str = "") -> None:
    info = tarfile.TarInfo(name)
    info.mode, info.type, info.linkname, info.mtime = mode, kind, link, 0
    if data is not None:
        info.size = len(data)
    tar.addfile(info, io.BytesIO(data) if data is not None else None)


def busybox_image_tar(path: Path, name: str = IMAGE, extra_files: dict[str, tuple[bytes, int]] | None = None,
                      extra_dirs: tuple[str, ...] = ()) -> Path:
    """An OCI image layout tar (index.json, manifest, config, one tar.gz layer) of busybox-static,
    plus `extra_files` {path: (data, mode)} in `extra_dirs` (parents first)."""
    applets = subprocess.run([BUSYBOX, "--list"], capture_output=True, check=True).stdout.decode().split()
    return oci_image_tar(
        path, name,
        files={"bin/busybox": (Path(BUSYBOX).read_bytes(), 0o755),
               "etc/passwd": (b"root:x:0:0:root:/root:/bin/sh\n", 0o644),
               "etc/group": (b"root:x:0:\n", 0o644), **(extra_files or {})},
        dirs=("bin", "dev", "etc", "proc", "sys", "tmp", "root", "usr", "usr/bin", "sbin", *extra_dirs),
        symlinks={f"bin/{a}": "busybox" for a in applets if a != "busybox"}, cmd=["sh"])


def oci_image_tar(path: Path, name: str, *, files: dict[str, tuple[bytes, int]], dirs: tuple[str, ...] = (),
                  symlinks: dict[str, str] | None = None, entrypoint: list[str] | None = None,
                  cmd: list[str] | None = None) -> Path:
    """An OCI image layout tar of one tar.gz layer holding dirs, files {path: (data, mode)} and symlinks."""
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for d in dirs:
            _tar_add(tar, d, mode=0o1777 if d == "tmp" else 0o755)
        for f, (data, mode) in files.items():
            _tar_add(tar, f, data=data, kind=tarfile.REGTYPE, mode=mode)
        for link, target in (symlinks or {}).items():
            _tar_add(tar, link, kind=tarfile.SYMTYPE, link=target, mode=0o777)
    image_config: dict = {"Env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"], "WorkingDir": "/"}
    if entrypoint is not None:
        image_config["Entrypoint"] = entrypoint
    if cmd is not None:
        image_config["Cmd"] = cmd
    write_archive(path, [layer.getvalue()], image_config, name, "test")
    return path


def busybox_rootfs(path: Path) -> Path:
    """A plain directory rootfs (for `ctr run --rootfs`): busybox and its applet links."""
    (path / "bin").mkdir(parents=True)
    for d in ("dev", "etc", "proc", "sys", "tmp", "root"):
        (path / d).mkdir()
    shutil.copy2(BUSYBOX, path / "bin" / "busybox")
    for a in subprocess.run([BUSYBOX, "--list"], capture_output=True, check=True).stdout.decode().split():
        if a != "busybox":
            os.symlink("busybox", path / "bin" / a)
    return path


def time_ctr_run_rm(cd: Containerd, runtime: str, runs: int, image: str = IMAGE) -> list[float]:
    """Wall seconds of `ctr run --rm IMAGE ID /bin/true` under runtime, once per run (for bench/startup.py)."""
    times = []
    for i in range(runs):
        t0 = time.perf_counter()
        cd.ctr("run", "--rm", "--runtime", runtime, image, f"bench-{runtime.split('.')[2]}-{i}", "/bin/true")
        times.append(time.perf_counter() - t0)
    return times
