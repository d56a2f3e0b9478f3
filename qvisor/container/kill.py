"""quark kill: a signal to the init, to every process of the container, or to an exec'd process."""
from __future__ import annotations

import os
import signal

from qlib import linux as L
from qlib.errors import InvalidArgument, InvalidState, NotFound, SupervisorGone
from qvisor import cgroups
from qvisor.client import Connection
from qvisor.container.common import state
from qvisor.state import CREATED, PAUSED, RUNNING, ContainerState, StateStore, init_alive


def parse_signal(text: str) -> int:
    t = text.upper()
    if t.isdigit():
        n = int(t)
        if 0 < n < signal.NSIG:
            return n
        raise InvalidArgument(f"invalid signal {text!r}")
    name = t if t.startswith("SIG") else "SIG" + t
    try:
        return int(signal.Signals[name])
    except KeyError:
        raise InvalidArgument(f"unknown signal {text!r}") from None


def kill(root: str, container_id: str, sig: int, all_processes: bool = False) -> None:
    st = state(root, container_id)
    if st.status not in (CREATED, RUNNING, PAUSED):
        raise InvalidState(f"container {container_id!r} is not running (status {st.status})")
    if st.status == PAUSED and StateStore(root).hibernation(container_id) is not None:
        # hibernated is asleep, not paused: the signal is sent, then the container woken to take
        # it (a frozen task does not even die of SIGKILL on cgroup v1); nothing is read back ahead
        from qvisor.container.snapshot import wake
        _signal(st, sig, all_processes)
        try:
            wake(root, container_id, prefetch=False)
        except (InvalidState, SupervisorGone):
            pass   # it woke or stopped meanwhile
        return
    _signal(st, sig, all_processes)


def _signal(st: ContainerState, sig: int, all_processes: bool) -> None:
    if all_processes:
        cgroups.open_cgroup(st.cgroup_path).kill_all(sig)
        return
    # a pidfd taken after the start-time check pins the process: the signal cannot hit a reused pid
    fd = L.pidfd_open(st.pid)
    try:
        if not init_alive(st):
            raise InvalidState(f"container {st.id!r} is not running")
        L.pidfd_send_signal(fd, sig)
    finally:
        os.close(fd)


def kill_exec(root: str, container_id: str, pid: int, sig: int) -> None:
    """Signal the exec'd process `pid`. The supervisor does it, through the pidfd it holds until it
    reaps the process: once reaped, the pid may be another process's, and nothing is signalled."""
    store = StateStore(root)
    store.load(container_id)   # an unknown id says so
    try:
        with Connection(store.dir(container_id)) as c:
            c.call({"op": "signal", "pid": pid, "signal": sig})
    except SupervisorGone:   # it exits once the container and every exec'd process have
        raise NotFound(f"process {pid} has exited: container {container_id!r} has no processes left") from None
