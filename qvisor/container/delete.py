"""quark delete: what is left of the container killed, its cgroup and state removed, poststop run."""
from __future__ import annotations

import os
import select
import signal
import time

from qlib import linux as L
from qlib import procfs
from qlib.errors import InvalidState, QuarkError
from qvisor import cgroups
from qvisor.container.common import saved_spec
from qvisor.state import CREATED, CREATING, PAUSED, RUNNING, SOCK_NAME, STOPPED, ContainerState, StateStore, init_alive


def delete(root: str, container_id: str, force: bool = False) -> None:
    store = StateStore(root)
    st = store.load(container_id)
    if st.status == CREATING and not force:
        raise InvalidState(f"container {container_id!r} is being created (use --force to remove a failed one)")
    if st.status in (RUNNING, PAUSED) and not force:
        raise InvalidState(f"cannot delete container {container_id!r} that is not stopped: {st.status}")
    cg = cgroups.open_cgroup(st.cgroup_path) if st.cgroup_path else None
    if st.status in (CREATED, RUNNING, PAUSED):
        if cg is not None:
            cg.kill_all(signal.SIGKILL)
        try:
            fd = L.pidfd_open(st.pid)
            if init_alive(st):
                L.pidfd_send_signal(fd, signal.SIGKILL)
            os.close(fd)
        except OSError:
            pass
        _wait_stopped(store, st)
    if cg is not None:
        cg.kill_all(signal.SIGKILL)
        cg.destroy()
    _run_poststop(store, st)
    store.remove(container_id)


def _wait_stopped(store: StateStore, st: ContainerState, timeout: float = 10.0) -> None:
    # woken by the init's and the supervisor's pidfds when either exits (a fixed sleep between
    # checks added its length to every delete: bench/README.md, "Start-up and supervisor memory");
    # the checks themselves decide, so a pidfd of a reused pid only wakes the loop early
    pidfds = []
    for pid in (st.pid, st.supervisor_pid):
        try:
            if pid:
                pidfds.append(L.pidfd_open(pid))
        except OSError:
            pass   # gone already
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            sup_alive = st.supervisor_pid and procfs.start_time(st.supervisor_pid) is not None \
                and os.path.exists(store.path(st.id, SOCK_NAME))
            if not init_alive(st) and not sup_alive:
                return
            ready, _, _ = select.select(pidfds, [], [], 0.01)
            for fd in ready:   # an exited process's pidfd stays readable: stop watching it
                pidfds.remove(fd)
                os.close(fd)
    finally:
        for fd in pidfds:
            os.close(fd)
    raise QuarkError(f"container {st.id!r} did not stop within {timeout:.0f}s")


def _run_poststop(store: StateStore, st: ContainerState) -> None:
    from qvisor import hooks
    spec = saved_spec(store, st, only_if_hook="poststop")
    if spec is None:
        return
    st.status = STOPPED
    hooks.run_hooks("poststop", spec.hooks.poststop, st.oci(), fatal=False)
