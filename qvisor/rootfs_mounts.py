"""The spec's mounts, made inside the rootfs in the container's new mount namespace: binds (with their
flags applied by a remount, as runc), filesystems, and the container's own cgroup; plus the mount-table
reads they need (mount ids, the parent mount's propagation, re-finding a mount just made). The order
of the steps is qvisor/rootfs.py's. Targets inside the rootfs are always opened with
paths.open_in_root, never joined as strings.
"""
from __future__ import annotations

import os
import stat

from qlib import procfs
from qlib.errors import SetupError
from qlib import linux as L
from qvisor import mountopts, paths, tmpcopyup
from qvisor.spec import Mount

_LOCKED = {os.ST_NOSUID: L.MS_NOSUID, os.ST_NODEV: L.MS_NODEV, os.ST_NOEXEC: L.MS_NOEXEC,
           os.ST_NOATIME: L.MS_NOATIME, os.ST_NODIRATIME: L.MS_NODIRATIME, os.ST_RELATIME: L.MS_RELATIME}


def fail(step: str, target: str, e: OSError) -> SetupError:
    return SetupError(f"{step} {target}: {e.strerror or e}")


def kept_flags(path: str) -> int:
    """Flags of the mount at path that a read-only remount must repeat (in a user namespace the
    kernel refuses to clear locked ones)."""
    f = os.statvfs(path).f_flag
    return sum(bit for st, bit in _LOCKED.items() if f & st)


def bind_source(m: Mount, bundle: str) -> str:
    return m.source if os.path.isabs(m.source) else os.path.join(bundle, m.source)


def _tmpfs_data(data: str, dest_fd: int) -> str:
    """A tmpfs without mode= gets the mode of the directory it covers, as runc does (the kernel's
    default is 1777, which would make e.g. a 0700 directory world-writable)."""
    if any(o.startswith("mode=") for o in data.split(",")):
        return data
    mode = f"mode={stat.S_IMODE(os.stat(dest_fd).st_mode):o}"
    return f"{data},{mode}" if data else mode


def mount_one(root_fd: int, m: Mount, bundle: str, cgroup_path: str, rootfs: str, source_fd: int | None) -> None:
    opts = mountopts.parse(m.options)
    if m.type == "bind" and not opts.is_bind:
        opts.flags |= L.MS_BIND   # type "bind" without a bind option is a bind mount, as in runc
    if m.type == "cgroup" or m.type == "cgroup2":
        return _mount_cgroup(root_fd, m, opts, cgroup_path)
    if opts.is_bind:
        source = bind_source(m, bundle)
        try:
            is_dir = stat.S_ISDIR(os.stat(source if source_fd is None else source_fd).st_mode)
        except OSError as e:
            raise fail("bind mount source", source, e) from None
    else:
        source, is_dir = m.source or m.type, True
    onto_root = os.path.normpath(m.destination) == "/"
    copy_up = opts.copy_up and m.type == "tmpfs" and not onto_root and source_fd is None
    try:
        # "/" is the rootfs itself (its bind onto itself, opened by path like pivot_root will)
        fd = os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC) if onto_root else \
            paths.ensure_in_root(root_fd, m.destination, is_dir)
    except OSError as e:
        raise fail("mount destination", m.destination, e) from None
    try:
        if source_fd is not None:
            L.move_mount_fd(source_fd, fd)
        elif opts.is_bind:
            L.mount(source, paths.fd_path(fd), None, opts.flags & (L.MS_BIND | L.MS_REC))
        else:
            data = _tmpfs_data(opts.data, fd) if m.type == "tmpfs" else opts.data
            # a tmpfs to copy into is made writable, and read-only after the copy (as runc does)
            flags = opts.flags & ~L.MS_RDONLY if copy_up else opts.flags
            L.mount(source, paths.fd_path(fd), m.type, flags, data or None)
        # the fd still names the directory under the new mount: reopen to reach the mount itself
        new = os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC) if onto_root else \
            _reopen_new_mount(root_fd, m.destination, fd)
        if copy_up:
            _copy_up(fd, new, m.destination, opts.flags)
        os.close(fd)
        fd = new
        target = paths.fd_path(fd)
        # a bind ignores other flags on the first call: apply them with a remount, as runc does
        rest = opts.flags & ~(L.MS_BIND | L.MS_REC | L.MS_REMOUNT)
        if opts.is_bind and rest:
            L.mount(None, target, None, L.MS_BIND | L.MS_REMOUNT | rest | kept_flags(target))
        for p in opts.propagation or []:
            L.mount(None, target, None, p)
    except OSError as e:
        raise fail(f"mount {m.type or 'bind'}", m.destination, e) from None
    finally:
        os.close(fd)


def _copy_up(covered: int, tmpfs: int, dest: str, flags: int) -> None:
    """tmpcopyup: the image's directory under the new tmpfs (still reached through `covered`, opened
    before the mount) copied into it, then the read-only remount the copy waited for."""
    try:
        tmpcopyup.copy_contents(covered, tmpfs)
    except OSError as e:
        raise fail("tmpcopyup: copying the image's files into the tmpfs at", dest, e) from None
    if flags & L.MS_RDONLY:
        L.mount(None, paths.fd_path(tmpfs), None, L.MS_REMOUNT | flags)


def _mnt_id(fd: int) -> int:
    mnt_id = procfs.fdinfo(fd).get("mnt_id")
    if mnt_id is None:
        raise SetupError(f"no mnt_id for fd {fd}")
    return int(mnt_id)


def parent_mount_private(path: str) -> None:
    """Make the mount that holds `path` private (in our mount namespace) if it is shared, as runc
    does: the rootfs bind would otherwise propagate to its peers — with rootfsPropagation=shared on
    a host whose / is shared, into the host — and pivot_root refuses a shared parent."""
    fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    try:
        mid = _mnt_id(fd)
    finally:
        os.close(fd)
    for mnt in procfs.mountinfo():
        if mnt.mount_id == mid:
            if mnt.shared:
                L.mount(None, mnt.mount_point, None, L.MS_PRIVATE)
            return


def _reopen_new_mount(root_fd: int, dest: str, under_fd: int) -> int:
    """After a mount onto `under_fd` (a directory, by its /proc/self/fd path), return an fd to the
    new mount itself; `under_fd` stays open (the caller's to close). Reaching the mount means
    resolving `dest` again, and a process that shares a volume on the way could swap a symlink in
    meanwhile and make it name another mount — which would then get this mount's read-only or
    propagation flags, leaving this one writable. So the mount found must sit on under_fd's
    directory (stacked mounts allowed)."""
    parent_id = _mnt_id(under_fd)
    point = os.readlink(paths.fd_path(under_fd))
    fd = paths.open_in_root(root_fd, dest)
    try:
        mounts = procfs.mount_tree()
        mid = _mnt_id(fd)
        for _ in range(len(mounts)):
            if mid not in mounts or mounts[mid][1] != point:
                break
            if mounts[mid][0] == parent_id:
                return fd
            mid = mounts[mid][0]
        raise SetupError(f"mount destination {dest}: it changed while it was being mounted (a symlink swapped in?)")
    except BaseException:
        os.close(fd)
        raise


def _v1_hierarchies() -> list[tuple[str, str]]:
    """(mount point, options) of each cgroup v1 hierarchy visible to this process."""
    return [(mnt.mount_point, mnt.super_options) for mnt in procfs.mountinfo() if mnt.fstype == "cgroup"]


def _mount_cgroup(root_fd: int, m: Mount, opts: mountopts.MountOptions, cgroup_path: str) -> None:
    """Give the container its own cgroup, never the host's tree: the container's cgroup directory of
    each hierarchy is bound in (v1 under a tmpfs, v2 directly), read-only if asked."""
    from qvisor import cgroups
    ro = opts.flags & L.MS_RDONLY
    flags = (opts.flags & ~L.MS_RDONLY) | L.MS_NOSUID | L.MS_NODEV | L.MS_NOEXEC
    fd = paths.ensure_in_root(root_fd, m.destination, True)
    try:
        if cgroups.detect() == "v2":
            L.mount("/sys/fs/cgroup" + cgroup_path, paths.fd_path(fd), None, L.MS_BIND | L.MS_REC)
            if ro:
                new = _reopen_new_mount(root_fd, m.destination, fd)
                os.close(fd)
                fd = new
                L.mount(None, paths.fd_path(fd), None, L.MS_BIND | L.MS_REMOUNT | L.MS_RDONLY | flags)
            return
        L.mount("tmpfs", paths.fd_path(fd), "tmpfs", flags, "mode=755")
        new = _reopen_new_mount(root_fd, m.destination, fd)  # now the tmpfs
        os.close(fd)
        fd = new
        for mnt, _ in _v1_hierarchies():
            src = mnt + cgroup_path
            if not mnt.startswith("/sys/fs/cgroup/") or not os.path.isdir(src):
                continue
            name = os.path.basename(mnt)
            sub = paths.ensure_in_root(fd, name, True)
            try:
                L.mount(src, paths.fd_path(sub), None, L.MS_BIND)
                # no mount table check here (one per hierarchy was a large share of the rootfs's
                # set-up): the directory is ours, in the tmpfs just made in this mount namespace,
                # which no other process can reach yet, so nothing can swap it for another mount
                new = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            finally:
                os.close(sub)
            sub = new
            try:
                L.mount(None, paths.fd_path(sub), None, L.MS_BIND | L.MS_REMOUNT | flags | (L.MS_RDONLY if ro else 0))
            finally:
                os.close(sub)
        if ro:
            L.mount(None, paths.fd_path(fd), None, L.MS_REMOUNT | L.MS_RDONLY | flags)
    except OSError as e:
        raise fail("mount cgroup", m.destination, e) from None
    finally:
        os.close(fd)
