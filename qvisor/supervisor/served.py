"""One container a supervisor serves: its parts, wired.

Each part owns its state and is given what it uses: the Container (context.py: the state, spec,
cgroup, loop, QKernel and init every part reads) and the other parts it calls.
"""
from __future__ import annotations

import os

from qvisor import logfile
from qvisor.state import SOCK_NAME, STOPPED
from qvisor.supervisor.context import Container
from qvisor.supervisor.control import Control
from qvisor.supervisor.create import Creation
from qvisor.supervisor.exec import Execs
from qvisor.supervisor.reaper import Reaper
from qvisor.supervisor.snapshot import Hibernation
from qvisor.supervisor.start import Starter


class Served:
    """One container's parts, wired."""

    def __init__(self, c: Container, console_socket: str = "", preserve_fds: int = 0, launcher_pid: int = 0,
                 caller_may_reap: bool = False) -> None:
        self.c = c
        self.hibernation = Hibernation(c)
        self.starter = Starter(c, started=self.hibernation.schedule_idle_check)
        self.execs = Execs(c)
        self.reaper = Reaper(c, self.execs, self.starter, self.hibernation, launcher_pid, caller_may_reap)
        self.execs.reaper = self.reaper   # an exec's exit is the reaper's; the reaper's table is theirs
        self.control = Control(c, {
            "start": self.starter.start, "wait": self.reaper.wait, "exec": self.execs.exec,
            "signal": self.execs.signal, "hibernate": self.hibernation.op_hibernate,
            "wake": self.hibernation.op_wake, "snapshot": self.hibernation.op_info, "tables": self.reaper.tables,
        }, on_drop=self.reaper.forget)
        self.creation = Creation(c, self.reaper, self.control, self.starter, console_socket, preserve_fds)

    def done(self) -> bool:
        return self.c.state.status == STOPPED and not self.execs.table and not self.reaper.killing

    def close(self) -> None:
        """Served to the end: its QKernel (and TSoR session) and control socket go."""
        if self.c.kernel is not None:
            self.c.kernel.close()   # and the sandbox's tsord session (TSoR) with it
            self.c.kernel = None
        self.control.close()
        logfile.unroute(self.c.state.id)
        try:
            os.unlink(self.c.store.path(self.c.state.id, SOCK_NAME))
        except OSError:
            pass
