"""What quark-install (deploy/install.py) writes into a node's containerd and CNI configuration:
text in, text out, each refusal an InstallError naming the file."""
from __future__ import annotations

import json
import os
import tomllib


class InstallError(Exception):
    pass


BEGIN = "# --- quark's runtimes: added by quark-install (deploy/install.py); --uninstall takes them out ---"
END = "# --- end of quark's runtimes ---"
DEFAULT_RUNC = """# containerd's own default runtime, which it drops once its configuration names any other
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

"""
QUARK_CNI = {"type": "quark-cni", "failOpen": True}   # a pod still gets its network when tsord is down
CNI_VERSIONS = ("0.4.0", "1.0.0", "1.1.0")             # cni/plugin.py's SUPPORTED


def node_runtimes(fragment: str, home: str) -> str:
    """deploy/containerd/quark.toml's runtime tables for a node: the runc-compatible binary from
    `home` (the shim is found on containerd's PATH: install.SHIM_LINK)."""
    tables = fragment[fragment.index("\n[") + 1:]   # without its header comment and `version`
    return tables.replace('BinaryName = "/usr/local/bin/quark"', f'BinaryName = "{home}/bin/quark"')


def with_runtimes(text: str, tables: str, path: str) -> str:
    """containerd's config with quark's runtime tables at its end between BEGIN and END (replacing
    an earlier version of them), the rest as it was."""
    try:
        cfg = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise InstallError(f"{path}: not valid TOML: {e}") from None
    if cfg.get("version", 1) != 2:
        raise InstallError(f"{path}: version {cfg.get('version', 1)}: quark's runtimes are written for "
                           "version 2 (containerd 1.6, 1.7); add deploy/containerd/quark.toml's by hand")
    ours = tomllib.loads(tables)["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)].rstrip("\n") + "\n" + text[text.index(END) + len(END) + 1:]
        cfg = tomllib.loads(text)
    runtimes = cfg.get("plugins", {}).get("io.containerd.grpc.v1.cri", {}).get("containerd", {}).get("runtimes", {})
    taken = sorted(set(runtimes) & set(ours))
    if taken:
        raise InstallError(f"{path}: already configures the runtime {taken[0]!r}: take it out, or add "
                           "quark's by hand")
    if not runtimes:
        # a config naming any runtime has only the ones it names: containerd's default runc (the
        # default_runtime_name) would be gone
        tables = DEFAULT_RUNC + tables
    new = text.rstrip("\n") + "\n\n" + f"{BEGIN}\n{tables.rstrip()}\n{END}\n"
    try:
        tomllib.loads(new)
    except tomllib.TOMLDecodeError as e:   # e.g. the file defines these tables in another form
        raise InstallError(f"{path}: quark's runtimes cannot be added to it ({e}); add them by hand") from None
    return new


def first_network(conf_dir: str) -> str | None:
    """The network configuration containerd's CRI uses: the first of conf_dir's files by name
    (libcni's order), or None."""
    try:
        names = sorted(n for n in os.listdir(conf_dir) if n.endswith((".conflist", ".conf", ".json")))
    except FileNotFoundError:
        return None
    return os.path.join(conf_dir, names[0]) if names else None


def with_quark_cni(text: str | None, path: str) -> str:
    """A conflist with quark-cni as its last plugin (its place: after the plugins that give the pod
    its interface and addresses, whose result it reads)."""
    try:
        conf = json.loads(text or "")
    except ValueError as e:
        raise InstallError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(conf, dict) or not isinstance(conf.get("plugins"), list):
        raise InstallError(f"{path}: not a conflist (no `plugins` list): quark-cni can only be chained "
                           "into a plugin list")
    if conf.get("cniVersion") not in CNI_VERSIONS:
        raise InstallError(f"{path}: cniVersion {conf.get('cniVersion')!r}: quark-cni chains into "
                           f"{', '.join(CNI_VERSIONS)}")
    if any(isinstance(p, dict) and p.get("type") == "quark-cni" for p in conf["plugins"]):
        return text
    conf["plugins"].append(dict(QUARK_CNI))
    return json.dumps(conf, indent=2) + "\n"
