"""Resolve paths inside a container's rootfs without ever leaving it.

A hostile image can plant symlinks (`/proc -> /`, `etc -> ../../host`). Every path the runtime
mounts onto or writes inside the rootfs is opened with openat2(RESOLVE_IN_ROOT), which makes the
kernel resolve symlinks as if the rootfs were `/`, and then used through /proc/self/fd/N, so a
symlink swapped after the check cannot redirect the mount (the CVE-2021-30465 class).
"""
from __future__ import annotations

import ctypes
import os
import stat

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_SYS_OPENAT2 = 437
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_IN_ROOT = 0x10


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def open_in_root(root_fd: int, path: str, flags: int = os.O_PATH, mode: int = 0) -> int:
    """openat2 of `path` with `root_fd` as the root for symlinks and '..'."""
    how = _OpenHow(flags | os.O_CLOEXEC, mode, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)
    rel = os.fsencode(path.lstrip("/") or ".")
    fd = _libc.syscall(_SYS_OPENAT2, ctypes.c_int(root_fd), rel, ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return fd


def ensure_in_root(root_fd: int, path: str, is_dir: bool, mode: int = 0o755) -> int:
    """Create `path` (a directory, or an empty file) inside the root if missing, parents included,
    and return an O_PATH fd to it."""
    parts = [p for p in path.split("/") if p and p != "."]
    cur = os.dup(root_fd)
    try:
        for i, name in enumerate(parts):
            last = i == len(parts) - 1
            # resolve the whole prefix from the root each time, so a symlink met on the way is
            # followed as the container would follow it; create missing parts in the resolved parent
            prefix = "/".join(parts[:i + 1])
            try:
                nxt = open_in_root(root_fd, prefix)
            except FileNotFoundError:
                if last and not is_dir:
                    os.close(os.open(name, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o644, dir_fd=cur))
                else:
                    os.mkdir(name, mode, dir_fd=cur)
                nxt = open_in_root(root_fd, prefix)
            if not last and not stat.S_ISDIR(os.fstat(nxt).st_mode):
                os.close(nxt)
                raise NotADirectoryError(20, "not a directory", prefix)
            os.close(cur)
            cur = nxt
        return cur
    except BaseException:
        os.close(cur)
        raise


def fd_path(fd: int) -> str:
    return f"/proc/self/fd/{fd}"
