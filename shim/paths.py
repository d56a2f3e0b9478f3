"""Where a shim's socket lives and where quark keeps the state of containerd's containers.

- socket: /run/containerd/s/<sha256(containerd address, namespace, group)>, the same scheme as
  containerd's runc shim, so one pod's containers find their sandbox's shim.
- quark --root: <containerd state dir>/quark/<namespace> when the bundle sits in containerd's
  `io.containerd.runtime.v2.task/<namespace>/<id>` (so a private containerd keeps a private
  quark root, as runc's /run/containerd/runc/<namespace>); /run/containerd/quark/<namespace>
  otherwise.
"""
from __future__ import annotations

import hashlib
import json
import os

SOCKET_DIR = "/run/containerd/s"
DEFAULT_STATE_DIR = "/run/containerd"
TASK_DIR = "io.containerd.runtime.v2.task"
SANDBOX_ANNOTATION = "io.kubernetes.cri.sandbox-id"
INIT_PID = "init.pid"  # in the bundle; present while quark may hold state for the container


def socket_address(containerd_address: str, namespace: str, group: str) -> str:
    digest = hashlib.sha256(os.path.join(containerd_address, namespace, group).encode()).hexdigest()
    return f"unix://{SOCKET_DIR}/{digest}"


def quark_root(bundle: str, namespace: str) -> str:
    bundle = os.path.abspath(bundle)
    ns_dir = os.path.dirname(bundle)
    task_dir = os.path.dirname(ns_dir)
    if os.path.basename(task_dir) == TASK_DIR and os.path.basename(ns_dir) == namespace:
        return os.path.join(os.path.dirname(task_dir), "quark", namespace)
    return os.path.join(DEFAULT_STATE_DIR, "quark", namespace)


def shim_group(bundle: str, container_id: str) -> str:
    """The pod sandbox a container belongs to (one shim per pod), else the container itself."""
    try:
        with open(os.path.join(bundle, "config.json"), encoding="utf-8") as f:
            annotations = json.load(f).get("annotations") or {}
    except (OSError, ValueError):
        return container_id
    return annotations.get(SANDBOX_ANNOTATION) or container_id
