"""The one syscall table: every syscall is native, trapped (with its handler) or denied (errno + reason).

The filter (policy.py), the dispatcher (kernel.py) and `quark syscalls` all read this table, so what
users see is what the container gets. Only the exceptions are written out below; every other syscall
the host knows is native. Numbers come from libseccomp's tables (the ones the BPF filter is compiled
from), plus the syscalls newer than libseccomp 2.5.4, listed here by hand.
"""
from __future__ import annotations

import dataclasses
import enum
import errno
import functools
import platform as _platform
from dataclasses import dataclass
from typing import Callable

import seccomp

from qlib import linux, sockopts

from qkernel.syscalls import sys_mount, sys_personality, sys_socket, sys_sysinfo

CLONE_NEWUSER = 0x10000000


class Fate(str, enum.Enum):
    NATIVE = "native"
    TRAPPED = "trapped"
    DENIED = "denied"


@dataclass(frozen=True)
class ArgMask:
    """The entry applies only when `args[index] & mask == value` (bits the BPF filter can see);
    `value` None: the mask itself (a flag is set)."""
    index: int
    mask: int
    describe: str
    value: int | None = None

    @property
    def match(self) -> int:
        return self.mask if self.value is None else self.value


@dataclass(frozen=True)
class ArgMatch:
    """A trapped entry applies only when one of these argument patterns matches (anything else runs
    natively): each pattern is conditions the BPF filter checks, all of which must hold: (index,
    value) for equality, (index, value, "lt" | "gt") for an unsigned comparison."""
    patterns: tuple[tuple[tuple[int, int], ...], ...]
    describe: str


@dataclass(frozen=True)
class Grant:
    """A DENIED entry that runs natively for a process holding `cap` (in its bounding set, as Docker's
    default profile reads `includes.caps`) in a container that has its own namespace of kind
    `namespace`, so the call acts only on the container's own namespace. `still_denied`: argument
    patterns (index, mask, value: `args[index] & mask == value`) that stay denied even then.
    `trapped`: patterns (the same form) that are neither native nor denied for such a process but
    trapped, for `handler` to decide and carry out: what the filter cannot judge from registers
    (mount(2)'s filesystem type is behind a pointer)."""
    cap: str
    namespace: str
    still_denied: tuple[tuple[int, int, int], ...] = ()
    describe: str = ""
    trapped: tuple[tuple[int, int, int], ...] = ()
    handler: Callable | None = None


@dataclass(frozen=True)
class Syscall:
    name: str
    x86_64: int | None
    aarch64: int | None
    fate: Fate
    reason: str = ""
    errno: int | None = None          # DENIED: what the container gets
    handler: Callable | None = None   # TRAPPED: handler(request) -> answer
    when: ArgMask | None = None       # DENIED only for these argument bits; native otherwise
    # TRAPPED: when the handler fails, run the call natively instead of answering ENOSYS. Only for
    # handlers that accelerate (TSoR's socket calls: the native call is exactly what the task would
    # get without quark); a handler that enforces policy (personality) must fail closed.
    native_on_error: bool = False
    # TRAPPED: only for these arguments (e.g. setsockopt at the levels TSoR emulates); None: always
    only: ArgMatch | None = None
    # TRAPPED: only in a sandbox served by TSoR (the socket family); elsewhere native
    tsor_only: bool = False
    # TRAPPED: only in a sandbox whose connections to quark pods tsord's sockmap path carries (the
    # kernel's TCP, nothing of the socket family trapped but this); elsewhere native
    sockmap_only: bool = False
    # TRAPPED: except on the socket the new process hands its listener to the supervisor on, with
    # this call, right after its filter is loaded (qkernel/policy.py's channel_fd)
    channel_exempt: bool = False
    # TRAPPED: what `only` becomes when the kernel answers TCP_NODELAY/TCP_CORK on local-path
    # sockets itself (tsor/sockopt_offload.py): the sandbox's filter no longer traps those
    offloaded_only: ArgMatch | None = None
    # DENIED: allowed when the container holds a capability in its own namespace (Grant)
    grant: Grant | None = None
    # DENIED only for a process holding this capability: without it the kernel itself refuses what
    # would reach the host (setting the clock), and the call's harmless uses (reading it) work
    denied_for: str | None = None

    def applies(self, caps: frozenset[str] | set[str], own_namespaces: frozenset[str] | set[str]) -> bool:
        """Is this DENIED entry in force for the process (bounding set `caps`)?"""
        if self.denied_for is not None and self.denied_for not in caps:
            return False
        return not self.granted(caps, own_namespaces) or bool(self.grant.still_denied)

    def granted(self, caps: frozenset[str] | set[str], own_namespaces: frozenset[str] | set[str]) -> bool:
        """Does this process (bounding set `caps`) in a container owning `own_namespaces` get the grant?"""
        g = self.grant
        return g is not None and g.cap in caps and g.namespace in own_namespaces

    def nr(self, arch: str) -> int | None:
        return self.x86_64 if arch == "x86_64" else self.aarch64


def _denied(err: int, reason: str, when: ArgMask | None = None, grant: Grant | None = None,
            denied_for: str | None = None) -> dict:
    return {"fate": Fate.DENIED, "errno": err, "reason": reason, "when": when, "grant": grant,
            "denied_for": denied_for}


def _trapped(handler: Callable, reason: str, native_on_error: bool = False, only: ArgMatch | None = None,
             tsor_only: bool = False, offloaded_only: ArgMatch | None = None, sockmap_only: bool = False,
             channel_exempt: bool = False) -> dict:
    return {"fate": Fate.TRAPPED, "handler": handler, "reason": reason, "native_on_error": native_on_error,
            "only": only, "tsor_only": tsor_only, "offloaded_only": offloaded_only, "sockmap_only": sockmap_only,
            "channel_exempt": channel_exempt}


_MODULES = "changes the code the host kernel runs"
_MOUNT = "the mount table is fixed once the runtime has set up the rootfs"
_KEYS = "the kernel keyring is not namespaced; it widens the host attack surface"
_TIME = "the clock is the host's, shared by every container"
_NEWUSER = ArgMask(0, CLONE_NEWUSER, "flags has CLONE_NEWUSER")
# madvise's advice and prctl's option are C ints: the kernel reads the low 32 bits, so the filter
# compares those alone (a value with high bits set must not slip past).
_KSM = ("asks the host's samepage merging (KSM) to merge the container's pages with other processes' (quark's "
        "supervisors' too, with supervisor.memory_merge): copy-on-write timing then tells whether another "
        "process holds the same bytes. EINVAL, as from a kernel without KSM")
# mount(2) flags (qlib.linux has the same values; qkernel does not import qvisor's helpers)
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_MOVE = 1, 32, 4096, 8192
MS_UNBINDABLE, MS_PRIVATE, MS_SLAVE, MS_SHARED = 1 << 17, 1 << 18, 1 << 19, 1 << 20
_PROPAGATION = MS_UNBINDABLE | MS_PRIVATE | MS_SLAVE | MS_SHARED
# With CAP_SYS_ADMIN in its own mount namespace a container may bind (recursively or not), change
# propagation and make a bind read-only: each acts on mounts the container can already see, and
# quark locks its own mounts (masks, read-only paths, the /proc view) before the container runs
# (qvisor/rootfs_lock.py), so the kernel refuses to unmount, move, strip or make writable any of them.
# Still denied, in the order mount(2) reads its flags: a superblock remount (MS_REMOUNT without
# MS_BIND: it changes the filesystem for every mount of it, the host's too), a bind remount that is not
# read-only, and MS_MOVE. A new filesystem
# (none of MS_BIND, MS_REMOUNT, MS_MOVE or a propagation flag) is trapped: its type is behind a
# pointer the filter cannot read, and a fresh proc, sysfs or cgroup v1 mount would show the host's
# writable knobs without quark's masks, so the supervisor reads the type and makes the mount itself
# (qkernel/syscalls/sys_mount.py: tmpfs only; anything else stays EPERM).
# The flags may carry mount(2)'s old magic number (0xC0ED in the top half of the low 32 bits), which
# the kernel drops before it reads them: its bits include MS_PRIVATE and MS_SLAVE, so to the patterns
# above such a call looks like a propagation change. The magic patterns judge it by what the kernel
# keeps (without them a magic new cgroup v1 mount ran natively: the host's hierarchy, writable).
_MGC_MSK, _MGC_VAL = 0xFFFF0000, 0xC0ED0000
_MOUNT_GRANT = Grant("CAP_SYS_ADMIN", "mount", (
    (3, MS_REMOUNT | MS_BIND, MS_REMOUNT),
    (3, MS_REMOUNT | MS_BIND | MS_RDONLY, MS_REMOUNT | MS_BIND),
    (3, MS_REMOUNT | MS_BIND | MS_MOVE | _PROPAGATION, MS_MOVE),
    (3, _MGC_MSK | MS_REMOUNT | MS_BIND | MS_MOVE, _MGC_VAL | MS_MOVE),
), "CAP_SYS_ADMIN and its own mount namespace, for bind mounts, propagation changes, read-only bind "
   "remounts and a new tmpfs (made by the supervisor, sys_mount.handle); other new filesystems, MS_MOVE and "
   "other remounts stay EPERM", trapped=(
    (3, MS_REMOUNT | MS_BIND | MS_MOVE | _PROPAGATION, 0),
    (3, _MGC_MSK | MS_REMOUNT | MS_BIND | MS_MOVE, _MGC_VAL),
), handler=sys_mount.handle)
_MOUNTS_OWN = Grant("CAP_SYS_ADMIN", "mount", (), "CAP_SYS_ADMIN and its own mount namespace, where quark's own "
                    "mounts are locked")
_UTS_OWN = Grant("CAP_SYS_ADMIN", "uts", (), "CAP_SYS_ADMIN and its own UTS namespace")
_HOSTNAME = "sets the host's name unless the container has its own UTS namespace"
# The socket options TSoR answers for a redirected socket (qlib/sockopts.py says which). Every other
# option (SO_SNDBUF, SO_RCVTIMEO, SO_ERROR, ...) runs natively on every socket, without a trap.
_SOL_SOCKET = 1
_SOCKOPTS = ArgMatch(
    tuple(((1, level),) for level in sockopts.EMULATED_LEVELS)
    + tuple(((1, _SOL_SOCKET), (2, opt)) for opt in sockopts.RECORDED_SOCKET_OPTS + sockopts.UNIX_REFUSED_SOCKET_OPTS),
    "level is IPPROTO_IP/TCP/IPV6, or SOL_SOCKET with SO_TYPE/PROTOCOL/DOMAIN/REUSEPORT/ZEROCOPY/TXTIME "
    "or a credential option (SO_PASSCRED, SO_PEERCRED, SO_PEERSEC, SO_PASSSEC, SO_PASSPIDFD, SO_PEERPIDFD, "
    "SO_PASSRIGHTS)")
# With the option offload (tsor/sockopt_offload.py), get/setsockopt(IPPROTO_TCP) is trapped for every
# option but TCP_NODELAY (1) and TCP_CORK (3), which cgroup BPF programs answer on local-path sockets
# (and the kernel itself on TCP ones): optname < 1, == 2, > 3; setsockopt of 1 and 3 also with an
# optlen under 4 (EINVAL, as TCP says it; getsockopt's optlen is behind a pointer).
_TCP = 6
_NOT_NODELAY_OR_CORK = (((1, _TCP), (2, 1, "lt")), ((1, _TCP), (2, 2)), ((1, _TCP), (2, 3, "gt")))
_OFFLOADED = "; with the option offload not TCP_NODELAY/TCP_CORK, which the kernel answers"
_GETSOCKOPTS_OFFLOADED = ArgMatch(tuple(p for p in _SOCKOPTS.patterns if p != ((1, _TCP),)) + _NOT_NODELAY_OR_CORK,
                                  _SOCKOPTS.describe + _OFFLOADED)
_SETSOCKOPTS_OFFLOADED = ArgMatch(
    _GETSOCKOPTS_OFFLOADED.patterns + (((1, _TCP), (2, 1), (4, 4, "lt")), ((1, _TCP), (2, 3), (4, 4, "lt"))),
    _SOCKOPTS.describe + _OFFLOADED)
_SHUT_WR_OR_RDWR = ArgMatch((((1, 1),), ((1, 2),)), "how is SHUT_WR or SHUT_RDWR")
_SOCKMAP_SHUTDOWN = ("with tsord's sockmap path: a connection the kernel carries socket to socket returns "
                     "from shutdown once its FIN is acknowledged; anything else runs natively")
_TSOR = ("handled by TSoR: TCP to quark pods is carried by tsord's local/tcp paths (seccomp platform, "
         "sandboxes served by TSoR only); anything else runs natively")

# The base policy. Privileged operations get EPERM (what an unprivileged process gets from Linux);
# interfaces programs probe for and fall back from get ENOSYS (as if the kernel lacked them).
POLICY: dict[str, dict] = {
    # kernel code and kernel-wide state
    "init_module": _denied(errno.EPERM, _MODULES),
    "finit_module": _denied(errno.EPERM, _MODULES),
    "delete_module": _denied(errno.EPERM, _MODULES),
    "kexec_load": _denied(errno.EPERM, "replaces the host kernel"),
    "kexec_file_load": _denied(errno.EPERM, "replaces the host kernel"),
    # in a pid namespace of its own, reboot(2) only ends that namespace's init (the kernel's rule)
    "reboot": _denied(errno.EPERM, "reboots the host", grant=Grant("CAP_SYS_BOOT", "pid", (),
                                                                   "CAP_SYS_BOOT and its own pid namespace")),
    "swapon": _denied(errno.EPERM, "host memory management"),
    "swapoff": _denied(errno.EPERM, "host memory management"),
    "settimeofday": _denied(errno.EPERM, _TIME),
    "clock_settime": _denied(errno.EPERM, _TIME),
    "adjtimex": _denied(errno.EPERM, _TIME, denied_for="CAP_SYS_TIME"),
    "clock_adjtime": _denied(errno.EPERM, _TIME, denied_for="CAP_SYS_TIME"),
    "acct": _denied(errno.EPERM, "host-wide process accounting"),
    # what CAP_SYS_RAWIO, CAP_SYS_TIME or CAP_SYSLOG would otherwise open to a (privileged) container
    "iopl": _denied(errno.EPERM, "raw I/O ports of the host's hardware"),
    "ioperm": _denied(errno.EPERM, "raw I/O ports of the host's hardware"),
    "syslog": _denied(errno.EPERM, "the host kernel's log (read and clear)"),
    "quotactl": _denied(errno.EPERM, "host filesystem quotas"),
    "quotactl_fd": _denied(errno.EPERM, "host filesystem quotas"),
    "lookup_dcookie": _denied(errno.EPERM, "exposes host dentries (profiling interface)"),
    # large kernel attack surface no ordinary container needs
    "bpf": _denied(errno.EPERM, "eBPF programs run in the host kernel"),
    "perf_event_open": _denied(errno.EPERM, "observes the host; a frequent source of kernel bugs"),
    "userfaultfd": _denied(errno.EPERM, "lets a task stall the kernel mid-copy (exploit primitive)"),
    "io_uring_setup": _denied(errno.ENOSYS, "io_uring bypasses syscall filtering; users fall back to epoll"),
    "io_uring_enter": _denied(errno.ENOSYS, "io_uring bypasses syscall filtering"),
    "io_uring_register": _denied(errno.ENOSYS, "io_uring bypasses syscall filtering"),
    "keyctl": _denied(errno.EPERM, _KEYS),
    "add_key": _denied(errno.EPERM, _KEYS),
    "request_key": _denied(errno.EPERM, _KEYS),
    "open_by_handle_at": _denied(errno.EPERM, "opens files by handle, escaping the rootfs"),
    # other tasks' memory and execution
    "ptrace": _denied(errno.EPERM, "debugging other tasks; the ptrace platform is the tracer"),
    "process_vm_readv": _denied(errno.EPERM, "reads other tasks' memory"),
    "process_vm_writev": _denied(errno.EPERM, "writes other tasks' memory"),
    "madvise": _denied(errno.EINVAL, _KSM, ArgMask(2, 0xFFFFFFFF, "advice is MADV_MERGEABLE", linux.MADV_MERGEABLE)),
    "prctl": _denied(errno.EINVAL, _KSM,
                     ArgMask(0, 0xFFFFFFFF, "option is PR_SET_MEMORY_MERGE", linux.PR_SET_MEMORY_MERGE)),
    # mounts, namespaces
    "mount": _denied(errno.EPERM, _MOUNT, grant=_MOUNT_GRANT),
    "umount2": _denied(errno.EPERM, _MOUNT, grant=_MOUNTS_OWN),
    "pivot_root": _denied(errno.EPERM, _MOUNT, grant=_MOUNTS_OWN),
    "move_mount": _denied(errno.EPERM, _MOUNT, grant=_MOUNTS_OWN),
    "open_tree": _denied(errno.EPERM, _MOUNT, grant=_MOUNTS_OWN),
    "open_tree_attr": _denied(errno.EPERM, _MOUNT, grant=_MOUNTS_OWN),
    "mount_setattr": _denied(errno.EPERM, _MOUNT, grant=_MOUNTS_OWN),
    "fsopen": _denied(errno.EPERM, _MOUNT),
    "fsconfig": _denied(errno.EPERM, _MOUNT),
    "fsmount": _denied(errno.EPERM, _MOUNT),
    "fspick": _denied(errno.EPERM, _MOUNT),
    # the new mount API's filesystem contexts make new filesystems (fsopen, fsmount) or reconfigure a
    # superblock (fspick, fsconfig): never granted, as new filesystems through mount(2) are not
    "sethostname": _denied(errno.EPERM, _HOSTNAME, grant=_UTS_OWN),
    "setdomainname": _denied(errno.EPERM, _HOSTNAME, grant=_UTS_OWN),
    "setns": _denied(errno.EPERM, "joining namespaces is the runtime's job"),
    "unshare": _denied(errno.EPERM, "new user namespaces open kernel paths meant for root", _NEWUSER),
    "clone": _denied(errno.EPERM, "new user namespaces open kernel paths meant for root", _NEWUSER),
    # clone3's flags live in memory the filter cannot read; ENOSYS makes libc fall back to clone(2),
    # whose flags it can (the same choice as Docker's default profile).
    "clone3": _denied(errno.ENOSYS, "flags are not visible to the filter; libc falls back to clone"),
    # trapped: answered by QKernel
    "personality": _trapped(sys_personality.handle,
                            "only the default personas (PER_LINUX, PER_LINUX32, UNAME26, query)"),
    "sysinfo": _trapped(sys_sysinfo.handle, "memory totals from the container's cgroup"),
    **{name: _trapped(sys_socket.handle, _TSOR, native_on_error=True, tsor_only=True,
                      only=_SOCKOPTS if name in ("getsockopt", "setsockopt") else None,
                      offloaded_only={"setsockopt": _SETSOCKOPTS_OFFLOADED,
                                      "getsockopt": _GETSOCKOPTS_OFFLOADED}.get(name),
                      channel_exempt=name == "sendmsg")
       for name in sys_socket.TRAPPED},
    # the kernel's sockmap receive path answers a blocking read EAGAIN when the reader's own FIN is
    # acknowledged while it waits (tcp_bpf_recvmsg takes the state change's wake-up for a timeout):
    # shutdown returns once that acknowledgement is in (tsor/sockmap.py, "Half-close")
    "shutdown": _trapped(sys_socket.handle, _SOCKMAP_SHUTDOWN, native_on_error=True, sockmap_only=True,
                         only=_SHUT_WR_OR_RDWR),
}

# Syscalls newer than libseccomp 2.5.4's tables. Since 424 the numbers are the same on every arch.
_NEWER = {"statmount": 457, "listmount": 458, "lsm_get_self_attr": 459, "lsm_set_self_attr": 460,
          "lsm_list_modules": 461, "mseal": 462, "setxattrat": 463, "getxattrat": 464,
          "listxattrat": 465, "removexattrat": 466, "open_tree_attr": 467, "file_getattr": 468,
          "file_setattr": 469}
_MAX_NR = 1024


def _machine_arch() -> str:
    machine = _platform.machine()
    return {"x86_64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}.get(machine, machine)


# read at import, before a container's init sets its personality: under LINUX32 uname says i686,
# but the filter is for the kernel's (and the process's) real architecture
_NATIVE_ARCH = _machine_arch()


def native_arch() -> str:
    return _NATIVE_ARCH


def resolve(arch: seccomp.Arch, name: str) -> int | None:
    try:
        nr = seccomp.resolve_syscall(arch, name)
    except ValueError:
        return None
    return nr if nr >= 0 else None   # libseccomp answers negative pseudo-numbers for absent calls


@functools.cache
def table() -> tuple[Syscall, ...]:
    """Every syscall, sorted by x86_64 number (aarch64-only ones last)."""
    names: dict[str, None] = {}
    for nr in range(_MAX_NR):
        for arch in (seccomp.Arch.X86_64, seccomp.Arch.AARCH64):
            try:
                names[seccomp.resolve_syscall(arch, nr).decode()] = None
            except ValueError:
                pass
    names.update(dict.fromkeys(_NEWER))
    rows = []
    for name in names:
        x86 = _NEWER.get(name, resolve(seccomp.Arch.X86_64, name))
        arm = _NEWER.get(name, resolve(seccomp.Arch.AARCH64, name))
        rows.append(Syscall(name, x86, arm, **POLICY.get(name, {"fate": Fate.NATIVE})))
    return tuple(sorted(rows, key=lambda s: (s.x86_64 is None, s.x86_64 or 0, s.aarch64 or 0)))


@functools.cache
def by_name() -> dict[str, Syscall]:
    return {s.name: s for s in table()}


def entries(fate: Fate) -> list[Syscall]:
    return [s for s in table() if s.fate is fate]


def handlers(arch: str) -> dict[int, Syscall]:
    """Trapped syscalls by number on `arch`: what the dispatcher looks up. A DENIED entry whose grant
    traps some of its calls (Grant.trapped) is there too, with the grant's handler."""
    out = {s.nr(arch): s for s in entries(Fate.TRAPPED) if s.nr(arch) is not None}
    for s in entries(Fate.DENIED):
        if s.grant is not None and s.grant.trapped and s.nr(arch) is not None:
            out[s.nr(arch)] = dataclasses.replace(s, handler=s.grant.handler)
    return out
