"""The container's filesystem view, built inside its new mount namespace.

Order (as runc): propagation of / -> bind the rootfs onto itself -> the spec's mounts -> device
nodes -> pivot_root -> sysctls (by the caller) -> masked and read-only paths -> read-only root.
For a container that may mount, the binds qvisor/rootfs_lock.py keeps out of its lock are only
made ready before pivot_root (their destinations, detached copies of their sources) and attached
after the lock (attach_unlocked).
Targets inside the rootfs are always opened with paths.open_in_root, never joined as strings.

The mounts themselves are in qvisor/rootfs_mounts.py, the device nodes in qvisor/rootfs_devices.py,
the /proc view's attachment in qvisor/rootfs_procview.py; this module holds the order and the steps
around pivot_root.
"""
from __future__ import annotations

import errno
import os
import stat

from qlib.errors import SetupError
from qlib import linux as L
from qvisor import mountopts, paths
from qvisor.rootfs_devices import create_devices
from qvisor.rootfs_mounts import (
    bind_source,
    fail,
    kept_flags,
    mount_one,
    parent_mount_private,
)
from qvisor.rootfs_procview import attach_procview, procview_wanted
from qvisor.spec import Mount, Spec

__all__ = ["attach_procview", "attach_unlocked", "bind_sources", "chroot", "finalize", "pivot", "prepare",
           "procview_wanted"]


def prepare(spec: Spec, cgroup_path: str, in_userns: bool, source_fds: dict[int, int],
            later: frozenset[int] = frozenset()) -> dict[int, int]:
    """Everything before pivot_root. Runs in the container's new mount namespace. `source_fds`
    maps the index of a bind mount in spec.mounts to an O_PATH fd of its source that the runtime
    opened as host root (see bind_sources). The binds indexed in `later` are not mounted: their
    destinations are made and their sources copied (open_tree), for attach_unlocked; returns those
    copies, index -> fd."""
    rootfs = spec.root.path
    prop = mountopts.PROPAGATION.get(spec.linux.rootfs_propagation or "rslave")
    if prop is None:
        raise SetupError(f"linux.rootfsPropagation: unknown value {spec.linux.rootfs_propagation!r}")
    try:
        L.mount(None, "/", None, prop)
        parent_mount_private(rootfs)
        L.mount(rootfs, rootfs, None, L.MS_BIND | L.MS_REC)
    except OSError as e:
        raise fail("mount root.path", rootfs, e) from None
    root_fd = os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    pending: dict[int, int] = {}
    try:
        for i, m in enumerate(spec.mounts):
            if i in later:
                pending[i] = _detached(root_fd, m, spec.bundle, source_fds.get(i))
                continue
            mount_one(root_fd, m, spec.bundle, cgroup_path, rootfs, source_fds.get(i))
            if os.path.normpath(m.destination) == "/":
                # a mount onto / replaces the root: later mounts (and pivot_root) go onto it
                os.close(root_fd)
                root_fd = os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        create_devices(root_fd, spec.linux.devices, in_userns)
    except BaseException:
        for fd in pending.values():
            os.close(fd)
        raise
    finally:
        os.close(root_fd)
    return pending


def _detached(root_fd: int, m: Mount, bundle: str, source_fd: int | None) -> int:
    """A bind mount made ready for attach_unlocked: its destination created in the rootfs (which
    may turn read-only before the attach) and a detached copy of its source."""
    opts = mountopts.parse(m.options)
    source = bind_source(m, bundle)
    try:
        if source_fd is not None:
            tree = os.dup(source_fd)
        else:
            tree = L.open_tree_clone(source, bool(opts.flags & L.MS_REC))
    except OSError as e:
        raise fail("bind mount source", source, e) from None
    try:
        is_dir = stat.S_ISDIR(os.stat(tree).st_mode)
        os.close(paths.ensure_in_root(root_fd, m.destination, is_dir))
    except OSError as e:
        os.close(tree)
        raise fail("mount destination", m.destination, e) from None
    except BaseException:
        os.close(tree)
        raise
    return tree


def attach_unlocked(spec: Spec, pending: dict[int, int]) -> None:
    """After pivot_root and the lock: the binds prepare() left detached attached where the spec
    puts them, in its order, with their flags and propagation (mount_one). Closes every fd."""
    root_fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for i in sorted(pending):
            mount_one(root_fd, spec.mounts[i], spec.bundle, "", "/", pending[i])
    finally:
        os.close(root_fd)
        for fd in pending.values():
            os.close(fd)


def bind_sources(spec: Spec) -> dict[int, int]:
    """Detached bind mounts of the bind mounts' sources (open_tree), made by the caller (the
    supervisor, host root) for an init in a user namespace: there the init is a mapped uid that
    may not reach a source the host's root can (runc passes such mounts too). The init attaches
    them with move_mount. Index in spec.mounts -> fd."""
    fds: dict[int, int] = {}
    try:
        for i, m in enumerate(spec.mounts):
            opts = mountopts.parse(m.options)
            if m.type in ("cgroup", "cgroup2") or not (m.type == "bind" or opts.is_bind):
                continue
            source = bind_source(m, spec.bundle)
            try:
                fds[i] = L.open_tree_clone(source, bool(opts.flags & L.MS_REC))
            except OSError as e:
                raise fail("bind mount source", source, e) from None
    except BaseException:
        for fd in fds.values():
            os.close(fd)
        raise
    return fds


def pivot(rootfs: str) -> None:
    """Make rootfs the root. pivot_root(".", ".") stacks the old root under the new one, and the
    detach unmounts it, so no path to the host's tree remains (runc's technique)."""
    os.chdir(rootfs)
    try:
        L.pivot_root(".", ".")
        L.mount(None, ".", None, L.MS_SLAVE | L.MS_REC)
        L.umount2(".", L.MNT_DETACH)
    except OSError as e:
        raise fail("pivot_root", rootfs, e) from None
    os.chdir("/")


def chroot(root: str | int) -> None:
    """Enter `root` (a path, or an fd of a directory) without pivot_root: for a container that
    shares a mount namespace, where pivot_root would move every process of that namespace."""
    try:
        if isinstance(root, int):
            os.fchdir(root)
        else:
            os.chdir(root)
        os.chroot(".")
    except OSError as e:
        raise fail("chroot", root if isinstance(root, str) else "the container's root", e) from None
    os.chdir("/")


def finalize(spec: Spec) -> None:
    """After pivot_root: shared root propagation if asked, masked paths, read-only paths, read-only root."""
    prop = mountopts.PROPAGATION.get(spec.linux.rootfs_propagation or "rslave", 0)
    if prop & L.MS_SHARED:   # the rootfs was bound from a private parent: share it now
        try:
            L.mount(None, "/", None, prop)
        except OSError as e:
            raise fail("linux.rootfsPropagation", spec.linux.rootfs_propagation, e) from None
    for p in spec.linux.readonly_paths:
        try:
            L.mount(p, p, None, L.MS_BIND | L.MS_REC)
            L.mount(None, p, None, L.MS_BIND | L.MS_REMOUNT | L.MS_RDONLY | L.MS_REC | kept_flags(p))
        except FileNotFoundError:
            continue
        except OSError as e:
            raise fail("readonly path", p, e) from None
    for p in spec.linux.masked_paths:
        try:
            if os.path.isdir(p) and not os.path.islink(p):
                L.mount("tmpfs", p, "tmpfs", L.MS_RDONLY, "size=0")
            else:
                L.mount("/dev/null", p, None, L.MS_BIND)
        except OSError as e:
            if e.errno == errno.ENOENT:
                continue
            raise fail("mask path", p, e) from None
    if spec.root.readonly:
        try:
            L.mount(None, "/", None, L.MS_BIND | L.MS_REMOUNT | L.MS_RDONLY | kept_flags("/"))
        except OSError as e:
            raise fail("remount read-only", "/", e) from None
