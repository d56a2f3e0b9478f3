"""Mounting the rootfs containerd's snapshotter hands over (CreateTaskRequest.rootfs) on bundle/rootfs."""
from __future__ import annotations

import os

from qlib import linux as L
from shim.ttrpc import Code, RpcError


def parse_options(options: list[str]) -> tuple[int, str]:
    """fstab options -> (mount flags, filesystem data), with qlib.linux's one option table."""
    flags = 0
    data = []
    for opt in options:
        if opt in L.MOUNT_FLAGS:
            clear, bit = L.MOUNT_FLAGS[opt]
            flags = flags & ~bit if clear else flags | bit
        elif opt != "defaults":
            data.append(opt)
    return flags, ",".join(data)


def _mount(source: str, target: str, fstype: str, flags: int, data: str) -> None:
    try:
        L.mount(source, target, fstype or None, flags, data or None)
    except OSError as e:
        raise RpcError(Code.UNKNOWN, f"mount {fstype} {source} on {target} ({data}): {e.strerror}") from None


def mount_rootfs(mounts: list, target: str) -> None:
    """Apply containerd Mounts (type, source, options) in order on target."""
    os.makedirs(target, exist_ok=True)
    for m in mounts:
        flags, data = parse_options(list(m.options))
        _mount(m.source, target, m.type, flags, data)
        if flags & L.MS_BIND and flags & L.MS_RDONLY:  # a bind mount takes ro only on a remount
            _mount("", target, "", flags | L.MS_REMOUNT, "")


def unmount_all(target: str) -> None:
    """Detach every mount stacked on target (idempotent: nothing mounted is not an error)."""
    for _ in range(32):
        try:
            L.umount2(target, L.MNT_DETACH)
        except OSError:
            return
