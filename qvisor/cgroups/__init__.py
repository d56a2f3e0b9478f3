"""The cgroup manager the sandbox supervisor uses, for cgroup v1 and v2 behind one interface.

`open_cgroup(path)` picks the implementation for this host (`detect()`); the returned
`Cgroup` creates the container's cgroup, applies the OCI `linux.resources`, moves
processes in, freezes, reports usage, kills and removes it. Everything the two versions
share (moving pids, listing, killing, removing) lives here; v1.py and v2.py only know
their file names.
"""
from __future__ import annotations

import posixpath

from qlib import cgroupfs
from qlib.errors import SetupError
from qvisor.cgroups.base import CGROUP_ROOT, Cgroup, join, read, read_int, read_kv, start_move_grace_period

__all__ = ["CGROUP_ROOT", "Cgroup", "default_path", "detect", "join", "open_cgroup", "read", "read_int", "read_kv",
           "start_move_grace_period"]


def detect() -> str:
    """Return "v2" when /sys/fs/cgroup is a cgroup2 mount (unified), else "v1" (legacy/hybrid)."""
    try:
        return cgroupfs.version()
    except OSError as e:
        raise SetupError(f"cgroup: statfs {CGROUP_ROOT}: {e.strerror}") from None


def default_path(container_id: str) -> str:
    return f"/quark/{container_id}"


def open_cgroup(path: str, version: str | None = None) -> Cgroup:
    """The cgroup at cgroupsPath `path`; a relative path is placed under /quark/."""
    if ".." in path.split("/"):
        raise SetupError(f"cgroup: invalid cgroupsPath {path!r}: '..' is not allowed")
    path = posixpath.normpath(path if path.startswith("/") else "/quark/" + path)
    if path == "/":
        raise SetupError("cgroup: cgroupsPath may not be the root cgroup")
    version = version or detect()
    # imported here: a verb imports only its host's version (v2's device programs import the
    # spec model, which most verbs never need)
    if version == "v1":
        from qvisor.cgroups.v1 import V1Cgroup
        return V1Cgroup(path)
    if version == "v2":
        from qvisor.cgroups.v2 import V2Cgroup
        return V2Cgroup(path)
    raise ValueError(f"unknown cgroup version {version!r}")
