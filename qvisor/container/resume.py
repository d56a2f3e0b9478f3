"""quark resume: a paused container's cgroup thawed, a hibernated one woken."""
from __future__ import annotations

from qlib.errors import InvalidState
from qvisor import cgroups
from qvisor.container.common import state
from qvisor.state import PAUSED, StateStore


def resume(root: str, container_id: str) -> None:
    st = state(root, container_id)
    if st.status != PAUSED:
        raise InvalidState(f"container {container_id!r} is not paused (status {st.status})")
    if StateStore(root).hibernation(container_id) is not None:
        from qvisor.container.snapshot import wake
        wake(root, container_id)   # the supervisor wakes it: its working set, its listeners
        return
    cgroups.open_cgroup(st.cgroup_path).thaw()
