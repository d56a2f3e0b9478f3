"""Which pod a container belongs to, and whether its pod's supervisor serves it (`supervisor:
{scope: pod|container}` in quark's host configuration).

A CRI runtime names a pod's sandbox in every container's annotations: the sandbox (pause)
container says it is one, the others name it. With the pod scope (the default), the sandbox
container's supervisor serves the pod's other containers too (qvisor/supervisor/pod.py), so a pod
costs one supervisor however many containers it has; a container outside a pod is a pod of one.
`container` gives each container a supervisor of its own.
"""
from __future__ import annotations

from qlib import hostconfig
from qlib.errors import ConfigError

# (containerd's CRI, CRI-O)
SANDBOX_ID = ("io.kubernetes.cri.sandbox-id", "io.kubernetes.cri-o.SandboxID")
CONTAINER_TYPE = ("io.kubernetes.cri.container-type", "io.kubernetes.cri-o.ContainerType")
SCOPES = ("pod", "container")
FIELD = "supervisor.scope"
POD_SOCK = "pod.sock"   # in the sandbox container's state directory, while its supervisor takes the pod's containers
SUPERVISOR_KEYS = ("memory_merge", "scope")   # the supervisor section's settings (qvisor/page_merge.py reads the other)
SUPERVISOR_SHAPE = "{memory_merge: true|false, scope: pod|container}"


def scope(config_path: str | None = None) -> str:
    """Whom one supervisor serves: "pod" (the default) or "container"; a value quark cannot take is
    refused, naming the field."""
    path = config_path or hostconfig.path()
    section = hostconfig.section(path, "supervisor", SUPERVISOR_KEYS, SUPERVISOR_SHAPE)
    value = "pod" if section is None else section.get("scope", "pod")
    if value not in SCOPES:
        raise ConfigError(path, FIELD, f"{value!r}: expected one of {', '.join(SCOPES)}")
    return value


def is_sandbox(annotations: dict[str, str]) -> bool:
    """The container is a pod's sandbox (its pause container)."""
    return any(annotations.get(key) == "sandbox" for key in CONTAINER_TYPE)


def sandbox_of(container_id: str, annotations: dict[str, str]) -> str | None:
    """The id of the sandbox container of the pod `container_id` is one of the other containers of;
    None for a sandbox itself or a container outside a pod."""
    if is_sandbox(annotations):
        return None
    for key in SANDBOX_ID:
        sandbox = annotations.get(key)
        if sandbox and sandbox != container_id:
            return sandbox
    return None
