"""The container's filesystem view, built inside its new mount namespace.

Order (as runc): propagation of / -> bind the rootfs onto itself -> the spec's mounts -> device
nodes -> pivot_root -> sysctls (by the caller) -> masked and read-only paths -> read-only root.
Targets inside the rootfs are always opened with paths.open_in_root, never joined as strings.
"""
from __future__ import annotations

import errno
import logging
import os
import stat

from qlib import procfs
from qlib.errors import SetupError
from qvisor import linux as L
from qvisor import mountopts, paths
from qvisor.devices import DEFAULT_DEVICES
from qvisor.spec import Device, Mount, Spec

_DEV_SYMLINKS = [("/proc/self/fd", "/dev/fd"), ("/proc/self/fd/0", "/dev/stdin"),
                 ("/proc/self/fd/1", "/dev/stdout"), ("/proc/self/fd/2", "/dev/stderr")]
_LOCKED = {os.ST_NOSUID: L.MS_NOSUID, os.ST_NODEV: L.MS_NODEV, os.ST_NOEXEC: L.MS_NOEXEC,
           os.ST_NOATIME: L.MS_NOATIME, os.ST_NODIRATIME: L.MS_NODIRATIME, os.ST_RELATIME: L.MS_RELATIME}
log = logging.getLogger("quark.rootfs")


def _fail(step: str, target: str, e: OSError) -> SetupError:
    return SetupError(f"{step} {target}: {e.strerror or e}")


def _kept_flags(path: str) -> int:
    """Flags of the mount at path that a read-only remount must repeat (in a user namespace the
    kernel refuses to clear locked ones)."""
    f = os.statvfs(path).f_flag
    return sum(bit for st, bit in _LOCKED.items() if f & st)


def prepare(spec: Spec, cgroup_path: str, in_userns: bool, source_fds: dict[int, int]) -> None:
    """Everything before pivot_root. Runs in the container's new mount namespace. `source_fds`
    maps the index of a bind mount in spec.mounts to an O_PATH fd of its source that the runtime
    opened as host root (see bind_sources)."""
    rootfs = spec.root.path
    prop = mountopts.PROPAGATION.get(spec.linux.rootfs_propagation or "rslave")
    if prop is None:
        raise SetupError(f"linux.rootfsPropagation: unknown value {spec.linux.rootfs_propagation!r}")
    try:
        L.mount(None, "/", None, prop)
        _parent_mount_private(rootfs)
        L.mount(rootfs, rootfs, None, L.MS_BIND | L.MS_REC)
    except OSError as e:
        raise _fail("mount root.path", rootfs, e) from None
    root_fd = os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for i, m in enumerate(spec.mounts):
            _mount_one(root_fd, m, spec.bundle, cgroup_path, rootfs, source_fds.get(i))
            if os.path.normpath(m.destination) == "/":
                # a mount onto / replaces the root: later mounts (and pivot_root) go onto it
                os.close(root_fd)
                root_fd = os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        _create_devices(root_fd, spec.linux.devices, in_userns)
    finally:
        os.close(root_fd)


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
            source = _bind_source(m, spec.bundle)
            try:
                fds[i] = L.open_tree_clone(source, bool(opts.flags & L.MS_REC))
            except OSError as e:
                raise _fail("bind mount source", source, e) from None
    except BaseException:
        for fd in fds.values():
            os.close(fd)
        raise
    return fds


def _bind_source(m: Mount, bundle: str) -> str:
    return m.source if os.path.isabs(m.source) else os.path.join(bundle, m.source)


def _tmpfs_data(data: str, dest_fd: int) -> str:
    """A tmpfs without mode= gets the mode of the directory it covers, as runc does (the kernel's
    default is 1777, which would make e.g. a 0700 directory world-writable)."""
    if any(o.startswith("mode=") for o in data.split(",")):
        return data
    mode = f"mode={stat.S_IMODE(os.stat(dest_fd).st_mode):o}"
    return f"{data},{mode}" if data else mode


def _mount_one(root_fd: int, m: Mount, bundle: str, cgroup_path: str, rootfs: str, source_fd: int | None) -> None:
    opts = mountopts.parse(m.options)
    if m.type == "bind" and not opts.is_bind:
        opts.flags |= L.MS_BIND   # type "bind" without a bind option is a bind mount, as in runc
    if m.type == "cgroup" or m.type == "cgroup2":
        return _mount_cgroup(root_fd, m, opts, cgroup_path)
    if opts.is_bind:
        source = _bind_source(m, bundle)
        try:
            is_dir = stat.S_ISDIR(os.stat(source if source_fd is None else source_fd).st_mode)
        except OSError as e:
            raise _fail("bind mount source", source, e) from None
    else:
        source, is_dir = m.source or m.type, True
    onto_root = os.path.normpath(m.destination) == "/"
    try:
        # "/" is the rootfs itself (its bind onto itself, opened by path like pivot_root will)
        fd = os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC) if onto_root else \
            paths.ensure_in_root(root_fd, m.destination, is_dir)
    except OSError as e:
        raise _fail("mount destination", m.destination, e) from None
    try:
        if source_fd is not None:
            L.move_mount_fd(source_fd, fd)
        elif opts.is_bind:
            L.mount(source, paths.fd_path(fd), None, opts.flags & (L.MS_BIND | L.MS_REC))
        else:
            data = _tmpfs_data(opts.data, fd) if m.type == "tmpfs" else opts.data
            L.mount(source, paths.fd_path(fd), m.type, opts.flags, data or None)
        # the fd still names the directory under the new mount: reopen to reach the mount itself
        new = os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC) if onto_root else \
            _reopen_new_mount(root_fd, m.destination, fd)
        os.close(fd)
        fd = new
        target = paths.fd_path(fd)
        # a bind ignores other flags on the first call: apply them with a remount, as runc does
        rest = opts.flags & ~(L.MS_BIND | L.MS_REC | L.MS_REMOUNT)
        if opts.is_bind and rest:
            L.mount(None, target, None, L.MS_BIND | L.MS_REMOUNT | rest | _kept_flags(target))
        for p in opts.propagation or []:
            L.mount(None, target, None, p)
    except OSError as e:
        raise _fail(f"mount {m.type or 'bind'}", m.destination, e) from None
    finally:
        os.close(fd)


def _mnt_id(fd: int) -> int:
    mnt_id = procfs.fdinfo(fd).get("mnt_id")
    if mnt_id is None:
        raise SetupError(f"no mnt_id for fd {fd}")
    return int(mnt_id)


def _parent_mount_private(path: str) -> None:
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
        mounts = {mnt.mount_id: (mnt.parent_id, mnt.mount_point) for mnt in procfs.mountinfo()}
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
            sub = paths.ensure_in_root(fd, os.path.basename(mnt), True)
            try:
                L.mount(src, paths.fd_path(sub), None, L.MS_BIND)
                new = _reopen_new_mount(fd, os.path.basename(mnt), sub)
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
        raise _fail("mount cgroup", m.destination, e) from None
    finally:
        os.close(fd)


def _create_devices(root_fd: int, devices: list[Device], in_userns: bool) -> None:
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
        raise _fail("create device", path, e) from None
    finally:
        os.close(parent)


def pivot(rootfs: str) -> None:
    """Make rootfs the root. pivot_root(".", ".") stacks the old root under the new one, and the
    detach unmounts it, so no path to the host's tree remains (runc's technique)."""
    os.chdir(rootfs)
    try:
        L.pivot_root(".", ".")
        L.mount(None, ".", None, L.MS_SLAVE | L.MS_REC)
        L.umount2(".", L.MNT_DETACH)
    except OSError as e:
        raise _fail("pivot_root", rootfs, e) from None
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
        raise _fail("chroot", root if isinstance(root, str) else "the container's root", e) from None
    os.chdir("/")


def finalize(spec: Spec) -> None:
    """After pivot_root: shared root propagation if asked, masked paths, read-only paths, read-only root."""
    prop = mountopts.PROPAGATION.get(spec.linux.rootfs_propagation or "rslave", 0)
    if prop & L.MS_SHARED:   # the rootfs was bound from a private parent: share it now
        try:
            L.mount(None, "/", None, prop)
        except OSError as e:
            raise _fail("linux.rootfsPropagation", spec.linux.rootfs_propagation, e) from None
    for p in spec.linux.readonly_paths:
        try:
            L.mount(p, p, None, L.MS_BIND | L.MS_REC)
            L.mount(None, p, None, L.MS_BIND | L.MS_REMOUNT | L.MS_RDONLY | L.MS_REC | _kept_flags(p))
        except FileNotFoundError:
            continue
        except OSError as e:
            raise _fail("readonly path", p, e) from None
    for p in spec.linux.masked_paths:
        try:
            if os.path.isdir(p) and not os.path.islink(p):
                L.mount("tmpfs", p, "tmpfs", L.MS_RDONLY, "size=0")
            else:
                L.mount("/dev/null", p, None, L.MS_BIND)
        except OSError as e:
            if e.errno == errno.ENOENT:
                continue
            raise _fail("mask path", p, e) from None
    if spec.root.readonly:
        try:
            L.mount(None, "/", None, L.MS_BIND | L.MS_REMOUNT | L.MS_RDONLY | _kept_flags("/"))
        except OSError as e:
            raise _fail("remount read-only", "/", e) from None
