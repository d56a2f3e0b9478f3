"""TCP_NODELAY and TCP_CORK on local-path sockets without a trapped syscall.

A local-path end is an AF_UNIX socket, which has no TCP options: setsockopt(SOL_TCP, TCP_CORK) on it
is EOPNOTSUPP, so QKernel has had to trap the call and answer it. nginx as Debian ships it corks and
uncorks around every response, and those two traps were what kept it far below runc's speed
(before and after: bench/README.md, "Socket options without a trap"). Here the kernel answers
instead: two cgroup BPF programs (tsor/bpf/sockopt.bpf.c, compiled by `make install`, loaded with
libbpf), `setsockopt` and `getsockopt`, take TCP_NODELAY/TCP_CORK on an AF_UNIX socket and keep
their values in the socket's own BPF storage (freed with the socket: nothing to clean up), so a
value set reads back as it does on TCP. The sandbox's seccomp filter then stops trapping
get/setsockopt of those two options (qkernel/table.py, `sockopt_offload`).

A cgroup sockopt program runs for the cgroup of the process that *created* the socket (its cgroup
is fixed when it is made), not for the caller's. So the processes that make local-path ends — every
TSoR supervisor and tsord — move into one cgroup of quark's own in the unified (v2) hierarchy,
`quark-tsor`, which carries the programs; every AF_UNIX socket made there that reaches a container
is a local-path end. Supervisors join before they confine themselves (the join needs bpf(2)); after
it they never call bpf(2): carried option values are set with setsockopt on the new end, which the
program records. On a unified host the supervisors are accounted in `quark-tsor` rather than in
their caller's cgroup (they never were in the pod's).

Anything that does not work here (no cgroup2 mount, no BPF, the object not built or stale, a
program of someone else's attached) means `join()` answers None and the sandbox traps the two
options as before: slower, never wrong.
Upgrades: the programs' names carry a version; a newer quark replaces older programs.
"""
from __future__ import annotations

import fcntl
import logging
import os
import socket

from qlib import bpf, cgroupfs, libbpf

log = logging.getLogger("tsor.sockopt")

CGROUP_NAME = "quark-tsor"
PROG_PREFIX = "quark_sko"
VERSION = 2                      # the programs' names in the C source: bump both when a program changes
PROG_NAMES = {bpf.CGROUP_SETSOCKOPT: f"{PROG_PREFIX}{VERSION}_set",
              bpf.CGROUP_GETSOCKOPT: f"{PROG_PREFIX}{VERSION}_get"}
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bpf", "sockopt.bpf.c")
OBJECT = SOURCE[:-1] + "o"
LOCK_PATH = "/run/quark/tsor-sockopt.lock"
ANNOTATION = "io.quark.tsor.sockopt-offload"   # "false": this sandbox traps the options as before
TCP_NODELAY, TCP_CORK = socket.TCP_NODELAY, socket.TCP_CORK


class Offload:
    """This process is in quark's cgroup with the programs attached: AF_UNIX sockets it makes
    answer TCP_NODELAY/TCP_CORK."""

    def __init__(self, cgroup: str) -> None:
        self.cgroup = cgroup
        self.root = os.path.dirname(cgroup)

    def release(self, pid: int, like: int) -> None:
        """A child forked for the container (an exec'd process) goes back to the v2 cgroup of the
        container's process `like`: nothing of the container may make sockets in quark's cgroup.
        Needed on a hybrid host only, where quark places containers in the v1 hierarchies and a
        child would stay in its parent's v2 cgroup (a unified host's container cgroup is v2)."""
        with open(f"/proc/{like}/cgroup") as f:
            path = next((line[3:].strip() for line in f if line.startswith("0::")), None)
        if path is None or path.startswith("/" + CGROUP_NAME):
            raise OSError(0, f"no v2 cgroup of pid {like} to put pid {pid} in")
        with open(os.path.join(self.root + path, "cgroup.procs"), "w") as f:
            f.write(str(pid))

    @staticmethod
    def carry(sock: socket.socket, nodelay: bool, cork: bool) -> None:
        """Values set on the application's TCP socket before connect, onto its new end (the
        program records them; a fresh end reads 0 for both)."""
        if nodelay:
            sock.setsockopt(socket.SOL_TCP, TCP_NODELAY, 1)
        if cork:
            sock.setsockopt(socket.SOL_TCP, TCP_CORK, 1)


def cgroup2_root() -> str | None:
    """The unified hierarchy's mount: /sys/fs/cgroup on a v2 host, /sys/fs/cgroup/unified on a
    hybrid one; None without one."""
    for path in (cgroupfs.CGROUP_ROOT, os.path.join(cgroupfs.CGROUP_ROOT, "unified")):
        try:
            if cgroupfs.fs_type(path) == cgroupfs.CGROUP2_SUPER_MAGIC:
                return path
        except OSError:
            continue
    return None


def join(root: str | None = None, name: str = CGROUP_NAME) -> Offload | None:
    """Move this process into quark's cgroup, attaching the programs there first if they are not;
    None (logged) when the options must stay trapped."""
    root = root if root is not None else cgroup2_root()
    if root is None:
        log.info("socket options stay trapped: no cgroup2 hierarchy is mounted")
        return None
    path = os.path.join(root, name)
    try:
        os.makedirs(os.path.dirname(LOCK_PATH), exist_ok=True)
        with open(LOCK_PATH, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)   # one pair of programs per node, however many join at once
            os.makedirs(path, exist_ok=True)
            cgfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
            try:
                if not _attached(cgfd):
                    _attach(cgfd)
            finally:
                os.close(cgfd)
            with open(os.path.join(path, "cgroup.procs"), "w") as f:
                f.write("0")
        _self_test()
    except (OSError, ValueError) as e:
        log.warning("socket options stay trapped: %s: %s", path, e)
        return None
    return Offload(path)


def _self_test() -> None:
    """Prove the chain in this process before a filter relies on it: an AF_UNIX end made here
    takes TCP_CORK and reads it back. OSError if it does not."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    with a, b:
        a.setsockopt(socket.SOL_TCP, TCP_CORK, 1)
        if a.getsockopt(socket.SOL_TCP, TCP_CORK) != 1 or b.getsockopt(socket.SOL_TCP, TCP_CORK) != 0:
            raise OSError(0, "the programs did not keep TCP_CORK")


def _attached(cgfd: int) -> bool:
    """Whether this version's programs are both attached to the cgroup; ValueError if a program
    that is not quark's is (we replace only our own)."""
    found = set()
    for attach_type, name in PROG_NAMES.items():
        for prog_id in bpf.query(cgfd, attach_type)[1]:
            fd = bpf.prog_by_id(prog_id)
            try:
                have, _ = bpf.prog_info(fd)
            finally:
                os.close(fd)
            if not have.startswith(PROG_PREFIX):
                raise ValueError(f"a sockopt program that is not quark's ({have!r}) is attached")
            if have == name:
                found.add(attach_type)
    return len(found) == len(PROG_NAMES)


def _attach(cgfd: int) -> None:
    loaded = libbpf.load(OBJECT, SOURCE, PROG_NAMES.values())
    try:
        for attach_type in (bpf.CGROUP_GETSOCKOPT, bpf.CGROUP_SETSOCKOPT):
            bpf.attach(cgfd, loaded.programs[PROG_NAMES[attach_type]], attach_type,   # replaces an older one
                       what=f"attaching TSoR's socket-option program {PROG_NAMES[attach_type]}")
    finally:
        loaded.close()   # the attached programs hold their storage map


def remove_if_unused(root: str | None = None, name: str = CGROUP_NAME) -> bool:
    """Remove quark's cgroup (and with it the programs) when no process is in it; under the join
    lock, so a process about to join cannot lose it in between. Whether it is gone."""
    root = root if root is not None else cgroup2_root()
    if root is None:
        return True
    try:
        with open(LOCK_PATH, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            os.rmdir(os.path.join(root, name))
    except FileNotFoundError:
        return True
    except OSError:
        return False   # busy: a supervisor or tsord is in it
    return True


def wanted(annotations: dict[str, str]) -> bool:
    """Whether a sandbox takes the offload (the annotation may say no)."""
    return annotations.get(ANNOTATION, "true").lower() not in ("false", "0", "no")
