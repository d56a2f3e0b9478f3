"""The processes quark runs on a node, seen by quark-install (deploy/install.py) before --uninstall:
with the DaemonSet's hostPID, /proc is the host's."""
from __future__ import annotations

import os
import signal
import time

from deploy.node_config import InstallError
from qlib import procfs

FACTORY = " -m qvisor.factory "   # in a sandbox factory's command line (qvisor/factory/client.py starts it)


def quark_processes(home: str) -> list[str]:
    """The processes running a program under `home` (the host's, with the DaemonSet's hostPID),
    but this one and its parent: "PID COMMAND LINE" each."""
    me, found = {os.getpid(), os.getppid()}, []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) not in me:
            try:
                exe = os.readlink(f"/proc/{name}/exe")
            except OSError:
                continue
            if exe.startswith(home.rstrip("/") + "/"):
                try:
                    with open(f"/proc/{name}/cmdline", "rb") as f:
                        argv = f.read().rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")
                except OSError:
                    continue
                found.append(f"{name} {argv[:120]}")
    return sorted(found, key=lambda p: int(p.split()[0]))


def stop_factories(home: str, timeout: float = 10.0) -> None:
    """SIGTERM to the sandbox factories running from `home` (qvisor/factory/: they stay a while
    after their last container, and their spare workers with them), and wait for them all to end."""
    def factories() -> dict[int, int]:   # pid -> parent pid
        out = {}
        for p in quark_processes(home):
            if FACTORY in p:
                pid = int(p.split()[0])
                if (ppid := procfs.parent_pid(pid)) is not None:
                    out[pid] = ppid
        return out
    found = factories()
    for pid, ppid in found.items():
        if ppid not in found:   # the factory itself; it ends its workers
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + timeout
    while found and time.monotonic() < deadline:
        time.sleep(0.1)
        found = factories()
    if found:
        raise InstallError(f"quark's sandbox factories did not stop (pids {', '.join(map(str, found))}); "
                           "nothing removed")
