"""Installs quark on a Kubernetes node, and takes it off again (--uninstall). Run by the DaemonSet's
init container (deploy/daemonset.yaml), by the cleanup DaemonSet (deploy/cleanup/), or by hand.

The container sees the host's directories under --host-root (hostPath volumes; HOST_DIRS below is
the list the DaemonSet mounts, and a test holds the two together). Nothing is installed with a
package manager and nothing runs on the host but the containerd restart. It

1. copies the node payload (deploy/payload.py: quark, its own Python and libraries) to
   /opt/quark/versions/ID beside the earlier ones and makes it current by renaming links; an
   earlier version goes once no process maps a file of it (deploy/versions.py: a running shim or
   supervisor keeps importing its own version's modules, never the next one's);
2. links quark-cni into the CNI bin dir containerd uses (its config's cri.cni.bin_dir), and
   containerd-shim-quark-v1 into /usr/local/bin (containerd 1.6 looks for a CRI runtime's shim on
   its PATH only: the CRI's runtime_path is not used for it);
3. adds quark's runtimes (deploy/containerd/quark.toml, pointed at /opt/quark) to the end of
   /etc/containerd/config.toml, between two marker lines, keeping the rest. Not a drop-in under
   conf.d: containerd 1.6 merges an imported file plugin by plugin, so a drop-in's CRI section
   replaces the node's whole CRI configuration (its CNI directories, its runc: the fresh-node
   test saw containerd refuse to start its CRI);
4. chains quark-cni into the node's network: appended to the plugins of the conflist containerd
   uses (the first in its cri.cni.conf_dir), the original kept for --uninstall;
5. writes /etc/quark/config.yaml (quark's host configuration), /etc/quark/tsor.yaml and the cluster
   secret (0600) from the mounted ConfigMap/Secret;
6. restarts containerd when its configuration changed, and only then (--restart-containerd, run in
   the host's namespaces through nsenter);
7. labels the node `quark.io/runtime=true` (the RuntimeClass schedules quark pods there).

What it wrote and what was there before is kept in /opt/quark/install-state.json. --uninstall puts
each file back (a file changed since by someone else is left as it is, and said), removes
/opt/quark and the directories it made, restarts containerd if its configuration changed, and
takes the label off. It refuses while quark still runs on the node. Each run is idempotent: a
second changes nothing and restarts nothing. --dry-run does the file work under --host-root and prints the host commands
instead of running them.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import stat
import subprocess
import sys
import tomllib
from collections.abc import Callable

from deploy import versions
from deploy.node_config import InstallError, first_network, node_runtimes, with_quark_cni, with_runtimes
from deploy.node_processes import FACTORY, quark_processes, stop_factories

QUARK_HOME = "/opt/quark"
STATE = f"{QUARK_HOME}/install-state.json"
VERSIONS = f"{QUARK_HOME}/{versions.VERSIONS}"
CONTAINERD_DIR = "/etc/containerd"
CONTAINERD_CONFIG = f"{CONTAINERD_DIR}/config.toml"
QUARK_ETC = "/etc/quark"
CNI_BIN_DEFAULT = "/opt/cni/bin"
CNI_BIN_DEBIAN = "/usr/lib/cni"
CNI_CONF_DEFAULT = "/etc/cni/net.d"
SHIM_LINK = "/usr/local/bin/containerd-shim-quark-v1"
# every host directory this installer writes under --host-root; deploy/daemonset.yaml mounts these
HOST_DIRS = (QUARK_HOME, CONTAINERD_DIR, QUARK_ETC, CNI_BIN_DEFAULT, CNI_BIN_DEBIAN, CNI_CONF_DEFAULT,
             os.path.dirname(SHIM_LINK))
NODE_LABEL = ("quark.io/runtime", "true")
RESTART_CONTAINERD = "systemctl restart containerd"
LINK = "\0link:"   # in the record of a file: a symbolic link to what follows
HERE = os.path.dirname(os.path.abspath(__file__))
# the payload this installer came with (HERE is its lib/python3/dist-packages/deploy): the image's
# /opt/quark, a node's /opt/quark/versions/ID; or, in a checkout, its build/payload (make payload)
_IN_PAYLOAD = "/lib/python3/dist-packages/deploy"
OWN_PAYLOAD = HERE[:-len(_IN_PAYLOAD)] if HERE.endswith(_IN_PAYLOAD) else \
    os.path.join(os.path.dirname(HERE), "build", "payload")


class Installer:
    def __init__(self, host_root: str, payload: str, config_dir: str | None = None, *, host_pid: int = 1,
                 restart: str = RESTART_CONTAINERD, dry_run: bool = False) -> None:
        self.root, self.payload, self.config_dir = host_root, payload, config_dir
        self.host_pid, self.restart, self.dry_run = host_pid, restart, dry_run
        self.changed: list[str] = []        # host paths written or removed by this run
        self.commands: list[list[str]] = []  # host commands run (or, dry, planned)
        self.notes: list[str] = []           # what was left as it is, and why
        self.state = self._load_state()

    def host(self, path: str) -> str:
        return os.path.join(self.root, path.lstrip("/"))

    # ---- install -------------------------------------------------------------------------------
    def install(self) -> None:
        if not os.path.exists(os.path.join(self.payload, "bin", "quark")):
            raise InstallError(f"{self.payload}: not a quark payload (make payload builds one)")
        try:
            self.copy_payload()
            self.link_programs()
            containerd_changed = self.containerd_config()
            self.chain_cni()
            self.tsor_config()
        finally:   # what was written is recorded even when a later step failed: --uninstall undoes it
            self._save_state()
        if containerd_changed:
            self.on_host(shlex.split(self.restart))

    def copy_payload(self) -> None:
        """The payload as a version of its own beside the others, made current (deploy/versions.py
        says why and how); the versions no process maps any more removed."""
        home = self.host(QUARK_HOME)
        self._mkdirs(QUARK_HOME)
        try:
            ident = versions.payload_id(self.payload)
        except ValueError as e:
            raise InstallError(str(e)) from None
        tree = os.path.join(home, versions.VERSIONS, ident)
        self._set_aside_a_flat_payload(home)
        os.makedirs(os.path.dirname(tree), exist_ok=True)
        if not os.path.isdir(tree):   # (a version's tree is complete once it has its name: renamed last)
            stage = os.path.join(os.path.dirname(tree), f".{ident}.quark-tmp")
            if os.path.lexists(stage):
                _remove(stage)   # a run that stopped half way
            shutil.copytree(self.payload, stage, symlinks=True)
            os.rename(stage, tree)
            self.changed.append(f"{VERSIONS}/{ident}")
        self._link(f"{versions.VERSIONS}/{ident}", os.path.join(home, versions.CURRENT))
        names = sorted(n for n in os.listdir(tree) if n != versions.ID_FILE)
        for name in names:
            if name == versions.BIN:
                self._bin_links(home, tree, ident)
            else:
                self._link(f"{versions.CURRENT}/{name}", os.path.join(home, name))
        keep = {*names, versions.VERSIONS, versions.CURRENT, os.path.basename(STATE)}
        for name in sorted(set(os.listdir(home)) - keep):   # a link an earlier payload had
            _remove(os.path.join(home, name))
            self.changed.append(f"{QUARK_HOME}/{name}")
        self._remove_unused_versions(home, ident)

    def _bin_links(self, home: str, tree: str, ident: str) -> None:
        """bin/NAME -> ../versions/ID/bin/NAME for each program (not through `current`: a
        program's Python then has its own version's tree as its prefix)."""
        bin_dir = os.path.join(home, versions.BIN)
        if os.path.islink(bin_dir):
            os.unlink(bin_dir)
        os.makedirs(bin_dir, exist_ok=True)
        programs = os.listdir(os.path.join(tree, versions.BIN))
        for name in sorted(programs):
            self._link(f"../{versions.VERSIONS}/{ident}/{versions.BIN}/{name}", os.path.join(bin_dir, name))
        for name in sorted(set(os.listdir(bin_dir)) - set(programs)):
            _remove(os.path.join(bin_dir, name))
            self.changed.append(f"{QUARK_HOME}/{versions.BIN}/{name}")

    def _set_aside_a_flat_payload(self, home: str) -> None:
        """An install by an earlier quark-install copied the payload into /opt/quark itself: its
        directories are moved (not removed: its running programs keep their files) into
        versions/flat, which goes as any version does."""
        if os.path.lexists(os.path.join(home, versions.CURRENT)):
            return
        flat = [n for n in os.listdir(home) if n not in (versions.VERSIONS, os.path.basename(STATE))
                and not n.endswith(".quark-tmp")]
        if not flat:
            return
        aside = os.path.join(home, versions.VERSIONS, "flat")
        os.makedirs(aside, exist_ok=True)
        for name in flat:
            os.rename(os.path.join(home, name), os.path.join(aside, name))

    def _remove_unused_versions(self, home: str, current: str) -> None:
        root = os.path.join(home, versions.VERSIONS)
        for name in sorted(os.listdir(root)):
            if name == current:
                continue
            path = os.path.join(root, name)
            pids = [] if name.endswith(".quark-tmp") else versions.users(path)
            if pids:
                self.notes.append(f"{VERSIONS}/{name} kept: running programs use it "
                                  f"(pids {', '.join(map(str, pids[:8]))}); the next run removes it once they end")
                continue
            _remove(path)
            self.changed.append(f"{VERSIONS}/{name}")

    def link_programs(self) -> None:
        """quark-cni where containerd's CNI looks, the shim where containerd 1.6 looks."""
        for link, target in ((os.path.join(self.cni_dirs()[0], "quark-cni"), f"{QUARK_HOME}/bin/quark-cni"),
                             (SHIM_LINK, f"{QUARK_HOME}/bin/containerd-shim-quark-v1")):
            self._mkdirs(os.path.dirname(link))
            self._edit(link, lambda _, t=target: LINK + t)

    def containerd_config(self) -> bool:
        before = len(self.changed)
        fragment = node_runtimes(open(os.path.join(self.payload, "share", "containerd-quark.toml")).read(), QUARK_HOME)
        self._mkdirs(CONTAINERD_DIR)
        self._edit(CONTAINERD_CONFIG, lambda text: with_runtimes(text or "version = 2\n", fragment, CONTAINERD_CONFIG))
        return len(self.changed) > before

    def chain_cni(self) -> None:
        conf_dir = self.cni_dirs()[1]
        path = first_network(self.host(conf_dir))
        if path is None:
            self.notes.append(f"{conf_dir} has no network configuration yet: quark-cni not chained "
                              "(run the installer again once the network plugin has written it)")
            return
        path = os.path.join(conf_dir, os.path.basename(path))
        self._edit(path, lambda text: with_quark_cni(text, path))

    def tsor_config(self) -> None:
        if self.config_dir is None:
            return
        for name, dest, mode in (("config.yaml", f"{QUARK_ETC}/config.yaml", 0o644),
                                 ("tsor.yaml", f"{QUARK_ETC}/tsor.yaml", 0o644),
                                 ("tsor-secret", f"{QUARK_ETC}/tsor-secret", 0o600)):
            src = os.path.join(self.config_dir, name)
            if os.path.exists(src):
                self._mkdirs(QUARK_ETC)
                text = open(src).read()
                self._edit(dest, lambda _: text, mode)

    # ---- uninstall -----------------------------------------------------------------------------
    def uninstall(self) -> None:
        if not os.path.exists(self.host(STATE)):
            if os.path.isdir(self.host(QUARK_HOME)) and os.listdir(self.host(QUARK_HOME)):
                raise InstallError(f"{STATE} is missing: {QUARK_HOME} was not made by this installer; "
                                   "nothing removed")
            return   # not installed, or taken off already
        running = [p for p in quark_processes(QUARK_HOME) if FACTORY not in p]
        if running:   # their shims and supervisors would lose their files, containerd its shim
            raise InstallError(f"quark still runs on this node ({'; '.join(running[:5])}): "
                               "remove the pods with runtimeClassName quark and the quark-node DaemonSet "
                               "first; nothing removed")
        stop_factories(QUARK_HOME)   # no shim is left, so no sandbox: what is left of quark is its idle factories
        containerd_changed = False
        for path, rec in sorted(self.state["files"].items(), reverse=True):
            now = _read(self.host(path))
            if now != rec["written"]:
                self.notes.append(f"{path} changed since quark wrote it: left as it is")
                continue
            if os.path.lexists(self.host(path)):
                os.unlink(self.host(path))
            if rec["original"] is not None:
                self._write_file(self.host(path), rec["original"], rec["mode"])
            self.changed.append(path)
            containerd_changed |= path.startswith(CONTAINERD_DIR + "/")
        # its contents: /opt/quark itself may be a mount point (the DaemonSet's hostPath)
        for name in os.listdir(self.host(QUARK_HOME)):
            _remove(os.path.join(self.host(QUARK_HOME), name))
        self.changed.append(QUARK_HOME)
        for d in sorted(self.state["dirs"], key=len, reverse=True):   # the ones it made, if empty now
            if os.path.isdir(self.host(d)) and not os.listdir(self.host(d)) and not os.path.ismount(self.host(d)):
                os.rmdir(self.host(d))
                self.changed.append(d)
        if containerd_changed:
            self.on_host(shlex.split(self.restart))

    # ---- where containerd looks ----------------------------------------------------------------
    def cni_dirs(self) -> tuple[str, str]:
        """containerd's CRI CNI bin_dir and conf_dir: its config's, else the defaults."""
        try:
            with open(self.host(CONTAINERD_CONFIG), "rb") as f:
                cfg = tomllib.load(f)
        except FileNotFoundError:
            cfg = {}
        except tomllib.TOMLDecodeError as e:
            raise InstallError(f"{CONTAINERD_CONFIG}: not valid TOML: {e}") from None
        cni = cfg.get("plugins", {}).get("io.containerd.grpc.v1.cri", {}).get("cni", {})
        bin_dir, conf_dir = cni.get("bin_dir", CNI_BIN_DEFAULT), cni.get("conf_dir", CNI_CONF_DEFAULT)
        for key, value in (("bin_dir", bin_dir), ("conf_dir", conf_dir)):
            if value not in HOST_DIRS:
                raise InstallError(f"{CONTAINERD_CONFIG}: cni {key} {value} is not one of the directories "
                                   f"the DaemonSet mounts ({', '.join(HOST_DIRS)})")
        return bin_dir, conf_dir

    # ---- files, and the record of them ---------------------------------------------------------
    def _load_state(self) -> dict:
        try:
            with open(self.host(STATE)) as f:
                return json.load(f)
        except FileNotFoundError:
            return {"files": {}, "dirs": []}
        except (ValueError, OSError) as e:
            raise InstallError(f"{STATE}: unreadable ({e}); remove {QUARK_HOME} by hand") from None

    def _save_state(self) -> None:
        if os.path.isdir(self.host(QUARK_HOME)):
            self._write_file(self.host(STATE), json.dumps(self.state, indent=1, sort_keys=True) + "\n", 0o600)

    def _mkdirs(self, path: str) -> None:
        missing = []
        while not os.path.isdir(self.host(path)):
            missing.append(path)
            path = os.path.dirname(path)
        for d in reversed(missing):
            os.mkdir(self.host(d), 0o755)
            self.state["dirs"].append(d)

    def _edit(self, path: str, new_text: Callable[[str | None], str], mode: int = 0o644) -> None:
        """Write new_text(what is there) to `path` if that differs; the first time, remember what
        was there (None: nothing) and its mode, for --uninstall."""
        dest = self.host(path)
        now = _read(dest)
        text = new_text(now)
        if now == text:
            return   # as quark writes it (by an earlier run, recorded then; or by someone else)
        if path not in self.state["files"]:
            self.state["files"][path] = {"original": now, "mode": _mode(dest, mode)}
        self.state["files"][path]["written"] = text
        self._write_file(dest, text, mode)
        self.changed.append(path)

    def _link(self, target: str, path: str) -> None:
        if os.path.islink(path) and os.readlink(path) == target:
            return
        self._write_file(path, LINK + target, 0o777)
        self.changed.append("/" + os.path.relpath(path, self.root))

    @staticmethod
    def _write_file(dest: str, text: str, mode: int) -> None:
        """`text` into `dest` by a rename (or, after LINK, a symbolic link in place of what is there)."""
        if text.startswith(LINK):   # replaced by a rename too: `current` switches in one step
            if os.path.isdir(dest) and not os.path.islink(dest):
                _remove(dest)
            tmp = dest + ".quark-tmp"
            if os.path.lexists(tmp):
                os.unlink(tmp)
            os.symlink(text[len(LINK):], tmp)
            os.rename(tmp, dest)
            return
        tmp = dest + ".quark-tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.rename(tmp, dest)

    def on_host(self, argv: list[str]) -> None:
        self.commands.append(argv)
        if self.dry_run:
            print("would run on the host:", shlex.join(argv))
            return
        on_host = ["nsenter", "--target", str(self.host_pid), "--mount", "--uts", "--ipc", "--net", "--pid", "--"]
        r = subprocess.run(on_host + argv)
        if r.returncode != 0:
            raise InstallError(f"`{shlex.join(argv)}` on the host failed (exit {r.returncode})")


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _read(path: str) -> str | None:
    """A file's text; a symbolic link's target after LINK; None: nothing there."""
    try:
        if os.path.islink(path):
            return LINK + os.readlink(path)
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return None


def _mode(path: str, default: int) -> int:
    try:
        return stat.S_IMODE(os.lstat(path).st_mode)
    except FileNotFoundError:
        return default


def label_node(node: str, kubeconfig: str | None = None, remove: bool = False) -> None:
    """quark.io/runtime=true on this node (or, remove, off it), through the API server: the pod's
    service account, or `kubeconfig` (an installer run by hand, the tests' API stand-in)."""
    what = f"{'unlabelling' if remove else 'labelling'} node {node} {NODE_LABEL[0]}={NODE_LABEL[1]}"
    try:
        from kubernetes import client, config
    except ImportError:
        raise InstallError(f"{what}: the kubernetes client is not installed in {sys.executable}'s "
                           "environment (the payload's Python has it: run /opt/quark/bin/quark-install)") from None
    try:
        if kubeconfig:
            api = client.CoreV1Api(config.new_client_from_config(config_file=kubeconfig))
        else:
            config.load_incluster_config()
            api = client.CoreV1Api()
        # a merge patch: null deletes the key (RFC 7386)
        api.patch_node(node, {"metadata": {"labels": {NODE_LABEL[0]: None if remove else NODE_LABEL[1]}}})
    except client.ApiException as e:   # the API server's answer: its status and reason, not a dump
        if remove and e.status == 404:
            return   # no such node: nothing to take off
        raise InstallError(f"{what}: the API server answered {e.status} {e.reason}") from None
    except Exception as e:   # noqa: BLE001 — config and connection errors have no common base
        raise InstallError(f"{what}: {e}") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="quark-install", description=__doc__.split("\n\n")[0])
    p.add_argument("--host-root", default="/host", help="where the host's directories are mounted")
    p.add_argument("--payload", default=OWN_PAYLOAD, help="the node payload to copy (make payload; default: the one this installer runs from)")
    p.add_argument("--config", default=None, help="a directory with tsor.yaml and tsor-secret (ConfigMap/Secret)")
    p.add_argument("--node", default=os.environ.get("NODE_NAME"), help="label this node (default: $NODE_NAME)")
    p.add_argument("--kubeconfig", default=None,
                   help="reach the API server with this kubeconfig (default: the pod's service account)")
    p.add_argument("--host-pid", type=int, default=1, help="a process in the host's namespaces (default: 1)")
    p.add_argument("--restart-containerd", default=RESTART_CONTAINERD, metavar="COMMAND",
                   help=f"how containerd is restarted on the host (default: {RESTART_CONTAINERD})")
    p.add_argument("--uninstall", action="store_true", help="put the node back as it was before the install")
    p.add_argument("--dry-run", action="store_true", help="print host commands instead of running them")
    args = p.parse_args(argv)
    try:
        inst = Installer(args.host_root, os.path.abspath(args.payload), args.config, host_pid=args.host_pid,
                         restart=args.restart_containerd, dry_run=args.dry_run)
        inst.uninstall() if args.uninstall else inst.install()
        if args.node and not args.dry_run:
            label_node(args.node, args.kubeconfig, remove=args.uninstall)
    except (InstallError, OSError) as e:
        print(f"quark-install: {e}", file=sys.stderr)
        return 1
    for note in inst.notes:
        print("note:", note)
    print(f"quark-install: {'removed' if args.uninstall else 'installed'}: {len(inst.changed)} paths changed, "
          f"{len(inst.commands)} host commands")
    return 0


if __name__ == "__main__":
    sys.exit(main())
