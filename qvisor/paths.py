"""Resolve paths inside a container's rootfs without ever leaving it.

A hostile image can plant symlinks (`/proc -> /`, `etc -> ../../host`). Every path the runtime
mounts onto or writes inside the rootfs is opened with openat2(RESOLVE_IN_ROOT), which makes the
kernel resolve symlinks as if the rootfs were `/`, and then used through /proc/self/fd/N, so a
symlink swapped after the check cannot redirect the mount (the CVE-2021-30465 class).
"""
from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator

from qlib import linux as L

SUN_PATH_MAX = 108   # sizeof(sockaddr_un.sun_path), with its NUL
_MAX_RETRIES = 40   # symlinks followed plus entries that changed under us, as the kernel's MAXSYMLINKS


def open_in_root(root_fd: int, path: str, flags: int = os.O_PATH, mode: int = 0) -> int:
    """openat2 of `path` with `root_fd` as the root for symlinks and '..'."""
    try:
        return L.openat2(root_fd, path.lstrip("/") or ".", flags, mode, L.RESOLVE_IN_ROOT | L.RESOLVE_NO_MAGICLINKS)
    except OSError as e:   # name the path as the caller gave it
        raise OSError(e.errno, os.strerror(e.errno), path) from None


def _open_child(dir_fd: int, name: str) -> int:
    """O_PATH fd of the entry `name` of `dir_fd`, following nothing: ELOOP if it is a symlink."""
    return L.openat2(dir_fd, name, os.O_PATH, 0, L.RESOLVE_BENEATH | L.RESOLVE_NO_SYMLINKS | L.RESOLVE_NO_MAGICLINKS)


def ensure_in_root(root_fd: int, path: str, is_dir: bool, mode: int = 0o755) -> int:
    """Create `path` (a directory, or an empty file) inside the root if missing, parents included,
    and return an O_PATH fd to it.

    The walk is one component at a time and the kernel follows no symlink: a symlink met on the
    way (the image's, or one a process sharing a volume swaps in) is read and followed here as the
    container would follow it — an absolute target restarts at the root, '..' never climbs above
    it — and a missing target is created inside the root, as runc's MkdirAll does."""
    todo = [p for p in path.split("/") if p and p != "."]
    canon: list[str] = []          # where `cur` is, from the root, for '..'
    cur = os.dup(root_fd)
    retries = 0
    try:
        while todo:
            name = todo.pop(0)
            last = not todo
            if name == "..":
                canon = canon[:-1]
                nxt = open_in_root(root_fd, "/".join(canon))
            else:
                try:
                    nxt = _open_child(cur, name)
                except OSError as e:
                    if e.errno not in (errno.ENOENT, errno.ELOOP):
                        raise
                    retries += 1
                    if retries > _MAX_RETRIES:
                        raise OSError(errno.ELOOP, "too many symbolic links or concurrent changes", path) from None
                    if e.errno == errno.ELOOP:
                        try:
                            target = os.readlink(name, dir_fd=cur)
                        except OSError:   # changed under us: look again
                            todo.insert(0, name)
                            continue
                        if target.startswith("/"):
                            canon = []
                            os.close(cur)
                            cur = os.dup(root_fd)
                        todo[:0] = [p for p in target.split("/") if p and p != "."]
                        continue
                    try:
                        if last and not is_dir:
                            os.close(os.open(name, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC,
                                             0o644, dir_fd=cur))
                        else:
                            os.mkdir(name, mode, dir_fd=cur)
                    except FileExistsError:
                        pass   # made meanwhile (or a symlink appeared): look again
                    todo.insert(0, name)
                    continue
                canon.append(name)
            if not last and not stat.S_ISDIR(os.fstat(nxt).st_mode):
                os.close(nxt)
                raise NotADirectoryError(errno.ENOTDIR, "not a directory", "/".join(canon))
            os.close(cur)
            cur = nxt
        return cur
    except BaseException:
        os.close(cur)
        raise


@contextlib.contextmanager
def socket_address(path: str) -> Iterator[str]:
    """`path` as a unix socket address to bind or connect: itself, or, where it is longer than an
    address holds (108 bytes: docker's runtime root and a 64-character id come close), the same file
    through an fd of its directory."""
    if len(os.fsencode(path)) < SUN_PATH_MAX:
        yield path
        return
    fd = os.open(os.path.dirname(path) or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield os.path.join(fd_path(fd), os.path.basename(path))
    finally:
        os.close(fd)


def fd_path(fd: int) -> str:
    return f"/proc/self/fd/{fd}"
