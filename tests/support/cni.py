"""Running CNI plugins as a container runtime does (libcni's rules, in Python, for tests): each
plugin of a conflist gets the list's name and cniVersion, ADD passes each result on as the next
plugin's prevResult, DEL runs the list backwards with the ADD's result, and the CNI_* variables
are the same for all. Optionally inside a network namespace of the test's own (`ip netns exec`),
so a bridge the chain makes never appears on the host."""
from __future__ import annotations

import json
import os
import subprocess
import sys

SYSTEM_PLUGINS = "/usr/lib/cni"   # Debian's containernetworking-plugins


def quark_cni() -> str:
    """The installed `quark-cni` console script, beside this interpreter (`make install`)."""
    return os.path.join(os.path.dirname(sys.executable), "quark-cni")


def bin_dir(path: str) -> str:
    """A CNI_PATH of the test's own: the system plugins and quark-cni, linked."""
    os.makedirs(path, exist_ok=True)
    for name in ("bridge", "host-local", "loopback"):
        os.symlink(os.path.join(SYSTEM_PLUGINS, name), os.path.join(path, name))
    os.symlink(quark_cni(), os.path.join(path, "quark-cni"))
    return path


def invoke(cni_path: str, command: str, conf: dict, *, container: str = "", netns: str = "",
           ifname: str = "eth0", args: str = "", in_netns: str | None = None,
           env: dict[str, str] | None = None) -> tuple[int, dict | None, str]:
    """One plugin run: (exit code, stdout as JSON or None when empty, stderr)."""
    full = {**os.environ, **(env or {}), "CNI_COMMAND": command, "CNI_CONTAINERID": container,
            "CNI_NETNS": netns, "CNI_IFNAME": ifname, "CNI_ARGS": args, "CNI_PATH": cni_path}
    argv = [os.path.join(cni_path, conf["type"])]
    if in_netns:
        argv = ["ip", "netns", "exec", in_netns, *argv]
    p = subprocess.run(argv, input=json.dumps(conf).encode(), capture_output=True, env=full, timeout=60)
    out = p.stdout.decode().strip()
    return p.returncode, json.loads(out) if out else None, p.stderr.decode()


class Chain:
    """A conflist run as a runtime runs it."""

    def __init__(self, conflist: dict, cni_path: str, in_netns: str | None = None) -> None:
        self.conflist, self.cni_path, self.in_netns = conflist, cni_path, in_netns

    def _conf(self, plugin: dict, prev: dict | None) -> dict:
        conf = {**plugin, "name": self.conflist["name"], "cniVersion": self.conflist["cniVersion"]}
        if prev is not None:
            conf["prevResult"] = prev
        return conf

    def add(self, container: str, netns: str, args: str = "") -> tuple[dict, list[dict]]:
        """(the final result, each plugin's result); AssertionError naming the plugin that failed."""
        prev, results = None, []
        for plugin in self.conflist["plugins"]:
            rc, out, err = invoke(self.cni_path, "ADD", self._conf(plugin, prev), container=container,
                                  netns=netns, args=args, in_netns=self.in_netns)
            assert rc == 0, f"ADD {plugin['type']}: exit {rc}: {out} {err}"
            prev = out
            results.append(out)
        return prev, results

    def check(self, container: str, netns: str, result: dict) -> list[tuple[int, dict | None, str]]:
        return [invoke(self.cni_path, "CHECK", self._conf(p, result), container=container, netns=netns,
                       in_netns=self.in_netns) for p in self.conflist["plugins"]]

    def delete(self, container: str, netns: str, result: dict | None) -> list[tuple[int, dict | None, str]]:
        return [invoke(self.cni_path, "DEL", self._conf(p, result), container=container, netns=netns,
                       in_netns=self.in_netns) for p in reversed(self.conflist["plugins"])]
