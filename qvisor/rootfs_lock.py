"""Lock quark's mounts before a container that may mount runs (its process holds CAP_SYS_ADMIN in its
own mount namespace, so QKernel lets bind mounts, propagation changes, umount and pivot_root through).

A container with CAP_SYS_ADMIN and no user namespace is host root: without more, it could unmount the
/dev/null over /proc/kcore, bind /proc without its submounts (a non-recursive bind drops the
read-only /proc/sys: core_pattern would be writable, a host escape) or remount /proc/sys read-write.
The kernel has a rule for exactly this: when a mount namespace is copied for a less privileged
user namespace, every mount in the copy is locked (MNT_LOCKED, and MNT_LOCK_READONLY / NOSUID /
NODEV / NOEXEC / ATIME for the flags it has) — it cannot be unmounted or moved alone, a
non-recursive bind of a mount with locked submounts is refused, and a locked flag cannot be cleared.

So, after the masks and read-only paths are in place, a helper child makes a new user namespace and,
in it, a copy of the container's mount namespace, and hands the init an fd of it; the init (still in
its own user namespace, whose CAP_SYS_ADMIN covers the new one, a descendant) joins that copy with
setns(CLONE_NEWNS) and the helper exits. The container's user namespace, capabilities and the rest of its namespaces are
unchanged; only its mount namespace is now owned by the helper's user namespace. Mounts the container
makes afterwards are its own and unlocked. One consequence, stated in docs/security.md: shared mounts become
slaves in the copy (the kernel's CL_SHARED_TO_SLAVE), so nothing the container mounts propagates
back out of its mount namespace.

What is locked is what guards the host: the masks, the read-only paths and the kernel's trees
(/proc, /sys, /dev) with whatever is mounted in them. The spec's other bind mounts (containerd's
/etc/hosts, /etc/resolv.conf, /etc/hostname, a pod's volumes) are attached after the lock
(`unlocked_binds`, qvisor/rootfs.py's attach_unlocked), as the container's own mounts would be: a
non-recursive bind of a directory holding them (`mount --bind /etc /x`, which Kubernetes'
mount-propagation checks make) works as with runc. Their read-only flag holds all the same: QKernel
refuses read-write bind remounts (EPERM), whatever is locked.
"""
from __future__ import annotations

import os
import socket

from qlib import linux as L
from qlib.errors import SetupError
from qvisor import mountopts
from qvisor.spec import Spec

KERNEL_TREES = ("/proc", "/sys", "/dev")   # what the masks and read-only paths guard


def unlocked_binds(spec: Spec) -> list[int]:
    """Indexes of spec.mounts that stay out of the lock: bind mounts outside the kernel's trees,
    with no masked or read-only path at, above or below them, and attached after the lock without
    changing what covers what: no mount listed after one lands at or above it (it would cover it,
    as in runc), and none that stays locked lies beneath it (it would be covered). None when
    createContainer hooks run: they see the rootfs before pivot_root with every mount in place."""
    if spec.hooks.create_container:
        return []
    dests = [os.path.normpath("/" + m.destination.lstrip("/")) for m in spec.mounts]
    guarded = [os.path.normpath("/" + p.lstrip("/")) for p in (*spec.linux.masked_paths, *spec.linux.readonly_paths)]
    found = set()
    for i, m in enumerate(spec.mounts):
        opts = mountopts.parse(m.options)
        d = dests[i]
        if m.type in ("cgroup", "cgroup2") or not (m.type == "bind" or opts.is_bind) or d == "/":
            continue
        if any(_within(d, k) for k in KERNEL_TREES) or any(_within(d, g) or _within(g, d) for g in guarded):
            continue
        if any(_within(d, dests[j]) for j in range(i + 1, len(dests))):
            continue
        found.add(i)
    while True:
        covering = {i for i in found if any(j not in found and dests[j] != dests[i] and _within(dests[j], dests[i])
                                            for j in range(len(dests)))}
        if not covering:
            return sorted(found)
        found -= covering


def _within(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def lock_mounts() -> None:
    """Move this process (the container's init, after pivot_root and the masks) into a locked copy of
    its mount namespace."""
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            parent.close()
            _helper(child)
        except BaseException:  # noqa: BLE001 - a forked child never unwinds into the init's code
            code = 1
        finally:
            os._exit(code)
    child.close()
    try:
        msg, fds, _, _ = socket.recv_fds(parent, 64, 1)
        if not msg.startswith(b"ok"):
            err = int(msg) if msg.isdigit() else 0
            raise SetupError("locking the container's mounts (it holds CAP_SYS_ADMIN): a user namespace "
                             f"for the locked copy: {os.strerror(err) if err else 'the helper died'}")
        # the helper's own /proc/self/ns/mnt when the container mounts a /proc; else its pidfd (which
        # the kernel lets a non-dumpable helper's parent use only with CAP_SYS_PTRACE over it)
        ns_fd = fds[0] if fds else L.pidfd_open(pid)
        try:
            L.setns(ns_fd, L.CLONE_NEWNS)
        except OSError as e:
            raise SetupError(f"locking the container's mounts: joining the locked copy: {e.strerror}") from None
        finally:
            os.close(ns_fd)
    finally:
        try:
            parent.send(b"done")   # the helper holds the namespace until the init has joined it
        except OSError:
            pass
        parent.close()
        os.waitpid(pid, 0)


def _helper(sock: socket.socket) -> None:
    """In the forked helper: the new user namespace and, in it, the locked copy. It stays
    non-dumpable (as every runtime process in a container), so it hands over an fd of its mount
    namespace rather than have the init reach it through /proc/PID."""
    try:
        L.unshare(L.CLONE_NEWUSER | L.CLONE_NEWNS)
    except OSError as e:
        sock.send(str(e.errno).encode())
        return
    try:
        fd = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        sock.send(b"ok")   # no /proc in the container: the init falls back to our pidfd
    else:
        socket.send_fds(sock, [b"ok"], [fd])
        os.close(fd)
    sock.recv(16)
