"""The Supervisor: the containers it serves (served.py: each as its parts, wired) and its life cycle.

A supervisor serves the container it was born for and, as a pod's supervisor
(pod.py), the containers of that pod handed to it later, all on one loop. main runs that loop from
the first create until every container served is stopped and nothing is left to serve.
"""
from __future__ import annotations

import logging
import os
from typing import NoReturn

from qlib import linux as L
from qlib.eventloop import Loop
from qvisor import cgroups, logfile, phases
from qvisor.spec import Spec
from qvisor.state import ContainerState, StateStore
from qvisor.supervisor.context import Container
from qvisor.supervisor.reaper import WAIT_ALL
from qvisor.supervisor.served import Served

log = logging.getLogger("quark.supervisor")


class Supervisor:
    def __init__(self, store: StateStore, state: ContainerState, spec: Spec, platform: str,
                 console_socket: str, ready_fd: int, launcher_pid: int = 0, preserve_fds: int = 0,
                 caller_may_reap: bool = True, cgroup: cgroups.Cgroup | None = None, pod_scope: bool = False) -> None:
        self.loop = Loop()
        c = Container(
            store, state, spec, platform,
            # the one `quark create` opened for state.cgroup_path, when it hands it on
            cgroup if cgroup is not None else cgroups.open_cgroup(state.cgroup_path),
            self.loop, phases.Phases(state.id), ready_fd)
        c.phases.mark("verb", phases.verb_started)
        self.first = Served(c, console_socket, preserve_fds, launcher_pid, caller_may_reap)
        self.served: dict[str, Served] = {state.id: self.first}
        self.pod_scope = pod_scope   # a pod's sandbox container: take the pod's other containers (pod.py)
        self.pod = None              # pod.py's Pod once it takes them

    def main(self) -> NoReturn:
        c = self.first.c
        c.phases.mark("supervisor")
        try:
            self.first.reaper.setup_process(self._reap)
            if self.pod_scope and not self.first.reaper.caller_reaps:
                from qvisor.supervisor import pod
                self.pod = pod.Pod(self)
            self.first.creation.create()
            while c.in_setup:
                c.loop.run_once()
        except Exception as e:  # tell `quark create`, and never leave half a sandbox behind
            log.exception("create failed")
            if self.pod is not None:
                self.pod.close()
            self.first.creation.abort(e)
            os._exit(1)
        if self.pod is not None:
            self.pod.open()
        while self.served:
            try:
                self.loop.run_once()
            except Exception:  # one bad request or hook must not orphan a running container
                log.exception("supervisor loop")
            for container_id, served in list(self.served.items()):
                if served.done():
                    served.close()
                    del self.served[container_id]
        if self.pod is not None:
            self.pod.close()
        os._exit(0)

    def serve(self, served: Served) -> None:
        """A container handed over (pod.py) is served from now on."""
        self.served[served.c.state.id] = served

    def _reap(self) -> None:
        """SIGCHLD: each exit to the container whose process it was."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG | WAIT_ALL)
            except ChildProcessError:
                return
            if pid == 0:
                return
            served = list(self.served.values())
            if any(s.c.kernel is not None and s.c.kernel.on_child_status(pid, status) for s in served):
                continue
            if os.WIFSTOPPED(status):
                continue
            code = L.exit_code(status)
            owner = next((s for s in served if s.reaper.knows(pid)), None)
            if owner is None:   # an exec'd process whose "pid" message is still queued?
                for s in served:
                    s.reaper.drain_pending()
                owner = next((s for s in served if s.reaper.knows(pid)), None)
            if owner is self.first:
                owner.reaper.exited(pid, code)
            elif owner is not None:   # a container handed over: its records go to its own log
                logfile.in_container(owner.c.state.id, owner.reaper.exited, pid, code)
