"""Attaching the container's /proc view (qvisor/procview.py) in the rootfs: whether a container gets
it, and binding the view's files over /proc/meminfo, cpuinfo, ... before pivot_root.
"""
from __future__ import annotations

import logging
import os
import stat

from qlib import linux as L
from qvisor import paths
from qvisor.spec import Spec

log = logging.getLogger("quark.rootfs")


def procview_wanted(spec: Spec) -> bool:
    """Whether the container gets its /proc view (qvisor/procview.py): only one that mounts its own
    /proc (in its own mount namespace: the caller's condition), unless its annotation says "false"."""
    from qvisor.procview import ANNOTATION
    if spec.annotations.get(ANNOTATION, "").strip().lower() in ("false", "0", "no", "off"):
        return False
    return any(m.type == "proc" and os.path.normpath(m.destination) == "/proc" for m in spec.mounts)


def attach_procview(spec: Spec, mnt: int) -> bool:
    """Bind the /proc view's files over /proc/meminfo, cpuinfo, ... and /sys/devices/system/cpu/online
    in the rootfs, after the spec's mounts and before pivot_root (so masked and read-only paths still
    apply on top). `mnt` is the view's filesystem, a detached mount the supervisor made and serves.
    It is attached for the while onto the rootfs's /proc mount itself (a directory that is there and
    that nothing uses yet: no directory is made anywhere), its files are bound from there, and it is
    detached again: the binds keep it alive, and no path to it remains. A file the spec mounts itself,
    or that the rootfs lacks (no /sys), is left alone. A failure leaves none of the view and only a
    warning: the container then sees the host's files. True if the view is in place."""
    from qvisor.procview import ANNOTATION, TARGETS
    own = {os.path.normpath(m.destination) for m in spec.mounts}
    root_fd = os.open(spec.root.path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    targets: dict[str, int] = {}
    bound: list[str] = []
    try:
        for name, dest in TARGETS.items():
            try:
                fd = paths.open_in_root(root_fd, dest)
            except OSError:
                continue
            if dest in own or not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                continue
            targets[name] = fd
        proc = paths.open_in_root(root_fd, "/proc")
        try:
            L.move_mount_fd(mnt, proc)
        finally:
            os.close(proc)
        try:
            for name, fd in targets.items():
                # the FUSE lookup of `name` is answered by the supervisor's loop
                L.mount(f"{paths.fd_path(mnt)}/{name}", paths.fd_path(fd), None, L.MS_BIND)
                bound.append(TARGETS[name])
        finally:
            L.umount2(paths.fd_path(mnt), L.MNT_DETACH)
        return True
    except OSError as e:
        log.warning("the container's /proc view is off: it sees the host's %s (%s; annotation %s=false skips "
                    "the view)", ", ".join(TARGETS.values()), e, ANNOTATION)
        for dest in bound:   # a partial view would contradict itself: undo it
            try:
                fd = paths.open_in_root(root_fd, dest)   # the bind now on top, not the file under it
                try:
                    L.umount2(paths.fd_path(fd), L.MNT_DETACH)
                finally:
                    os.close(fd)
            except OSError:
                pass
        return False
    finally:
        for fd in targets.values():
            os.close(fd)
        os.close(root_fd)
