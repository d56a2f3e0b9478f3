"""The Supervisor class: the state its parts share, and its life cycle.

The parts are mixins (child.py, create.py, control.py, exec.py, reaper.py); this class composes
them, holds everything they read and write, and runs the event loop from create until the
container is stopped and nothing is left to serve (main).
"""
from __future__ import annotations

import logging
import os
import socket
from typing import Any, NoReturn

from qlib.eventloop import Loop
from qvisor import cgroups, channel, phases
from qvisor.spec import Spec
from qvisor.state import SOCK_NAME, STOPPED, ContainerState, StateStore
from qvisor.supervisor.child import Child, ChildMixin
from qvisor.supervisor.control import ControlMixin
from qvisor.supervisor.create import CreateMixin
from qvisor.supervisor.exec import ExecMixin
from qvisor.supervisor.reaper import ReaperMixin
from qvisor.supervisor.snapshot import IDLE_ANNOTATION, SnapshotMixin, parse_duration

log = logging.getLogger("quark.supervisor")


class Supervisor(CreateMixin, ControlMixin, ExecMixin, ReaperMixin, SnapshotMixin, ChildMixin):
    def __init__(self, store: StateStore, state: ContainerState, spec: Spec, platform: str,
                 console_socket: str, ready_fd: int, launcher_pid: int = 0, preserve_fds: int = 0,
                 caller_may_reap: bool = True, cgroup: cgroups.Cgroup | None = None) -> None:
        self.store, self.state, self.spec = store, state, spec
        self.preserve_fds = preserve_fds       # the caller's fds 3.. that go to the init (--preserve-fds)
        self.platform, self.console_socket, self.ready_fd = platform, console_socket, ready_fd
        self.loop = Loop()
        # the one `quark create` opened for state.cgroup_path, when it hands it on
        self.cgroup = cgroup if cgroup is not None else cgroups.open_cgroup(state.cgroup_path)
        self.kernel: Any = None
        self.procview_mnt: int | None = None   # the /proc view made for the init (-1: could not be)
        self.init: Child | None = None
        self.pending_start: socket.socket | None = None
        self.waiters: dict[int, list[socket.socket]] = {}
        self.exits: dict[int, tuple[int, str]] = {}   # exec pid -> exit no wait has collected yet
        self.execs: dict[int, Child] = {}
        self.control: socket.socket | None = None
        self.clients: dict[int, tuple[socket.socket, channel.LineReader]] = {}
        self.launcher_pid = launcher_pid       # the process that forked us and exits at once
        self.caller_may_reap = caller_may_reap  # False: we reap, whoever adopts us (a factory's create)
        self.caller_reaps = False              # see _choose_reaper
        self.exit_statuses = True              # caller reaps: statuses come from pidfds (6.15+)
        self.killing = False                   # the cgroup's processes are being killed (_kill_rest)
        self.phases = phases.Phases(state.id)  # QUARK_PHASES: when each step of create and start happened
        self.phases.mark("verb", phases.verb_started)
        self._init_snapshot()
        if spec.annotations.get(IDLE_ANNOTATION):   # checked by validate at create: it parses
            self.idle_after = parse_duration(spec.annotations[IDLE_ANNOTATION])

    # ---- life cycle -------------------------------------------------------------------------

    def main(self) -> NoReturn:
        self.phases.mark("supervisor")
        try:
            self._setup_process()
            self._create()
            while self.ready_fd >= 0:
                self.loop.run_once()
        except Exception as e:  # tell `quark create`, and never leave half a sandbox behind
            log.exception("create failed")
            self._abort(e)
            os._exit(1)
        while not self._done():
            try:
                self.loop.run_once()
            except Exception:  # one bad request or hook must not orphan a running container
                log.exception("supervisor loop")
        if self.kernel is not None:
            self.kernel.close()   # and the sandbox's tsord session (TSoR) with it
        try:
            os.unlink(self.store.path(self.state.id, SOCK_NAME))
        except OSError:
            pass
        os._exit(0)

    def _done(self) -> bool:
        return self.state.status == STOPPED and not self.execs and not self.killing
