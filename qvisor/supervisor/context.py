"""What every part of the supervisor reads: the container it serves (Container).

The parts (create.py, start.py, control.py, exec.py, reaper.py, snapshot.py) each own their own
state; what they all need — the container's state and spec, its cgroup, the loop, QKernel once
started, the init — is here, one object each part is given."""
from __future__ import annotations

import dataclasses
from typing import Any

from qlib.eventloop import Loop
from qvisor import cgroups, phases
from qvisor.spec import Spec
from qvisor.state import ContainerState, StateStore
from qvisor.supervisor.child import Child


@dataclasses.dataclass
class Container:
    store: StateStore
    state: ContainerState
    spec: Spec
    platform: str
    cgroup: cgroups.Cgroup
    loop: Loop
    phases: phases.Phases           # QUARK_PHASES: when each step of create and start happened
    ready_fd: int = -1              # the pipe `quark create` waits on; -1 once it has its report
    kernel: Any = None              # QKernel, from the init's first message on
    init: Child | None = None       # stage 1, then the container's init

    @property
    def in_setup(self) -> bool:
        """`quark create` still waits: a failure fails the create and leaves nothing."""
        return self.ready_fd >= 0

    def hook_state(self) -> dict:
        return self.state.oci() | {"status": self.state.status, "pid": self.state.pid}

    def tsor(self):
        """The sandbox's TSoR registration (tsor/intercept.py), None without one."""
        return self.kernel.context.tsor if self.kernel is not None else None

    def socket_filter(self) -> dict[str, bool]:
        """What the container's filter traps of the socket family (the start message's fields):
        `sockets` only for a sandbox TSoR serves with the socketpair local path (a sandbox without
        TSoR, or with tsord's sockmap path, tsor/sockmap.py, pays nothing for sockets);
        `sockopt_offload` when the kernel answers TCP_NODELAY/TCP_CORK of its local-path sockets
        (tsor/sockopt_offload.py), so setsockopt of those is not trapped either; `sockmap` for a
        sandbox of the sockmap path, whose shutdown(SHUT_WR) waits for its FIN's acknowledgement."""
        tsor = self.tsor()
        sockets = tsor is not None and tsor.traps_sockets
        return {"sockets": sockets, "sockopt_offload": sockets and tsor.offload is not None,
                "sockmap": tsor is not None and not sockets}


class ContainerLoop:
    """The supervisor's loop as the parts of one container handed to a pod's supervisor see it
    (pod.py): every callback runs with that container's log (qvisor/logfile.py, route)."""

    def __init__(self, loop: Loop, container_id: str) -> None:
        self.loop, self.container_id = loop, container_id

    @property
    def lock(self):
        return self.loop.lock

    def _bound(self, callback):
        from qvisor import logfile
        cid = self.container_id
        return lambda *a: logfile.in_container(cid, callback, *a)

    def add_reader(self, fd: int, callback) -> None:
        self.loop.add_reader(fd, self._bound(callback))

    def add_writer(self, fd: int, callback) -> None:
        self.loop.add_writer(fd, self._bound(callback))

    def call_later(self, delay: float, callback) -> None:
        self.loop.call_later(delay, self._bound(callback))

    def has_reader(self, fd: int) -> bool:
        return self.loop.has_reader(fd)

    def remove_reader(self, fd: int) -> None:
        self.loop.remove_reader(fd)

    def remove_writer(self, fd: int) -> None:
        self.loop.remove_writer(fd)

    def run_once(self, max_wait: float | None = None) -> None:
        self.loop.run_once(max_wait)
