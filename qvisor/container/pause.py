"""quark pause: the container's cgroup frozen."""
from __future__ import annotations

from qlib.errors import InvalidState
from qvisor import cgroups
from qvisor.container.common import state
from qvisor.state import RUNNING


def pause(root: str, container_id: str) -> None:
    st = state(root, container_id)
    if st.status != RUNNING:
        raise InvalidState(f"container {container_id!r} is not running (status {st.status})")
    cgroups.open_cgroup(st.cgroup_path).freeze()
