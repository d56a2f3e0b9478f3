"""Waiting for the init or an exec'd process to exit (the shim's Wait, `quark run`, `exec`)."""
from __future__ import annotations

import os

from qlib import linux as L
from qlib import procfs
from qlib.errors import NotFound, QuarkError, SupervisorGone
from qvisor.client import Connection
from qvisor.state import StateStore


def wait(root: str, container_id: str, pid: int = 0) -> dict:
    """Block until the init (or the exec'd process `pid`) exits; its exit status and time."""
    ours = None
    if pid and procfs.parent_pid(pid) == os.getpid():   # ours to reap (exec_process with wait_here)
        ours = L.exit_code(os.waitpid(pid, 0)[1])
    store = StateStore(root)
    st = store.load(container_id)
    try:
        with Connection(store.dir(container_id)) as c:
            reply, _ = c.call({"op": "wait", "pid": pid or st.pid})
            # the status we reaped is the exact one: before Linux 6.15 the supervisor learns only
            # that the process ended (supervisor/reaper.py)
            return reply if ours is None else dict(reply, exit_status=ours)
    except SupervisorGone:
        pass
    st = store.load_raw(container_id)  # the supervisor is gone: the state file has the last word
    if pid and pid != st.pid:
        raise NotFound(f"process {pid} is not known: the container's supervisor has exited")
    if st.exit_status is None:
        raise QuarkError("the container's supervisor died before recording an exit status")
    return {"pid": st.pid, "exit_status": st.exit_status, "exited_at": st.exited_at}
