"""quark exec: a process started in a running container (a hibernated one is woken for it)."""
from __future__ import annotations

import os
import socket

from qlib import linux as L
from qlib.errors import InvalidArgument, InvalidState
from qvisor import channel
from qvisor.client import Connection
from qvisor.container.common import preserved_fds, state
from qvisor.state import PAUSED, RUNNING, StateStore


def exec_process(root: str, container_id: str, process: dict, fds: list[int],
                 preserve_fds: int = 0, wait_here: bool = False) -> tuple[int, list[int]]:
    """Start `process` in the container with stdio `fds` and the caller's fds 3..2+preserve_fds;
    returns its host pid and, with a terminal, the pty master. `wait_here`: the caller will wait
    for it (`wait`), so where the caller reaps it is this process's child, as runc's exec's is."""
    preserved = preserved_fds(preserve_fds)
    if len(fds) + len(preserved) > channel.MAX_FDS:
        raise InvalidArgument(f"--preserve-fds {preserve_fds}: exec passes at most {channel.MAX_FDS - len(fds)} fds")
    st = state(root, container_id)
    if st.status == PAUSED and StateStore(root).hibernation(container_id) is not None:
        from qvisor.container.snapshot import wake
        wake(root, container_id)   # a hibernated container wakes for an exec
        st = state(root, container_id)
    if st.status != RUNNING:
        raise InvalidState(f"cannot exec in container {container_id!r}: it is {st.status}")
    request = {"op": "exec", "process": process, "preserve_fds": len(preserved)}
    if st.caller_reaps:
        return _exec_forked_here(StateStore(root).dir(container_id), request, fds, preserved, wait_here)
    with Connection(StateStore(root).dir(container_id)) as c:
        reply, rfds = c.call(request, fds + preserved)
    return reply["pid"], rfds


def _exec_forked_here(state_dir: str, request: dict, stdio: list[int], preserved: list[int],
                      wait_here: bool) -> tuple[int, list[int]]:
    """An exec where the caller reaps the container's processes (conmon, containerd's runc shim):
    as with runc, the process is a descendant of this `quark exec`, so once it is orphaned it goes
    to the caller's subreaper, which waits for the pid it reads from --pid-file (podman gives each
    exec its own conmon: a process the supervisor forked would go to the container's). Stage 1 is
    forked here; the supervisor drives it as it drives its own (qvisor/supervisor/exec.py)."""
    from qvisor import sandbox
    if wait_here:   # stage 1's orphan comes to us, to be reaped by `wait`
        L.prctl(L.PR_SET_CHILD_SUBREAPER, 1)
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    child = channel.numbered_from(child, 3 + len(preserved))   # the preserved fds stay at 3..
    pid = os.fork()
    if pid == 0:
        parent.close()
        for i, fd in enumerate(stdio):
            os.dup2(fd, i, inheritable=True)
        sandbox.run_child(child, lambda: sandbox.exec_stage1_of_caller(child, preserved))
    child.close()
    pidfd = -1
    try:
        pidfd = L.pidfd_open(pid)
        with Connection(state_dir) as c:
            reply, rfds = c.call(dict(request, forked=True), [parent.fileno(), pidfd])
    finally:
        parent.close()   # (stage 1 waiting for the supervisor's first message ends at its EOF)
        if pidfd >= 0:
            os.close(pidfd)
        os.waitpid(pid, 0)   # stage 1 exits once it has reported the process's pid
    return reply["pid"], rfds
