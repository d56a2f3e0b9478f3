"""The supervisor's own confinement, applied once the sandbox is created (gVisor does the same for
the Sentry): the supervisor services a hostile container's syscalls, so if it were ever subverted
it should hold as little as possible.

What it keeps, and why (everything else is dropped from its bounding, permitted and effective sets):

* CAP_SYS_ADMIN   setns() into the container's namespaces for `exec` and for TSoR's doorbells (with
                  CAP_SYS_CHROOT, which joining a mount namespace also needs); loading
                  an exec'd process's seccomp filter without no_new_privs (as runc does)
* CAP_SYS_PTRACE  reading and writing a trapped task's memory (process_vm_*), pidfd_getfd, /proc/PID/ns
                  and /proc/PID/mem of tasks in other user namespaces; the ptrace platform
* CAP_KILL        signalling container processes that run as other users
* CAP_SETUID, CAP_SETGID, CAP_SETPCAP, CAP_SYS_RESOURCE
                  an exec'd process switches user, shrinks its bounding set, raises rlimits and sets
                  its oom score in a child forked from the supervisor
* CAP_SYS_NICE    hibernation pages the container's memory out and reads its working set back in
                  (process_madvise on another process needs it)
* the capabilities the container's process is configured with (any of its five sets), because
  exec'd processes are forked from the supervisor and cannot get more than it has. An exec whose
  process.json asks for a capability outside that union fails with a clear error.

Its seccomp filter (default allow; the denied calls answer EPERM) removes what the supervisor never
does after set-up: mounting and the new mount API, chroot (kept for a container without a mount
namespace of its own, whose exec'd processes enter its chroot), unshare and clone() into new namespaces,
kernel modules, kexec, reboot, swap, bpf, perf_event_open, userfaultfd, io_uring, the keyring,
setting the clock, acct, quotactl, open_by_handle_at, syslog, iopl/ioperm, mknod, sethostname,
and ptrace itself unless the ptrace platform needs it. clone3 answers ENOSYS (its flags are behind
a pointer the filter cannot read; libc falls back to clone). The filter is installed without
no_new_privs, so exec'd processes can still gain privileges through setuid binaries as under runc;
it is inherited by those processes, where quark's base policy denies the same calls anyway.
Because exec'd processes inherit it, a call that QKernel's table grants the container (a capability
it holds in a namespace of its own: sethostname in its own UTS namespace, bind mounts in its own
mount namespace, qkernel/table.py's Grant) is let through this filter too, with the same argument
restrictions. The supervisor itself makes one of them: a new tmpfs a container granted mounts asks
for (the grant traps new filesystems, and a child of the supervisor mounts the tmpfs in the
container's mount namespace: qkernel/syscalls/sys_mount.py), so for such a container a
new-filesystem mount(2) passes this filter; QKernel's filter still traps it in the container's
processes.
"""
from __future__ import annotations

import ctypes
import errno
import logging
import os

from qlib import linux as L
from qlib import procfs
from qvisor.spec import CAPABILITIES, Capabilities

log = logging.getLogger("quark.confine")

SUPERVISOR_CAPS = ("CAP_SYS_ADMIN", "CAP_SYS_CHROOT", "CAP_SYS_PTRACE", "CAP_KILL", "CAP_SETUID", "CAP_SETGID",
                   "CAP_SETPCAP", "CAP_SYS_RESOURCE", "CAP_SYS_NICE")

DENIED = (
    "mount", "umount2", "pivot_root", "move_mount", "open_tree", "fsopen", "fsconfig", "fsmount",
    "fspick", "mount_setattr", "chroot", "unshare",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot",
    "swapon", "swapoff", "bpf", "perf_event_open", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "keyctl", "add_key", "request_key",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "acct", "quotactl", "quotactl_fd",
    "lookup_dcookie", "open_by_handle_at", "syslog", "iopl", "ioperm", "mknod", "mknodat",
    "sethostname", "setdomainname", "vhangup",
)
# clone() flags that make new namespaces (CLONE_NEWTIME shares its bit with the exit signal in
# clone(2), so it is only reachable through clone3/unshare, both denied).
_CLONE_NEW = {"CLONE_NEWNS": 0x00020000, "CLONE_NEWCGROUP": 0x02000000, "CLONE_NEWUTS": 0x04000000,
              "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUSER": 0x10000000, "CLONE_NEWPID": 0x20000000,
              "CLONE_NEWNET": 0x40000000}


def kept_capabilities(process_caps: Capabilities | None) -> set[str]:
    """The capabilities the supervisor keeps: its own needs plus the container process's."""
    keep = set(SUPERVISOR_CAPS)
    if process_caps is not None:
        for names in (process_caps.bounding, process_caps.effective, process_caps.permitted,
                      process_caps.inheritable, process_caps.ambient):
            keep.update(names)
    return keep


def drop_capabilities(keep: set[str]) -> int:
    """Drop every capability not in `keep` from the bounding, permitted, effective and inheritable
    sets (and clear the ambient set); returns the mask kept."""
    last = L.last_cap()
    mask = 0
    for name in keep:
        bit = CAPABILITIES.get(name)
        if bit is not None and bit <= last:
            mask |= 1 << bit
    mask &= procfs.permitted_caps()   # a capability the host already withheld cannot be kept
    for bit in range(last + 1):
        if not mask & (1 << bit):
            L.prctl(L.PR_CAPBSET_DROP, bit)
    L.prctl(L.PR_CAP_AMBIENT, L.PR_CAP_AMBIENT_CLEAR_ALL)
    L.capset(mask, mask, 0)
    return mask


def install_filter(platform: str, allow_chroot: bool = False, caps: frozenset[str] = frozenset(),
                   own_namespaces: frozenset[str] = frozenset()) -> None:
    """`allow_chroot`: the container has no mount namespace of its own and lives in a chroot, which
    an exec'd process (forked from the supervisor) must enter the same way. `caps` (the container
    process's configured capabilities) and `own_namespaces` decide which of QKernel's grants its
    exec'd processes need through this filter.

    The filter is compiled once per distinct outcome (filter_key) and kept as BPF, which the
    sandbox factory compiles for the usual case before it forks supervisors: compiling it with
    libseccomp in each supervisor wrote pages shared with the factory (the syscall table's objects,
    libseccomp's bindings) into the supervisor's private memory, for every sandbox (how much:
    bench/README.md, "Start-up and supervisor memory")."""
    key = filter_key(platform, allow_chroot, caps, own_namespaces)
    bpf = _COMPILED.get(key)
    if bpf is None:
        bpf = _COMPILED[key] = _compile(*key)
    _load_bpf(bpf)


# BPF of the supervisor's filter by filter_key; filled in the factory (warm) and on first use
_COMPILED: dict[tuple, bytes] = {}
_GRANTS: tuple[tuple[str, str, str], ...] | None = None   # (syscall, capability, namespace) of DENIED's grants


def filter_key(platform: str, allow_chroot: bool, caps: frozenset[str], own_namespaces: frozenset[str]) -> tuple:
    """What the filter depends on: whether ptrace is let through, chroot, and which grants apply."""
    global _GRANTS
    if _GRANTS is None:
        from qkernel import table
        rows = table.by_name()
        _GRANTS = tuple((n, rows[n].grant.cap, rows[n].grant.namespace) for n in (*DENIED, "ptrace")
                        if n in rows and rows[n].grant is not None)
    granted = tuple(n for n, cap, ns in _GRANTS if cap in caps and ns in own_namespaces)
    return platform == "ptrace", allow_chroot, granted


def _compile(ptrace: bool, allow_chroot: bool, granted: tuple[str, ...]) -> bytes:
    import seccomp   # python3-seccomp (libseccomp); imported here so the CLI never pays for it
    from qkernel import policy, table
    f = seccomp.SyscallFilter(seccomp.ALLOW)
    f.set_attr(seccomp.Attr.CTL_NNP, 0)
    eperm = seccomp.ERRNO(errno.EPERM)
    denied = [n for n in DENIED if not (allow_chroot and n == "chroot")]
    rows = table.by_name()
    for name in denied + ([] if ptrace else ["ptrace"]):
        sc = rows.get(name)
        try:
            if sc is not None and name in granted:
                policy.add_denial(f, sc, name, granted=True)   # only the still-denied patterns
            else:
                f.add_rule(eperm, name)
        except (RuntimeError, ValueError):
            log.debug("syscall %s unknown to libseccomp here; not filtered", name)
    for flag in _CLONE_NEW.values():
        f.add_rule(eperm, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    f.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    fd = os.memfd_create("quark-supervisor-filter", os.MFD_CLOEXEC)
    try:
        with open(fd, "w+b", closefd=False) as out:
            f.export_bpf(out)
        return os.pread(fd, 1 << 20, 0)
    finally:
        os.close(fd)


class _SockFprog(ctypes.Structure):   # struct sock_fprog
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, _BPF_INSN = 22, 2, 8


def _load_bpf(bpf: bytes) -> None:
    """Install a classic BPF seccomp program on this thread (as libseccomp's load does without
    no_new_privs: allowed by the CAP_SYS_ADMIN the supervisor keeps)."""
    buf = ctypes.create_string_buffer(bpf, len(bpf))
    prog = _SockFprog(len(bpf) // _BPF_INSN, ctypes.addressof(buf))
    L.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.addressof(prog))


def warm() -> None:
    """In the sandbox factory: compile the filter of the usual sandbox (the seccomp platform, a
    mount namespace of its own, no grant) so supervisors forked from it only load it."""
    install_key = filter_key("seccomp", False, frozenset(), frozenset())
    if install_key not in _COMPILED:
        _COMPILED[install_key] = _compile(*install_key)


def confine_supervisor(platform: str, process_caps: Capabilities | None, allow_chroot: bool = False,
                       own_namespaces: frozenset[str] = frozenset()) -> None:
    """Drop capabilities, then install the filter (loading it needs CAP_SYS_ADMIN, which is kept)."""
    kept = drop_capabilities(kept_capabilities(process_caps))
    container_caps = frozenset(process_caps.bounding) if process_caps is not None else frozenset()
    install_filter(platform, allow_chroot, container_caps, own_namespaces)
    log.debug("supervisor %d confined: capabilities %#x, seccomp filter loaded", os.getpid(), kept)
