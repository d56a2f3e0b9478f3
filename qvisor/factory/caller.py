"""The factory's caller: whether the factory may run its request (same namespaces, root,
credentials, security context and limits, no runc-compatible manager above it), and, in the
worker, taking on what fork would have given a process the caller started — stdio, cwd,
environment, umask, rlimits, oom_score_adj, scheduling attributes, cgroups, command line."""
from __future__ import annotations

import logging
import os
import resource

from qlib import linux as L
from qlib import procfs, sched
from qvisor import cgroups

log = logging.getLogger("quark.factory")

RLIMITS = {getattr(resource, n): n for n in sorted(dir(resource), reverse=True) if n.startswith("RLIMIT_")}
_NAMESPACES = ("mnt", "pid", "net", "ipc", "uts", "user", "cgroup", "time")
_SAME_STATUS = ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp")


def current_umask() -> int:
    old = os.umask(0o22)
    os.umask(old)
    return old


def identity(pid: int) -> tuple:
    """What must be the factory's own for it to act for `pid`: namespaces, root directory,
    capabilities, no_new_privs, seccomp state and LSM context."""
    st = procfs.status(pid)
    root = os.stat(f"/proc/{pid}/root")
    return (_namespaces(pid), (root.st_dev, root.st_ino), tuple(st.get(k) for k in _SAME_STATUS), _lsm(pid))


def context_refusal(pid: int, mine: tuple) -> str:
    """Why the caller's context keeps the factory from acting for it ("" when it does not); a
    runc-compatible manager above the caller is the factory's refusal of a create (server.py).
    OSError or KeyError: the caller went away."""
    if identity(pid) != mine:
        return "the caller's namespaces, root, credentials or security context differ from the factory's"
    for r in RLIMITS:   # the worker takes the caller's limits: it cannot raise a hard one
        caller, own = resource.prlimit(pid, r)[1], resource.getrlimit(r)[1]
        if own != resource.RLIM_INFINITY and (caller == resource.RLIM_INFINITY or caller > own):
            return f"the caller's hard {RLIMITS[r]} is above the factory's"
    return ""


def adopt(caller: int, fds: list[int], env: dict[str, str], umask: int, cmdline: list[str],
          join_cgroups_too: bool) -> None:
    """In a worker: become the caller's process. `fds` (stdin, stdout, stderr, cwd) are consumed."""
    for i in range(3):
        os.dup2(fds[i], i)   # inheritable: these are the process's stdio from now on
    os.fchdir(fds[3])
    for fd in fds:
        if fd > 2:
            os.close(fd)
    fds.clear()
    os.umask(umask)
    os.environ.clear()
    os.environ.update(env)
    for r in RLIMITS:
        resource.setrlimit(r, resource.prlimit(caller, r))
    with open(f"/proc/{caller}/oom_score_adj") as f:
        adj = f.read().strip()
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write(adj)
    # what fork would have passed on (nice, policy, I/O priority, CPUs): the caller's, not the
    # factory's, for the verb and for the supervisor and container a create makes
    sched.Scheduling.of(caller).apply()
    if join_cgroups_too:   # a create's supervisor (the shim's server) lives where the caller's processes live
        with open(f"/proc/{caller}/cgroup") as f:
            cgroups.join(f.read())
    try:
        L.set_cmdline(cmdline, env)
    except OSError as e:   # cosmetic (ps); a kernel without PR_SET_MM_MAP
        log.debug("cmdline not set: %s", e)


def _namespaces(pid: int | str) -> tuple:
    out = []
    for ns in _NAMESPACES:
        try:
            out.append(os.stat(f"/proc/{pid}/ns/{ns}").st_ino)
        except FileNotFoundError:
            out.append(None)   # a kernel without this namespace type
    return tuple(out)


def _lsm(pid: int | str) -> bytes:
    try:
        with open(f"/proc/{pid}/attr/current", "rb") as f:
            return f.read()
    except OSError:
        return b""


def runc_managers_above(pid: int) -> list[str]:
    """The runc-compatible managers (conmon, containerd's runc shim: child subreapers) among `pid`
    and its ancestors, by their programs' names, nearest first."""
    return [name for name in _ancestors(pid) if name.startswith(procfs.RUNC_MANAGERS)]


def _ancestors(pid: int) -> list[str]:
    names = []
    while pid > 1:
        try:
            names.append(os.path.basename(os.readlink(f"/proc/{pid}/exe")))
        except OSError:
            break
        pid = procfs.parent_pid(pid) or 0
    return names
