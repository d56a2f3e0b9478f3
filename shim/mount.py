"""Mounting the rootfs containerd's snapshotter hands over (CreateTaskRequest.rootfs) on bundle/rootfs."""
from __future__ import annotations

import ctypes
import ctypes.util
import os

from shim.ttrpc import Code, RpcError

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_NOATIME = 0x400
MS_NODIRATIME = 0x800
MS_BIND = 0x1000
MS_REC = 0x4000
MS_RELATIME = 0x200000
MNT_DETACH = 0x2

# fstab option -> (flags to set, flags to clear); everything else is filesystem data
_FLAGS = {
    "ro": (MS_RDONLY, 0), "rw": (0, MS_RDONLY),
    "nosuid": (MS_NOSUID, 0), "suid": (0, MS_NOSUID),
    "nodev": (MS_NODEV, 0), "dev": (0, MS_NODEV),
    "noexec": (MS_NOEXEC, 0), "exec": (0, MS_NOEXEC),
    "noatime": (MS_NOATIME, 0), "nodiratime": (MS_NODIRATIME, 0), "relatime": (MS_RELATIME, 0),
    "bind": (MS_BIND, 0), "rbind": (MS_BIND | MS_REC, 0),
    "defaults": (0, 0),
}


def parse_options(options: list[str]) -> tuple[int, str]:
    flags = 0
    data = []
    for opt in options:
        if opt in _FLAGS:
            on, off = _FLAGS[opt]
            flags = (flags | on) & ~off
        else:
            data.append(opt)
    return flags, ",".join(data)


def _mount(source: str, target: str, fstype: str, flags: int, data: str) -> None:
    if _libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None,
                   ctypes.c_ulong(flags), data.encode() if data else None) != 0:
        err = ctypes.get_errno()
        raise RpcError(Code.UNKNOWN, f"mount {fstype} {source} on {target} ({data}): {os.strerror(err)}")


def mount_rootfs(mounts: list, target: str) -> None:
    """Apply containerd Mounts (type, source, options) in order on target."""
    os.makedirs(target, exist_ok=True)
    for m in mounts:
        flags, data = parse_options(list(m.options))
        _mount(m.source, target, m.type, flags, data)
        if flags & MS_BIND and flags & MS_RDONLY:  # a bind mount takes ro only on a remount
            _mount("", target, "", flags | MS_REMOUNT, "")


def unmount_all(target: str) -> None:
    """Detach every mount stacked on target (idempotent: nothing mounted is not an error)."""
    for _ in range(32):
        if _libc.umount2(target.encode(), MNT_DETACH) != 0:
            return
