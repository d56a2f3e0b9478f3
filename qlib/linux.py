"""The one thin ctypes layer over the Linux calls Python's os module lacks: namespaces, mounts (and
the one MS_* table), the new mount API, openat2, pidfds (and PIDFD_GET_INFO), close_range, prctl,
capabilities, sysinfo.

Every package (qvisor, qkernel, tsor, shim) makes these calls through here, with qlib/libc.py's libc
handle and errno check and syscall numbers from qlib.syscalls (resolved at import: some calls run after a pivot into a
container's root, where libseccomp's module could no longer be loaded). Each function raises
OSError with errno on failure.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import os
import socket
import struct

from qlib import procfs, syscalls
from qlib.libc import check, errno_error
from qlib.libc import libc as _libc

# namespaces (linux/sched.h)
CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
CLONE_NEWTIME = 0x00000080

# mount flags (linux/mount.h)
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_SYNCHRONOUS = 16
MS_REMOUNT = 32
MS_MANDLOCK = 64
MS_DIRSYNC = 128
MS_NOSYMFOLLOW = 256
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_MOVE = 8192
MS_REC = 16384
MS_SILENT = 32768
MS_UNBINDABLE = 1 << 17
MS_PRIVATE = 1 << 18
MS_SLAVE = 1 << 19
MS_SHARED = 1 << 20
MS_RELATIME = 1 << 21
MS_STRICTATIME = 1 << 24
MS_LAZYTIME = 1 << 25
MNT_DETACH = 2

# fstab/OCI mount option -> (clear, flag): "ro" sets MS_RDONLY, "rw" clears it, and so on. The one
# table both the runtime (qvisor/mountopts.py) and the shim (the snapshotter's rootfs) parse with.
MOUNT_FLAGS: dict[str, tuple[bool, int]] = {
    "ro": (False, MS_RDONLY), "rw": (True, MS_RDONLY),
    "nosuid": (False, MS_NOSUID), "suid": (True, MS_NOSUID),
    "nodev": (False, MS_NODEV), "dev": (True, MS_NODEV),
    "noexec": (False, MS_NOEXEC), "exec": (True, MS_NOEXEC),
    "sync": (False, MS_SYNCHRONOUS), "async": (True, MS_SYNCHRONOUS),
    "dirsync": (False, MS_DIRSYNC),
    "remount": (False, MS_REMOUNT),
    "mand": (False, MS_MANDLOCK), "nomand": (True, MS_MANDLOCK),
    "noatime": (False, MS_NOATIME), "atime": (True, MS_NOATIME),
    "nodiratime": (False, MS_NODIRATIME), "diratime": (True, MS_NODIRATIME),
    "relatime": (False, MS_RELATIME), "norelatime": (True, MS_RELATIME),
    "strictatime": (False, MS_STRICTATIME), "nostrictatime": (True, MS_STRICTATIME),
    "lazytime": (False, MS_LAZYTIME), "nolazytime": (True, MS_LAZYTIME),
    "nosymfollow": (False, MS_NOSYMFOLLOW), "symfollow": (True, MS_NOSYMFOLLOW),
    "bind": (False, MS_BIND), "rbind": (False, MS_BIND | MS_REC),
}
MOUNT_PROPAGATION: dict[str, int] = {
    "private": MS_PRIVATE, "rprivate": MS_PRIVATE | MS_REC,
    "shared": MS_SHARED, "rshared": MS_SHARED | MS_REC,
    "slave": MS_SLAVE, "rslave": MS_SLAVE | MS_REC,
    "unbindable": MS_UNBINDABLE, "runbindable": MS_UNBINDABLE | MS_REC,
}

# prctl
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_KEEPCAPS = 8
PR_CAPBSET_READ = 23
PR_CAPBSET_DROP = 24
PR_SET_NAME = 15
PR_SET_MM = 35
PR_SET_MM_MAP = 14
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_RAISE = 2
PR_CAP_AMBIENT_CLEAR_ALL = 4
PR_SET_MEMORY_MERGE = 67   # KSM for the whole process (6.4+)
PR_GET_MEMORY_MERGE = 68

# resolved once, at import: the calls that need them may run after a pivot into a container's root
_SYS_PIVOT_ROOT = syscalls.number("pivot_root")
_SYS_SETNS = syscalls.number("setns")
_SYS_PIDFD_SEND_SIGNAL = syscalls.number("pidfd_send_signal")
_SYS_PIDFD_OPEN = syscalls.number("pidfd_open")
_SYS_PIDFD_GETFD = syscalls.number("pidfd_getfd")
_SYS_CLOSE_RANGE = syscalls.number("close_range")
_SYS_OPEN_TREE = syscalls.number("open_tree")
_SYS_MOVE_MOUNT = syscalls.number("move_mount")
_SYS_OPENAT2 = syscalls.number("openat2")
_SYS_BRK = syscalls.number("brk")
_SYS_PROCESS_MADVISE = syscalls.number("process_madvise")
CLOSE_RANGE_CLOEXEC = 4
PIDFD_THREAD = os.O_EXCL   # pidfd of a thread, not only of a thread-group leader (Linux 6.9)

_LINUX_CAPABILITY_VERSION_3 = 0x20080522


def _check(ret: int, what: str, path: str | None = None) -> int:
    return check(ret, what, path)


def _b(s: str | None) -> bytes | None:
    return None if s is None else os.fsencode(s)


# --- namespaces, mounts ---

def unshare(flags: int) -> None:
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def setns(fd: int, nstype: int = 0) -> None:
    _check(_libc.syscall(_SYS_SETNS, ctypes.c_int(fd), ctypes.c_int(nstype)), "setns")


def mount(source: str | None, target: str, fstype: str | None, flags: int = 0, data: str | None = None) -> None:
    _check(_libc.mount(_b(source), _b(target), _b(fstype), ctypes.c_ulong(flags), _b(data)), "mount", target)


def umount2(target: str, flags: int = 0) -> None:
    _check(_libc.umount2(_b(target), ctypes.c_int(flags)), "umount2", target)


def set_fs_ids(uid: int, gid: int) -> None:
    """setfsgid, then setfsuid: the ids permission checks use and new inodes (a new tmpfs's root
    too) are owned by. Neither reports failure; a caller without CAP_SETUID/SETGID keeps its own."""
    _libc.setfsgid(ctypes.c_uint(gid))
    _libc.setfsuid(ctypes.c_uint(uid))


def pivot_root(new_root: str, put_old: str) -> None:
    _check(_libc.syscall(_SYS_PIVOT_ROOT, _b(new_root), _b(put_old)), "pivot_root", new_root)


def personality(persona: int) -> None:
    """personality(2): the execution domain (PER_LINUX 0, PER_LINUX32 8) of this process and what it execs."""
    _check(_libc.personality(ctypes.c_ulong(persona)), "personality")


def sethostname(name: str) -> None:
    b = name.encode()
    _check(_libc.sethostname(b, ctypes.c_size_t(len(b))), "sethostname")


def setdomainname(name: str) -> None:
    b = name.encode()
    _check(_libc.setdomainname(b, ctypes.c_size_t(len(b))), "setdomainname")


OPEN_TREE_CLONE = 1
AT_RECURSIVE = 0x8000
_AT_FDCWD = -100
_MOVE_MOUNT_F_EMPTY_PATH = 0x4
_MOVE_MOUNT_T_EMPTY_PATH = 0x40


def open_tree_clone(path: str, recursive: bool) -> int:
    """A detached copy of the mount tree at `path` (a bind mount not attached anywhere yet), as
    an fd: opened with this process's credentials, it can be attached in another mount namespace."""
    flags = OPEN_TREE_CLONE | os.O_CLOEXEC | (AT_RECURSIVE if recursive else 0)
    return _check(_libc.syscall(_SYS_OPEN_TREE, ctypes.c_int(_AT_FDCWD), _b(path), ctypes.c_uint(flags)),
                  "open_tree", path)


def move_mount_fd(tree_fd: int, target_fd: int) -> None:
    """Attach the detached tree `tree_fd` onto the directory or file `target_fd` (an O_PATH fd)."""
    _check(_libc.syscall(_SYS_MOVE_MOUNT, ctypes.c_int(tree_fd), b"", ctypes.c_int(target_fd), b"",
                         ctypes.c_uint(_MOVE_MOUNT_F_EMPTY_PATH | _MOVE_MOUNT_T_EMPTY_PATH)), "move_mount")


# --- openat2 (linux/openat2.h) ---

RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE_IN_ROOT = 0x10


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def openat2(dir_fd: int, path: str, flags: int, mode: int, resolve: int) -> int:
    """openat2(2) of `path` relative to `dir_fd`, close-on-exec; the OSError names `path`."""
    how = _OpenHow(flags | os.O_CLOEXEC, mode, resolve)
    fd = _libc.syscall(_SYS_OPENAT2, ctypes.c_int(dir_fd), os.fsencode(path), ctypes.byref(how),
                       ctypes.c_size_t(ctypes.sizeof(how)))
    return check(fd, None, path)


# --- pidfds ---

def pidfd_open(pid: int, flags: int = 0) -> int:
    return _check(_libc.syscall(_SYS_PIDFD_OPEN, ctypes.c_int(pid), ctypes.c_uint(flags)), "pidfd_open")


def pidfd_open_thread(tid: int) -> int:
    """A pidfd for `tid`, which may be any thread of a process (PIDFD_THREAD). Kernels before 6.9
    refuse the flag and a pidfd of any task but a thread-group leader (EINVAL): there it is the
    pidfd of tid's process, whose fd table its threads share (pthreads are made with CLONE_FILES);
    the caller checks afterwards that tid is still the task it meant, as with any pidfd."""
    try:
        return pidfd_open(tid, PIDFD_THREAD)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
    try:
        return pidfd_open(tid)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
    return pidfd_open(int(procfs.status(tid)["Tgid"]))   # FileNotFoundError once tid is gone


def pidfd_send_signal(pidfd: int, sig: int) -> None:
    _check(_libc.syscall(_SYS_PIDFD_SEND_SIGNAL, ctypes.c_int(pidfd), ctypes.c_int(sig), None,
                         ctypes.c_uint(0)), "pidfd_send_signal")


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc.process_vm_readv.restype = ctypes.c_ssize_t


def process_vm_readv(pid: int, addr: int, size: int) -> bytes:
    """`size` bytes at `addr` in another process, in one call (no /proc/PID/mem to open and close).
    Returns what could be read (short at an unmapped page); OSError (ESRCH, EPERM, EFAULT) otherwise."""
    buf = ctypes.create_string_buffer(size)
    local, remote = _Iovec(ctypes.addressof(buf), size), _Iovec(addr, size)
    n = _check(_libc.process_vm_readv(ctypes.c_int(pid), ctypes.byref(local), ctypes.c_ulong(1),
                                      ctypes.byref(remote), ctypes.c_ulong(1), ctypes.c_ulong(0)),
               "process_vm_readv")
    return buf.raw[:n]


# process_madvise advice (asm-generic/mman-common.h): the ones the kernel takes for another process
MADV_WILLNEED = 3
MADV_MERGEABLE = 12
MADV_COLD = 20
MADV_PAGEOUT = 21
IOV_MAX = 1024


def process_madvise(pidfd: int, ranges: list[tuple[int, int]], advice: int) -> int:
    """madvise(`advice`) on the (address, length) ranges of the process behind `pidfd` (at most
    IOV_MAX of them); returns the bytes advised, which stop short at the first range the kernel
    refuses. Another process needs CAP_SYS_NICE and ptrace read access to it."""
    iov = (_Iovec * len(ranges))(*(_Iovec(a, n) for a, n in ranges))
    return _check(_libc.syscall(_SYS_PROCESS_MADVISE, ctypes.c_int(pidfd), iov, ctypes.c_size_t(len(ranges)),
                                ctypes.c_int(advice), ctypes.c_uint(0)), "process_madvise")


def swapon(path: str, flags: int = 0) -> None:
    _check(_libc.swapon(os.fsencode(path), ctypes.c_int(flags)), "swapon", path)


def swapoff(path: str) -> None:
    _check(_libc.swapoff(os.fsencode(path)), "swapoff", path)


def pidfd_getfd(pidfd: int, fd: int) -> int:
    """Our own duplicate of the task's `fd` (same open file description), close-on-exec."""
    return _check(_libc.syscall(_SYS_PIDFD_GETFD, ctypes.c_int(pidfd), ctypes.c_int(fd),
                                ctypes.c_uint(0)), "pidfd_getfd")


# PIDFD_GET_INFO (Linux 6.15+): the exit status of a process that is not our child. When the caller
# of `quark create` adopts orphans (containerd's runc shim and conmon are child subreapers and reap
# the container's init themselves), the supervisor cannot waitpid() the init; the kernel keeps the
# wait status in pidfs once the process has been reaped and hands it to anyone holding a pidfd.
_PIDFD_INFO_SIZE = 64               # struct pidfd_info, PIDFD_INFO_SIZE_VER0
_PIDFS_IOCTL_MAGIC = 0xFF
PIDFD_GET_INFO = (3 << 30) | (_PIDFD_INFO_SIZE << 16) | (_PIDFS_IOCTL_MAGIC << 8) | 11   # _IOWR(0xFF, 11, ...)
PIDFD_INFO_EXIT = 1 << 3
_EXIT_CODE_OFFSET = 60              # mask, cgroupid (u64 each), then 11 u32 ids, then exit_code


def pidfd_exit_status(pidfd: int) -> int | None:
    """The wait status (as os.waitpid gives it) of the process, or None while it is not yet
    reaped. Raises OSError(ENOTTY/EINVAL) on kernels without PIDFD_GET_INFO."""
    buf = bytearray(_PIDFD_INFO_SIZE)
    struct.pack_into("Q", buf, 0, PIDFD_INFO_EXIT)
    try:
        fcntl.ioctl(pidfd, PIDFD_GET_INFO, buf)
    except OSError as e:
        if e.errno == errno.ESRCH:   # exited, not reaped yet by its parent
            return None
        raise
    if not struct.unpack_from("Q", buf, 0)[0] & PIDFD_INFO_EXIT:
        return None
    return struct.unpack_from("i", buf, _EXIT_CODE_OFFSET)[0]


def exit_code(status: int) -> int:
    """A wait status as runtimes report it: the exit code, or 128 + the signal that ended it."""
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def pidfd_exit_status_supported() -> bool:
    """Whether this kernel reports exit statuses through pidfds (PIDFD_GET_INFO)."""
    fd = pidfd_open(os.getpid())
    try:
        pidfd_exit_status(fd)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


# --- fds ---

def mark_fds_cloexec(first: int) -> None:
    """Set FD_CLOEXEC on every fd >= first, so nothing of the runtime leaks through execve."""
    _check(_libc.syscall(_SYS_CLOSE_RANGE, ctypes.c_uint(first), ctypes.c_uint(0xFFFFFFFF),
                         ctypes.c_uint(CLOSE_RANGE_CLOEXEC)), "close_range")


def close_fds_except(keep: set[int] | frozenset[int], first: int = 3) -> None:
    """Close every fd >= first except those in `keep`: close_range(2) over the gaps, or, where a
    seccomp profile refuses close_range, one close(2) per entry of /proc/self/fd."""
    try:
        lo = first
        for fd in sorted(k for k in keep if k >= first):
            if fd > lo:
                _check(_libc.syscall(_SYS_CLOSE_RANGE, ctypes.c_uint(lo), ctypes.c_uint(fd - 1), ctypes.c_uint(0)),
                       "close_range")
            lo = fd + 1
        _check(_libc.syscall(_SYS_CLOSE_RANGE, ctypes.c_uint(lo), ctypes.c_uint(0xFFFFFFFF), ctypes.c_uint(0)),
               "close_range")
    except OSError:
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            if fd >= first and fd not in keep:
                try:
                    os.close(fd)
                except OSError:
                    pass   # the directory's own fd, already gone


def reap_exited() -> None:
    """Collect every child that has exited (a zombie each otherwise), without waiting."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


# --- inotify ---

IN_MODIFY, IN_ATTRIB, IN_CLOSE_WRITE = 0x2, 0x4, 0x8
IN_MOVED_FROM, IN_MOVED_TO, IN_CREATE, IN_DELETE, IN_DELETE_SELF, IN_MOVE_SELF = 0x40, 0x80, 0x100, 0x200, 0x400, 0x800
IN_CHANGES = (IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
              | IN_DELETE_SELF | IN_MOVE_SELF)
_IN_NONBLOCK, _IN_CLOEXEC = os.O_NONBLOCK, os.O_CLOEXEC
_INOTIFY_EVENT = struct.Struct("iIII")


def inotify_init() -> int:
    """A non-blocking, close-on-exec inotify fd."""
    return _check(_libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC), "inotify_init1")


def inotify_add_watch(fd: int, path: str, mask: int) -> int:
    return _check(_libc.inotify_add_watch(fd, os.fsencode(path), ctypes.c_uint32(mask)), "inotify_add_watch", path)


def inotify_names(fd: int) -> list[str]:
    """The names in the events queued on a non-blocking inotify fd ("" for the watched directory
    itself); [] when none is queued."""
    names = []
    while True:
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return names
        off = 0
        while off + _INOTIFY_EVENT.size <= len(data):
            _wd, _mask, _cookie, size = _INOTIFY_EVENT.unpack_from(data, off)
            off += _INOTIFY_EVENT.size
            names.append(os.fsdecode(data[off:off + size].rstrip(b"\0")))
            off += size


# --- prctl, capabilities ---

def prctl(option: int, arg2: int = 0, arg3: int = 0, arg4: int = 0, arg5: int = 0) -> int:
    return _check(_libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg2), ctypes.c_ulong(arg3),
                              ctypes.c_ulong(arg4), ctypes.c_ulong(arg5)), "prctl")


_titles: list = []   # the buffers /proc/PID/cmdline and environ point into must stay alive


class _MmMap(ctypes.Structure):   # struct prctl_mm_map
    _fields_ = [(n, ctypes.c_uint64) for n in (
        "start_code", "end_code", "start_data", "end_data", "start_brk", "brk", "start_stack",
        "arg_start", "arg_end", "env_start", "env_end", "auxv")] + [("auxv_size", ctypes.c_uint32),
                                                                     ("exe_fd", ctypes.c_uint32)]


def set_cmdline(argv: list[str], env: dict[str, str] | None = None) -> None:
    """Make /proc/self/cmdline (what ps shows) read `argv`, /proc/self/comm its argv[0], and with
    `env` /proc/self/environ read that environment: a process forked from a pre-imported parent
    would otherwise show the parent's. PR_SET_MM_MAP points the kernel's record of the arg and env
    areas at new buffers; with exe_fd -1 it needs no capability (PR_SET_MM_ARG_START would need
    CAP_SYS_RESOURCE); the other fields are this process's own, read from /proc/self/stat."""
    raw = b"\0".join(os.fsencode(a) for a in argv) + b"\0"
    buf = ctypes.create_string_buffer(raw, len(raw))
    env_buf = None
    if env is not None:
        raw_env = b"".join(os.fsencode(k) + b"=" + os.fsencode(v) + b"\0" for k, v in env.items()) or b"\0"
        env_buf = ctypes.create_string_buffer(raw_env, len(raw_env))
    with open("/proc/self/stat", "rb") as f:
        st = [int(x) for x in f.read().rsplit(b")", 1)[1].split()[1:]]
    field = lambda n: st[n - 4]   # noqa: E731 — proc(5) numbers fields from 1; st starts at field 4
    brk = _libc.syscall(_SYS_BRK, 0)
    env_start, env_end = ((ctypes.addressof(env_buf), ctypes.addressof(env_buf) + len(env_buf))
                          if env_buf is not None else (field(50), field(51)))
    m = _MmMap(start_code=field(26), end_code=field(27), start_data=field(45), end_data=field(46),
               start_brk=field(47), brk=brk, start_stack=field(28), arg_start=ctypes.addressof(buf),
               arg_end=ctypes.addressof(buf) + len(raw), env_start=env_start, env_end=env_end,
               auxv=0, auxv_size=0, exe_fd=0xFFFFFFFF)
    prctl(PR_SET_MM, PR_SET_MM_MAP, ctypes.addressof(m), ctypes.sizeof(m))
    _titles[:] = [buf, env_buf]
    name = ctypes.create_string_buffer(os.path.basename(argv[0]).encode()[:15], 16)
    prctl(PR_SET_NAME, ctypes.addressof(name))


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def capset(effective: int, permitted: int, inheritable: int) -> None:
    """Set this thread's capability sets from 64-bit masks."""
    hdr = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    for i in range(2):
        shift = 32 * i
        data[i].effective = (effective >> shift) & 0xFFFFFFFF
        data[i].permitted = (permitted >> shift) & 0xFFFFFFFF
        data[i].inheritable = (inheritable >> shift) & 0xFFFFFFFF
    _check(_libc.capset(ctypes.byref(hdr), data), "capset")


@functools.cache
def last_cap() -> int:
    """The highest capability this kernel knows. Cached: the first call (before pivot_root) may be
    the last chance to read /proc; without /proc, the bounding set is probed (as libcap does)."""
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            return int(f.read())
    except FileNotFoundError:
        lo, hi = 0, 63   # PR_CAPBSET_READ fails with EINVAL above the last capability
        while lo < hi:
            mid = (lo + hi + 1) // 2
            try:
                prctl(PR_CAPBSET_READ, mid)
                lo = mid
            except OSError:
                hi = mid - 1
        return lo


# --- sysinfo ---

class Sysinfo(ctypes.Structure):
    """struct sysinfo (linux/sysinfo.h), as sysinfo(2) fills it."""
    _fields_ = [("uptime", ctypes.c_long), ("loads", ctypes.c_ulong * 3),
                ("totalram", ctypes.c_ulong), ("freeram", ctypes.c_ulong),
                ("sharedram", ctypes.c_ulong), ("bufferram", ctypes.c_ulong),
                ("totalswap", ctypes.c_ulong), ("freeswap", ctypes.c_ulong),
                ("procs", ctypes.c_ushort), ("pad", ctypes.c_ushort),
                ("totalhigh", ctypes.c_ulong), ("freehigh", ctypes.c_ulong),
                ("mem_unit", ctypes.c_uint)]


def sysinfo() -> Sysinfo:
    info = Sysinfo()
    _check(_libc.sysinfo(ctypes.byref(info)), "sysinfo")
    return info


# --- network interfaces, terminals ---

_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1


def set_link_up(name: str) -> None:
    """Set IFF_UP on interface `name` of this process's network namespace (struct ifreq ioctls)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        req = fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, struct.pack("16sH22x", name.encode(), 0))
        flags = struct.unpack_from("16sH", req)[1]
        fcntl.ioctl(s.fileno(), _SIOCSIFFLAGS, struct.pack("16sH22x", name.encode(), flags | _IFF_UP))


def winsize(rows: int, cols: int) -> bytes:
    """struct winsize, for the TIOCSWINSZ ioctl."""
    return struct.pack("HHHH", rows, cols, 0, 0)


def accept4(fd: int) -> tuple[int, bytes]:
    """accept4(fd, SOCK_CLOEXEC) with the peer's raw sockaddr (socket.accept() decodes it and wraps
    the fd; the accepted fd here is handed on as it is). BlockingIOError when none is queued."""
    buf = ctypes.create_string_buffer(128)
    size = ctypes.c_uint32(128)
    res = _libc.accept4(fd, buf, ctypes.byref(size), socket.SOCK_CLOEXEC)
    if res < 0:
        raise errno_error()   # (EAGAIN comes out as BlockingIOError: OSError picks the subclass by errno)
    return res, buf.raw[:min(size.value, 128)]
