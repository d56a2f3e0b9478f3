"""The Supervisor: its parts, wired, and its life cycle.

Each part owns its state and is given what it uses: the Container (context.py: the state, spec,
cgroup, loop, QKernel and init every part reads) and the other parts it calls. main runs the
event loop from create until the container is stopped and nothing is left to serve.
"""
from __future__ import annotations

import logging
import os
from typing import NoReturn

from qlib.eventloop import Loop
from qvisor import cgroups, phases
from qvisor.spec import Spec
from qvisor.state import SOCK_NAME, STOPPED, ContainerState, StateStore
from qvisor.supervisor.context import Container
from qvisor.supervisor.control import Control
from qvisor.supervisor.create import Creation
from qvisor.supervisor.exec import Execs
from qvisor.supervisor.reaper import Reaper
from qvisor.supervisor.snapshot import Hibernation
from qvisor.supervisor.start import Starter

log = logging.getLogger("quark.supervisor")


class Supervisor:
    def __init__(self, store: StateStore, state: ContainerState, spec: Spec, platform: str,
                 console_socket: str, ready_fd: int, launcher_pid: int = 0, preserve_fds: int = 0,
                 caller_may_reap: bool = True, cgroup: cgroups.Cgroup | None = None) -> None:
        c = self.c = Container(
            store, state, spec, platform,
            # the one `quark create` opened for state.cgroup_path, when it hands it on
            cgroup if cgroup is not None else cgroups.open_cgroup(state.cgroup_path),
            Loop(), phases.Phases(state.id), ready_fd)
        c.phases.mark("verb", phases.verb_started)
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

    def main(self) -> NoReturn:
        c = self.c
        c.phases.mark("supervisor")
        try:
            self.reaper.setup_process()
            self.creation.create()
            while c.in_setup:
                c.loop.run_once()
        except Exception as e:  # tell `quark create`, and never leave half a sandbox behind
            log.exception("create failed")
            self.creation.abort(e)
            os._exit(1)
        while not self._done():
            try:
                c.loop.run_once()
            except Exception:  # one bad request or hook must not orphan a running container
                log.exception("supervisor loop")
        if c.kernel is not None:
            c.kernel.close()   # and the sandbox's tsord session (TSoR) with it
        try:
            os.unlink(c.store.path(c.state.id, SOCK_NAME))
        except OSError:
            pass
        os._exit(0)

    def _done(self) -> bool:
        return self.c.state.status == STOPPED and not self.execs.table and not self.reaper.killing
