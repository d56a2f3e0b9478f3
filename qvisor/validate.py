"""What quark refuses before it makes anything (runc's libcontainer/configs/validate): settings it
cannot honour, and settings that would land in a namespace the container does not own — the host's.
Every refusal is a ConfigError naming config.json and the field."""
from __future__ import annotations

import os
from typing import Callable, NoReturn

from qlib import linux as L
from qlib.errors import ConfigError, QuarkError
from qvisor.process import not_held
from qvisor.spec import PROC_NS_NAMES, Process, Spec, sysctl_key

# sysctls that belong to a namespace (runc's list): anything else would change the host
_IPC_SYSCTLS = {"kernel.msgmax", "kernel.msgmnb", "kernel.msgmni", "kernel.sem", "kernel.shmall",
                "kernel.shmmax", "kernel.shmmni", "kernel.shm_rmid_forced"}


def owns_namespace(spec: Spec, kind: str) -> bool:
    """Does the container get a namespace of `kind` that is not the runtime's own? A new one does;
    one joined by path does unless the path names the namespace quark itself runs in (the host's,
    for a runtime started on the host) — a setting applied there would change the host."""
    ns = spec.linux.namespace(kind)
    if ns is None:
        return False
    if not ns.path:
        return True
    try:
        theirs, ours = os.stat(ns.path), os.stat(f"/proc/self/ns/{PROC_NS_NAMES[kind]}")
    except OSError:
        return True   # joining it fails later, with an error that names the path
    return (theirs.st_dev, theirs.st_ino) != (ours.st_dev, ours.st_ino)


def own_namespaces(spec: Spec) -> frozenset[str]:
    """The namespace kinds the container has its own of (QKernel's capability grants act only there).
    A mount namespace counts only when it is new: quark locks its mounts there (rootfs_lock.py)."""
    return frozenset(k for k in PROC_NS_NAMES if (spec.linux.new_namespace(k) if k == "mount"
                                                  else owns_namespace(spec, k)))


def _check_bidirectional(spec: Spec, fail: Callable[[str, str], NoReturn]) -> None:
    """A shared mount (Kubernetes' Bidirectional propagation) promises that what the container mounts
    under it appears on the host. For a container that may mount (QKernel's grant: CAP_SYS_ADMIN in
    its own mount namespace) quark cannot keep that promise: it locks such a container's mounts in a
    copy of its mount namespace made for a less privileged user namespace (qvisor/rootfs_lock.py), and
    the kernel turns every shared mount of such a copy into a slave. Refused rather than silently made
    one-way; a container that cannot mount has nothing to send back, and gets the mount as runc does."""
    from qvisor.sandbox import mounts_granted
    if not mounts_granted(spec, own_namespaces(spec)):
        return
    for i, m in enumerate(spec.mounts):
        shared = next((o for o in m.options if o in ("shared", "rshared")), None)
        if shared:
            fail(f"mounts[{i}].options", f"{shared} ({m.destination}; Kubernetes' Bidirectional mount "
                 "propagation) is not supported by quark for a container that may mount (CAP_SYS_ADMIN in "
                 "its own mount namespace, e.g. a privileged one): quark keeps such a container's mounts in a "
                 "locked mount namespace, where the kernel makes shared mounts slaves, so nothing it mounts "
                 "there could reach the host; use rslave (HostToContainer) to see the host's mounts")


def _check_sysctl(spec: Spec, fail: Callable[[str, str], NoReturn]) -> None:
    for key in spec.linux.sysctl:
        k = sysctl_key(key)
        where = f"linux.sysctl.{key}"
        if k in ("kernel.hostname", "kernel.domainname"):
            field = k.split(".")[1]
            fail(where, f"conflicts with the OCI {field!r} field: set {field} instead")
        if k in _IPC_SYSCTLS or k.startswith("fs.mqueue."):
            if not owns_namespace(spec, "ipc"):
                fail(where, "is not allowed in the host's IPC namespace (add an ipc namespace to linux.namespaces)")
        elif k.startswith("net."):
            if not owns_namespace(spec, "network"):
                fail(where, "is not allowed in the host's network namespace "
                            "(add a network namespace to linux.namespaces)")
        else:
            fail(where, "is not in a namespace the container has its own of: it would change the host")


# What is built by mounting, in a new mount namespace only: in the runtime's own (or a joined) one
# these would change the host's mount table or another container's.
_MOUNT_FIELDS = (("mounts", lambda s: s.mounts), ("linux.maskedPaths", lambda s: s.linux.masked_paths),
                 ("linux.readonlyPaths", lambda s: s.linux.readonly_paths),
                 ("linux.devices", lambda s: s.linux.devices), ("root.readonly", lambda s: s.root.readonly),
                 ("linux.rootfsPropagation", lambda s: s.linux.rootfs_propagation))


def lsm_enabled(name: str) -> bool:
    """Whether the host runs the AppArmor or SELinux security module."""
    if name == "selinux":
        return os.path.exists("/sys/fs/selinux/enforce")
    try:
        with open("/sys/module/apparmor/parameters/enabled") as f:
            return f.read().strip() == "Y"
    except OSError:
        return False


def check_process(proc: Process, fail: Callable[[str, str], NoReturn]) -> None:
    """What quark cannot honour in a process (the container's, or an exec's process.json): the
    LSM labels, which quark does not apply; where the host has no such LSM, runc refuses them too."""
    if proc.apparmor_profile:
        fail("process.apparmorProfile", f"quark does not apply AppArmor profiles ({proc.apparmor_profile!r}); "
                                        "leave it out (containerd: disable_apparmor = true)" if lsm_enabled("apparmor")
             else f"AppArmor is not enabled on this host: profile {proc.apparmor_profile!r} cannot be applied")
    if proc.selinux_label:
        fail("process.selinuxLabel", "quark does not apply SELinux labels" if lsm_enabled("selinux")
             else "SELinux is not enabled on this host: the label cannot be applied")


def check_supported(spec: Spec) -> None:
    """Refuse, before anything is made, what quark cannot honour and what would reach the host."""
    cfg = os.path.join(spec.bundle, "config.json")

    def fail(field: str, message: str) -> NoReturn:
        raise ConfigError(cfg, field, message)

    if spec.process is None:
        fail("process", "is required to create a container")
    check_process(spec.process, fail)
    caps = spec.process.capabilities
    if caps is not None and not spec.linux.new_namespace("user"):
        # capset cannot give what this process does not hold: runc's create fails there too (a new
        # user namespace starts with every capability in it)
        missing = not_held(caps.permitted + caps.effective + caps.inheritable, L.last_cap())
        if missing:
            fail("process.capabilities", f"{', '.join(missing)}: not held by the runtime on this host, so the "
                                         "container's process cannot be given them")
    if spec.linux.mount_label:
        fail("linux.mountLabel", "quark does not apply SELinux labels" if lsm_enabled("selinux")
             else "SELinux is not enabled on this host: the mount label cannot be applied")
    if not os.path.isdir(spec.root.path):
        fail("root.path", f"{spec.root.path} is not a directory")
    for field in ("hostname", "domainname"):
        if getattr(spec, field) and not owns_namespace(spec, "uts"):
            fail(field, f"unable to set {field} without a private UTS namespace")
    _check_sysctl(spec, fail)
    if not spec.linux.new_namespace("mount"):
        for field, value in _MOUNT_FIELDS:
            if value(spec):
                fail(field, "needs a new mount namespace (linux.namespaces without a mount entry, or with a "
                            "path, shares a mount table that is not the container's own)")
    for i, m in enumerate(spec.mounts):
        for key, maps in (("uidMappings", m.uid_mappings), ("gidMappings", m.gid_mappings)):
            if maps:  # `quark features` says mountExtensions.idmap is not enabled
                fail(f"mounts[{i}].{key}", "idmapped mounts are not supported")
    _check_bidirectional(spec, fail)
    if spec.linux.seccomp is not None and spec.linux.seccomp.listener_path:
        fail("linux.seccomp.listenerPath", "seccomp agents are not supported "
                                           "(quark's own kernel services the notifications)")
    idle = spec.annotations.get("io.quark.hibernate.idle-after")
    if idle is not None:
        from qvisor.supervisor.snapshot import parse_duration
        try:
            parse_duration(idle)
        except QuarkError as e:
            fail("annotations.io.quark.hibernate.idle-after", str(e).split(": ", 1)[1])
