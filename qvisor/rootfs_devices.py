"""Device nodes in the container's /dev: the default set (qvisor/devices.py) and linux.devices, made
with mknod, or bound from the host's nodes in a user namespace (where mknod is refused), and the
/dev/fd, stdin, stdout, stderr and ptmx symlinks.
"""
from __future__ import annotations

import os
import stat

from qlib.errors import SetupError
from qlib import linux as L
from qvisor import paths
from qvisor.devices import DEFAULT_DEVICES
from qvisor.rootfs_mounts import fail
from qvisor.spec import Device

_DEV_SYMLINKS = [("/proc/self/fd", "/dev/fd"), ("/proc/self/fd/0", "/dev/stdin"),
                 ("/proc/self/fd/1", "/dev/stdout"), ("/proc/self/fd/2", "/dev/stderr")]


def create_devices(root_fd: int, devices: list[Device], in_userns: bool) -> None:
    wanted = [(p, t, ma, mi, mode, None, None) for p, t, ma, mi, mode in DEFAULT_DEVICES]
    wanted += [(d.path, d.type, d.major, d.minor, d.file_mode if d.file_mode is not None else 0o666, d.uid, d.gid)
               for d in devices]
    for path, typ, major, minor, mode, uid, gid in wanted:
        _make_device(root_fd, path, typ, major, minor, mode, uid, gid, in_userns)
    for src, dst in _DEV_SYMLINKS + [("pts/ptmx", "/dev/ptmx")]:
        parent = paths.ensure_in_root(root_fd, os.path.dirname(dst), True)
        try:
            name = os.path.basename(dst)
            if dst == "/dev/ptmx":
                try:
                    os.unlink(name, dir_fd=parent)
                except FileNotFoundError:
                    pass
            try:
                os.symlink(src, name, dir_fd=parent)
            except FileExistsError:
                pass
        finally:
            os.close(parent)


def _make_device(root_fd: int, path: str, typ: str, major: int, minor: int, mode: int,
                 uid: int | None, gid: int | None, in_userns: bool) -> None:
    parent = paths.ensure_in_root(root_fd, os.path.dirname(path), True)
    name = os.path.basename(path)
    try:
        if in_userns:
            # mknod is refused in a user namespace: bind the host's node instead (runc does the same)
            fd = paths.ensure_in_root(root_fd, path, False)
            try:
                L.mount(path, paths.fd_path(fd), None, L.MS_BIND)
            finally:
                os.close(fd)
            return
        kind = {"c": stat.S_IFCHR, "u": stat.S_IFCHR, "b": stat.S_IFBLK, "p": stat.S_IFIFO}[typ]
        try:
            dev = os.makedev(major, minor)
        except (OverflowError, ValueError):
            raise SetupError(f"linux.devices: {path}: device number {major}:{minor} is out of range") from None
        try:
            os.unlink(name, dir_fd=parent)
        except FileNotFoundError:
            pass
        except IsADirectoryError:
            raise SetupError(f"device {path}: a directory is in the way") from None
        os.mknod(name, kind | (mode & 0o7777), dev, dir_fd=parent)
        os.chmod(name, mode & 0o7777, dir_fd=parent)  # mknod is subject to the umask
        if uid is not None or gid is not None:
            os.chown(name, uid if uid is not None else -1, gid if gid is not None else -1, dir_fd=parent)
    except OSError as e:
        raise fail("create device", path, e) from None
    finally:
        os.close(parent)
