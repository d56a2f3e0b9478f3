"""mount(2) of a new filesystem, for a container granted mounts (CAP_SYS_ADMIN in a mount namespace of
its own: qkernel/table.py's grant): a tmpfs is made, anything else stays EPERM.

The filter cannot read the filesystem type (it is behind a pointer), and letting the call continue
natively after reading it would be unsafe: another thread, or another process sharing the memory,
can rewrite the string between the check and the kernel's own read (seccomp_unotify(2) warns of
exactly this). So the supervisor copies the arguments once, checks its copy and makes the mount itself,
with that copy: a child of the supervisor joins the task's mount namespace (and user namespace, when
the container has its own), changes directory to the target, which it resolved inside the task's
root beforehand, and mounts there. The tmpfs therefore lands in the container's own mount namespace
only, on a directory the container can reach, and quark's locked mounts stay as they are (a tmpfs
over one of them hides it; unmounting the tmpfs shows it again).
"""
from __future__ import annotations

import errno
import os
from typing import Callable

from qkernel.errors import TaskGone
from qkernel.request import Errno, Request, Return
from qlib import linux as L
from qlib import procfs

FILESYSTEMS = frozenset({"tmpfs"})
# mount(2)'s flags that mean something for a new tmpfs (per-mount and superblock options); the
# kernel's internal ones (MS_KERNMOUNT, MS_NOUSER, ...) and anything else are refused with EINVAL
_MS_POSIXACL, _MS_I_VERSION = 1 << 16, 1 << 23
ALLOWED_FLAGS = (L.MS_RDONLY | L.MS_NOSUID | L.MS_NODEV | L.MS_NOEXEC | L.MS_SYNCHRONOUS | L.MS_MANDLOCK
                 | L.MS_DIRSYNC | L.MS_NOSYMFOLLOW | L.MS_NOATIME | L.MS_NODIRATIME | L.MS_REC | L.MS_SILENT
                 | _MS_POSIXACL | L.MS_RELATIME | _MS_I_VERSION | L.MS_STRICTATIME | L.MS_LAZYTIME)
# the "magic" old callers put in the top half of the flags; the kernel drops it
_MS_MGC_MSK, _MS_MGC_VAL = 0xFFFF0000, 0xC0ED0000
_PATH_MAX = 4096
_TYPE_MAX = 64
_DATA_MAX = 4096   # the kernel copies one page of options


def handle(req: Request) -> Return | Errno:
    source_p, target_p, type_p, flags, data_p = req.args[:5]
    flags &= 0xFFFFFFFFFFFFFFFF
    if flags & _MS_MGC_MSK == _MS_MGC_VAL:
        flags &= ~_MS_MGC_MSK   # (its mask holds the propagation flags: a magic call never changes one)
    if not type_p:
        return Errno(errno.EINVAL)
    fstype = req.read_string(type_p, _TYPE_MAX)
    if fstype is None or fstype.decode(errors="replace") not in FILESYSTEMS:
        return Errno(errno.EPERM)   # what the filter answered before: a new proc or sysfs would bypass quark's masks
    if flags & ~ALLOWED_FLAGS:
        return Errno(errno.EINVAL)
    if not target_p:
        return Errno(errno.EFAULT)
    target = req.read_string(target_p, _PATH_MAX)
    source = req.read_string(source_p, _PATH_MAX) if source_p else b"none"
    data = req.read_string(data_p, _DATA_MAX) if data_p else None
    if target is None or source is None or (data_p and data is None):
        return Errno(errno.ENAMETOOLONG if target is None else errno.EINVAL)
    if not target:
        return Errno(errno.ENOENT)
    return mount_for(req, source, target, fstype, flags, data)


def mount_for(req: Request, source: bytes, target: bytes, fstype: bytes, flags: int,
              data: bytes | None) -> Return | Errno:
    """Make the mount in the trapped task's mount namespace, at `target` as the task resolves it
    (inside its root; a relative path beneath its working directory)."""
    tid = req.pid
    fds: list[int] = []
    try:
        try:
            for what in ("root", "cwd", "ns/mnt", "ns/user"):
                flag = os.O_PATH if what in ("root", "cwd") else os.O_RDONLY
                fds.append(os.open(f"/proc/{tid}/{what}", flag | os.O_CLOEXEC))
            status = procfs.status(tid)
        except (FileNotFoundError, ProcessLookupError) as e:
            raise TaskGone(tid) from e
        root, cwd, mntns, userns = fds
        fsuid, fsgid = int(status["Uid"].split()[3]), int(status["Gid"].split()[3])   # host ids
        req.check_valid()   # the fds and ids are the trapped task's, not a reused pid's
        path = os.fsdecode(target)
        try:
            at = L.openat2(root if path.startswith("/") else cwd, path, os.O_PATH, 0,
                           L.RESOLVE_IN_ROOT | L.RESOLVE_NO_MAGICLINKS)
        except OSError as e:
            return Errno(e.errno or errno.ENOENT)
        fds.append(at)
        own_userns = os.stat(userns).st_ino != os.stat("/proc/self/ns/user").st_ino
        return _in_child(lambda: _mount_there(at, mntns, userns if own_userns else None, (fsuid, fsgid),
                                              source, fstype, flags, data))
    finally:
        for fd in fds:
            os.close(fd)


def _mount_there(at: int, mntns: int, userns: int | None, fs_ids: tuple[int, int], source: bytes,
                 fstype: bytes, flags: int, data: bytes | None) -> None:
    """In the child: take the task's filesystem ids (the new tmpfs's root is theirs, as if the task
    had mounted it), join its namespaces (setns of a mount namespace needs a single-threaded process,
    which the supervisor is not) and mount onto the directory `at` names."""
    L.set_fs_ids(*fs_ids)   # host ids, set before joining a user namespace that maps them
    if userns is not None:   # the filesystem then belongs to the container's user namespace
        L.setns(userns, L.CLONE_NEWUSER)
    L.setns(mntns, L.CLONE_NEWNS)
    os.fchdir(at)   # after setns, which moves the working directory to the namespace's root
    L.mount(os.fsdecode(source), ".", os.fsdecode(fstype), flags, os.fsdecode(data) if data is not None else None)


def _in_child(body: Callable[[], None]) -> Return | Errno:
    """Run `body` in a forked child; its errno comes back through a pipe (not its exit status: the
    supervisor's reaper waits for any child and may collect this one first). The child runs only
    system calls, no logging or locks: it is forked from a multithreaded process."""
    r, w = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(r)
            body()
        except OSError as e:
            code = e.errno if e.errno else errno.EPERM
        except BaseException:  # noqa: BLE001 - nothing may unwind into the supervisor's code
            code = errno.EPERM
        try:
            os.write(w, code.to_bytes(4, "little"))
        finally:
            os._exit(0)
    os.close(w)
    try:
        answer = b""
        while chunk := os.read(r, 4):
            answer += chunk
    finally:
        os.close(r)
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass   # the reaper collected it
    if len(answer) != 4:
        return Errno(errno.EPERM)   # it died before it could answer
    code = int.from_bytes(answer, "little")
    return Return(0) if code == 0 else Errno(code)
