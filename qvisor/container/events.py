"""The cgroup statistics of `quark events --stats` and of the shim's Stats."""
from __future__ import annotations

from qlib.errors import InvalidState
from qvisor import cgroups
from qvisor.container.common import state
from qvisor.state import STOPPED


def running_cgroup(root: str, container_id: str) -> cgroups.Cgroup:
    """The cgroup of a container that has not stopped."""
    st = state(root, container_id)
    if st.status == STOPPED:
        raise InvalidState(f"container {container_id!r} is stopped")
    return cgroups.open_cgroup(st.cgroup_path)


def stats(root: str, container_id: str) -> dict:
    """The container's cgroup statistics in runc's `events --stats` data layout."""
    return running_cgroup(root, container_id).stats()
