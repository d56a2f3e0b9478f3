"""quark ps: the container's processes (its cgroup's)."""
from __future__ import annotations

from qvisor import cgroups
from qvisor.container.common import state
from qvisor.state import STOPPED


def pids(root: str, container_id: str) -> list[int]:
    st = state(root, container_id)
    if st.status == STOPPED:
        return []
    return sorted(cgroups.open_cgroup(st.cgroup_path).pids())
