"""Installs quark on a Kubernetes node, from the DaemonSet's init container (deploy/daemonset.yaml).

The container sees the host's directories under --host-root (hostPath volumes; HOST_DIRS below is
the list the DaemonSet mounts, and a test holds the two together). It

1. copies the quark source tree into /opt/quark/src on the host (only files that changed);
2. runs `make install` there *on the host* (nsenter into pid 1's namespaces): the project's own
   installer — Debian packages, the venv, the C front end, and the links /usr/local/bin/quark,
   containerd-shim-quark-v1 and tsord;
3. links quark-cni into the CNI bin dir containerd uses (its config's cri.cni.bin_dir, else
   /opt/cni/bin);
4. writes /etc/containerd/conf.d/quark.toml (deploy/containerd/quark.toml) and makes
   /etc/containerd/config.toml import conf.d (adding the `imports` line, keeping the rest);
5. writes /etc/quark/tsor.yaml and the cluster secret (0600) from the mounted ConfigMap/Secret;
6. restarts containerd on the host when its configuration changed, and only then;
7. labels the node `quark.io/runtime=true` (the RuntimeClass schedules quark pods there).

Each step is idempotent: a second run changes nothing and restarts nothing. `--dry-run` does the
file work under --host-root and prints the host commands instead of running them.
"""
from __future__ import annotations

import argparse
import filecmp
import os
import re
import shutil
import subprocess
import sys
import tomllib

SOURCE_DIRS = ("qlib", "qvisor", "qkernel", "tsor", "shim", "cni", "deploy")
SOURCE_FILES = ("Makefile", "pyproject.toml", "README.md", "SECURITY.md")
QUARK_HOME = "/opt/quark"
CONTAINERD_DIR = "/etc/containerd"
QUARK_ETC = "/etc/quark"
CNI_BIN_DEFAULT = "/opt/cni/bin"
CNI_BIN_DEBIAN = "/usr/lib/cni"
# every host directory this installer writes under --host-root; deploy/daemonset.yaml mounts these
HOST_DIRS = (QUARK_HOME, CONTAINERD_DIR, QUARK_ETC, CNI_BIN_DEFAULT, CNI_BIN_DEBIAN)
IMPORTS_GLOB = f"{CONTAINERD_DIR}/conf.d/*.toml"
NODE_LABEL = ("quark.io/runtime", "true")
ON_HOST = ["nsenter", "--target", "1", "--mount", "--uts", "--ipc", "--net", "--pid", "--"]


class InstallError(Exception):
    pass


class Installer:
    def __init__(self, host_root: str, source: str, config_dir: str | None, dry_run: bool) -> None:
        self.root, self.source, self.config_dir, self.dry_run = host_root, source, config_dir, dry_run
        self.changed: list[str] = []        # host paths written by this run
        self.commands: list[list[str]] = []  # host commands run (or, dry, planned)

    def host(self, path: str) -> str:
        return os.path.join(self.root, path.lstrip("/"))

    def run(self) -> None:
        src_changed = self.copy_source()
        if src_changed or not os.path.exists(self.host(f"{QUARK_HOME}/src/.venv/bin/quark")):
            self.on_host(["make", "-C", f"{QUARK_HOME}/src", "install"])
        self.link_cni()
        containerd_changed = self.containerd_config()
        self.tsor_config()
        if containerd_changed:
            self.on_host(["systemctl", "restart", "containerd"])

    # ---- steps ---------------------------------------------------------------------------------
    def copy_source(self) -> bool:
        dest = self.host(f"{QUARK_HOME}/src")
        before = len(self.changed)
        for d in SOURCE_DIRS:
            for dirpath, dirnames, filenames in os.walk(os.path.join(self.source, d)):
                dirnames[:] = [n for n in dirnames if n != "__pycache__"]
                for name in filenames:
                    if name.endswith((".pyc", ".so", ".o")) or name == "_quark":
                        continue   # built on the host by make install
                    rel = os.path.relpath(os.path.join(dirpath, name), self.source)
                    self._copy(os.path.join(self.source, rel), os.path.join(dest, rel))
        for name in SOURCE_FILES:
            self._copy(os.path.join(self.source, name), os.path.join(dest, name))
        return len(self.changed) > before

    def link_cni(self) -> None:
        target = f"{QUARK_HOME}/src/.venv/bin/quark-cni"
        link = os.path.join(self.cni_bin_dir(), "quark-cni")
        path = self.host(link)
        if os.path.islink(path) and os.readlink(path) == target:
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if os.path.lexists(path):
            os.unlink(path)
        os.symlink(target, path)
        self.changed.append(link)

    def cni_bin_dir(self) -> str:
        """Where containerd's CRI looks for CNI plugins: its config's bin_dir, else the default."""
        cfg = self._containerd_toml()
        cni = cfg.get("plugins", {}).get("io.containerd.grpc.v1.cri", {}).get("cni", {})
        bin_dir = cni.get("bin_dir", CNI_BIN_DEFAULT)
        if bin_dir not in (CNI_BIN_DEFAULT, CNI_BIN_DEBIAN):
            raise InstallError(f"{CONTAINERD_DIR}/config.toml: cni bin_dir {bin_dir} is not one of the "
                               f"directories the DaemonSet mounts ({CNI_BIN_DEFAULT}, {CNI_BIN_DEBIAN})")
        return bin_dir

    def containerd_config(self) -> bool:
        before = len(self.changed)
        self._write(f"{CONTAINERD_DIR}/conf.d/quark.toml",
                    open(os.path.join(self.source, "deploy", "containerd", "quark.toml")).read())
        path = f"{CONTAINERD_DIR}/config.toml"
        try:
            text = open(self.host(path)).read()
        except FileNotFoundError:
            text = "version = 2\n"
        self._write(path, with_import(text, path))
        return len(self.changed) > before

    def tsor_config(self) -> None:
        if self.config_dir is None:
            return
        for name, dest, mode in (("tsor.yaml", f"{QUARK_ETC}/tsor.yaml", 0o644),
                                 ("tsor-secret", f"{QUARK_ETC}/tsor-secret", 0o600)):
            src = os.path.join(self.config_dir, name)
            if os.path.exists(src):
                self._write(dest, open(src).read(), mode)

    # ---- helpers -------------------------------------------------------------------------------
    def _containerd_toml(self) -> dict:
        try:
            with open(self.host(f"{CONTAINERD_DIR}/config.toml"), "rb") as f:
                return tomllib.load(f)
        except FileNotFoundError:
            return {}
        except tomllib.TOMLDecodeError as e:
            raise InstallError(f"{CONTAINERD_DIR}/config.toml: not valid TOML: {e}") from None

    def _copy(self, src: str, dest: str) -> None:
        if os.path.exists(dest) and filecmp.cmp(src, dest, shallow=False):
            return
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        shutil.copy2(src, dest)
        self.changed.append("/" + os.path.relpath(dest, self.root))

    def _write(self, path: str, text: str, mode: int = 0o644) -> None:
        dest = self.host(path)
        try:
            if open(dest).read() == text:
                return
        except FileNotFoundError:
            pass
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        tmp = dest + ".quark-tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.rename(tmp, dest)
        self.changed.append(path)

    def on_host(self, argv: list[str]) -> None:
        self.commands.append(argv)
        if self.dry_run:
            print("would run on the host:", " ".join(argv))
            return
        r = subprocess.run(ON_HOST + argv)
        if r.returncode != 0:
            raise InstallError(f"`{' '.join(argv)}` on the host failed (exit {r.returncode})")


def with_import(text: str, path: str) -> str:
    """containerd's config with IMPORTS_GLOB in its top-level `imports` (added when missing)."""
    try:
        imports = tomllib.loads(text).get("imports")
    except tomllib.TOMLDecodeError as e:
        raise InstallError(f"{path}: not valid TOML: {e}") from None
    if imports is not None and IMPORTS_GLOB in imports:
        return text
    line = re.compile(r"^imports[ \t]*=[ \t]*\[.*\][ \t]*$", re.M)
    if imports is not None:
        if len(line.findall(text)) != 1:
            raise InstallError(f"{path}: add {IMPORTS_GLOB!r} to its `imports` by hand (not a one-line list)")
        new = "imports = [" + ", ".join(f'"{i}"' for i in [*imports, IMPORTS_GLOB]) + "]"
        return line.sub(new, text, count=1)
    # a top-level key must come before the first table: right after `version`, else first
    version = re.compile(r"^version\s*=.*$", re.M).search(text)
    at = version.end() + 1 if version else 0
    return text[:at] + f'imports = ["{IMPORTS_GLOB}"]\n' + text[at:]


def label_node(node: str, kubeconfig: str | None = None) -> None:
    """quark.io/runtime=true on this node, through the API server: the pod's service account, or
    `kubeconfig` (an installer run by hand, the tests' API stand-in)."""
    what = f"labelling node {node} {NODE_LABEL[0]}={NODE_LABEL[1]}"
    try:
        from kubernetes import client, config
    except ImportError:
        raise InstallError(f"{what}: the kubernetes client is not installed in {sys.executable}'s "
                           "environment (the image's venv has it: run the installer with it)") from None
    try:
        if kubeconfig:
            api = client.CoreV1Api(config.new_client_from_config(config_file=kubeconfig))
        else:
            config.load_incluster_config()
            api = client.CoreV1Api()
        api.patch_node(node, {"metadata": {"labels": {NODE_LABEL[0]: NODE_LABEL[1]}}})
    except client.ApiException as e:   # the API server's answer: its status and reason, not a dump
        raise InstallError(f"{what}: the API server answered {e.status} {e.reason}") from None
    except Exception as e:   # noqa: BLE001 — config and connection errors have no common base
        raise InstallError(f"{what}: {e}") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="quark-install", description=__doc__.split("\n\n")[0])
    p.add_argument("--host-root", default="/host", help="where the host's directories are mounted")
    p.add_argument("--source", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p.add_argument("--config", default=None, help="a directory with tsor.yaml and tsor-secret (ConfigMap/Secret)")
    p.add_argument("--node", default=os.environ.get("NODE_NAME"), help="label this node (default: $NODE_NAME)")
    p.add_argument("--kubeconfig", default=None,
                   help="reach the API server with this kubeconfig (default: the pod's service account)")
    p.add_argument("--dry-run", action="store_true", help="print host commands instead of running them")
    args = p.parse_args(argv)
    inst = Installer(args.host_root, args.source, args.config, args.dry_run)
    try:
        inst.run()
        if args.node and not args.dry_run:
            label_node(args.node, args.kubeconfig)
    except (InstallError, OSError) as e:
        print(f"quark-install: {e}", file=sys.stderr)
        return 1
    for path in inst.changed:
        print("wrote", path)
    print(f"quark-install: {len(inst.changed)} files changed, {len(inst.commands)} host commands")
    return 0


if __name__ == "__main__":
    sys.exit(main())
