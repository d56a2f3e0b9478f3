"""`tmpcopyup`: a tmpfs mounted over a directory of the image starts with that directory's contents
(podman asks for it on every tmpfs it adds: --read-only's /run, /tmp and /var/tmp, --tmpfs), as runc
and crun copy them. Everything is reached through directory fds with O_NOFOLLOW: a symbolic link
in the image is copied as a link, never followed (the image is the container's, not the host's)."""
from __future__ import annotations

import os
import stat

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def copy_contents(src_fd: int, dst_fd: int) -> None:
    """Copy what the directory `src_fd` holds into the directory `dst_fd` (both may be O_PATH):
    directories, files, symbolic links, devices, fifos and sockets, with their owners, modes and
    times."""
    src = os.open(".", _DIR, dir_fd=src_fd)
    dst = os.open(".", _DIR, dir_fd=dst_fd)
    try:
        _copy_dir(src, dst)
    finally:
        os.close(src)
        os.close(dst)


def _copy_dir(src: int, dst: int) -> None:
    for name in os.listdir(src):
        st = os.stat(name, dir_fd=src, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            os.mkdir(name, 0o700, dir_fd=dst)
            s, d = os.open(name, _DIR, dir_fd=src), os.open(name, _DIR, dir_fd=dst)
            try:
                _copy_dir(s, d)
                _own(d, st)
            finally:
                os.close(s)
                os.close(d)
        elif stat.S_ISREG(st.st_mode):
            s = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=src)
            d = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dst)
            try:
                while os.sendfile(d, s, None, 1 << 30):
                    pass
                _own(d, st)
            finally:
                os.close(s)
                os.close(d)
        elif stat.S_ISLNK(st.st_mode):
            os.symlink(os.readlink(name, dir_fd=src), name, dir_fd=dst)
            os.chown(name, st.st_uid, st.st_gid, dir_fd=dst, follow_symlinks=False)
            os.utime(name, ns=(st.st_atime_ns, st.st_mtime_ns), dir_fd=dst, follow_symlinks=False)
        else:   # a device, fifo or socket: made again, as runc does
            os.mknod(name, st.st_mode, st.st_rdev, dir_fd=dst)
            os.chown(name, st.st_uid, st.st_gid, dir_fd=dst, follow_symlinks=False)
            os.chmod(name, stat.S_IMODE(st.st_mode), dir_fd=dst)   # (not a link: we just made it)
            os.utime(name, ns=(st.st_atime_ns, st.st_mtime_ns), dir_fd=dst, follow_symlinks=False)


def _own(fd: int, st: os.stat_result) -> None:
    os.fchown(fd, st.st_uid, st.st_gid)
    os.fchmod(fd, stat.S_IMODE(st.st_mode))   # after the chown, which clears set-id bits
    os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns))
