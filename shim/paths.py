"""Where a shim's socket lives and where quark keeps the state of containerd's containers.

- socket: /run/containerd/s/<sha256(containerd address, namespace, group)>, the same scheme as
  containerd's runc shim, so one pod's containers find their sandbox's shim. The group is the pod
  (`shim: {scope: pod}`, the default), or the node (`shim: {scope: node}` in quark's host
  configuration): then one shim serves every quark container of that containerd and namespace
  created by this quark (node_group).
- quark --root: <containerd state dir>/quark/<namespace> when the bundle sits in containerd's
  `io.containerd.runtime.v2.task/<namespace>/<id>` (so a private containerd keeps a private
  quark root, as runc's /run/containerd/runc/<namespace>); /run/containerd/quark/<namespace>
  otherwise.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections.abc import Iterator

SOCKET_DIR = "/run/containerd/s"
DEFAULT_STATE_DIR = "/run/containerd"
TASK_DIR = "io.containerd.runtime.v2.task"
SANDBOX_ANNOTATION = "io.kubernetes.cri.sandbox-id"
INIT_PID = "init.pid"  # in the bundle; present while quark may hold state for the container
# the group of every container when one shim serves the node: "@" is in no containerd id, so no
# container's own group is ever this one
NODE_GROUP = "@node"
SCOPES = ("pod", "node")


def socket_address(containerd_address: str, namespace: str, group: str) -> str:
    digest = hashlib.sha256(os.path.join(containerd_address, namespace, group).encode()).hexdigest()
    return f"unix://{SOCKET_DIR}/{digest}"


@contextlib.contextmanager
def sockets_locked() -> Iterator[None]:
    """Held while a `start` looks for the node's shim and while that shim decides to exit, so a shim
    that answered a `start` never goes before containerd's create reaches it (an flock of SOCKET_DIR)."""
    os.makedirs(SOCKET_DIR, exist_ok=True)
    fd = os.open(SOCKET_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def quark_root(bundle: str, namespace: str) -> str:
    bundle = os.path.abspath(bundle)
    ns_dir = os.path.dirname(bundle)
    task_dir = os.path.dirname(ns_dir)
    if os.path.basename(task_dir) == TASK_DIR and os.path.basename(ns_dir) == namespace:
        return os.path.join(os.path.dirname(task_dir), "quark", namespace)
    return os.path.join(DEFAULT_STATE_DIR, "quark", namespace)


def scope(config_path: str | None = None) -> str:
    """Whom one shim serves: "pod" (default) or "node", from `shim: {scope: ...}` in quark's host
    configuration; a value it cannot take is refused, naming the field."""
    from qlib import hostconfig
    from qlib.errors import ConfigError
    path = config_path or hostconfig.path()
    section = hostconfig.section(path, "shim", ("scope",), "{scope: pod|node}")
    value = "pod" if section is None else section.get("scope", "pod")
    if value not in SCOPES:
        raise ConfigError(path, "shim.scope", f"{value!r}: expected one of {', '.join(SCOPES)}")
    return value


def node_group(code: str | None = None) -> str:
    """The node's shim's group, one per quark installed (its version and where its code lies, by
    default this one's): a `start` after an upgrade makes a node's shim of the new quark, and the old
    one goes once the pods it serves are gone."""
    from qlib.version import VERSION
    return f"{NODE_GROUP} {VERSION} {code or os.path.dirname(os.path.dirname(os.path.realpath(__file__)))}"


def group_of(bundle: str, container_id: str, shim_scope: str) -> str:
    """The group whose shim serves a container: the node's, else its pod's (see shim_group)."""
    return node_group() if shim_scope == "node" else shim_group(bundle, container_id)


def shim_group(bundle: str, container_id: str) -> str:
    """The pod sandbox a container belongs to (one shim per pod), else the container itself."""
    try:
        with open(os.path.join(bundle, "config.json"), encoding="utf-8") as f:
            annotations = json.load(f).get("annotations") or {}
    except (OSError, ValueError):
        return container_id
    return annotations.get(SANDBOX_ANNOTATION) or container_id
