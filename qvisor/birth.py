"""A supervisor's birth: what it is born with (SupervisorArgs) and the one way to start it (start).

`quark create` builds nothing itself: it starts the container's supervisor, which builds the
sandbox and reports back on a pipe. Where that supervisor comes from depends on where the create
runs, and this module is the only place that knows:
  - from a shell or a manager (the Python CLI): forked twice, so its parent exits at once and it
    learns who adopts it (a manager that reaps the init itself; see reaper.py's _choose_reaper);
  - a container of a pod whose sandbox's supervisor serves the pod (`supervisor: {scope: pod}`):
    no supervisor of its own; the worker builds it and hands it to that supervisor
    (qvisor/supervisor/pod.py);
  - in a sandbox factory's worker (qvisor/factory/): handed over to a seed the factory forked
    ahead (qvisor/factory/seeds.py), so it shares the factory's pages and none of the worker's;
    forked once from the worker when there is no seed (the factory declines every caller whose
    manager reaps the init, so the supervisor reaps its own).
Whichever way, the supervisor runs `supervise` with the same SupervisorArgs, and the create reads
its report from the pipe `start` returns.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import TYPE_CHECKING, Callable

from qvisor import cgroups, logfile
from qvisor.state import ContainerState, StateStore

if TYPE_CHECKING:   # the spec module is the create's: the other verbs would pay for it
    from qvisor.spec import Spec

log = logging.getLogger("quark")


@dataclasses.dataclass
class SupervisorArgs:
    """What a supervisor is born with, whether a fork of the create's process or a seed of the
    factory's that it is handed over to (pickled: _hand_over)."""
    store: StateStore
    state: ContainerState
    spec: Spec
    platform: str
    console_socket: str
    preserve_fds: int
    log_file: str                   # --log, else the state directory's supervisor.log
    log_format: str                 # --log-format, for --log
    cgroup: cgroups.Cgroup | None   # the one the create opened, taken on rather than opened again
    merge_pages: bool               # supervisor.memory_merge
    pod_scope: bool = False         # supervisor.scope is pod: a pod's supervisor serves its containers (pods.py)


def start(args: SupervisorArgs, *, in_factory: bool, before_fork: Callable[[], None] = lambda: None) -> int:
    """Start the supervisor of `args`' container; the read end of the pipe it reports on (one JSON
    line: {"ok", "pid"} or {"error", "kind"}; every write end closes when it exits). Returns once
    the supervisor is on its own: handed over, or forked (and, outside a factory, its launcher
    reaped). `before_fork` runs just before a fork (never before a hand-over)."""
    r, w = os.pipe2(os.O_CLOEXEC)
    try:
        if in_factory and _to_pod(w, args):
            return r
        if in_factory and _hand_over(w, args):
            return r
        before_fork()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(r)
                os.setsid()   # detach: a new session
                if in_factory:   # the factory's caller has no manager that reaps: we are its parent
                    supervise(w, 0, args)
                launcher = os.getpid()
                if os.fork() == 0:   # the supervisor is the grandchild
                    supervise(w, launcher, args)
            finally:
                os._exit(0)
        if not in_factory:
            os.waitpid(pid, 0)   # the launcher exits at once (in a factory worker the supervisor
                                 # is our child: it outlives us)
    except BaseException:
        os.close(r)
        raise
    finally:
        os.close(w)
    return r


def supervise(ready_fd: int, launcher: int, a: SupervisorArgs) -> None:
    """Be the supervisor: set up logging, build the container, serve it until it is gone. Never
    returns. `launcher`: the process that forked us and exits at once (0: our parent stays)."""
    if a.merge_pages:   # first: every page written from here on is offered (qvisor/page_merge.py)
        from qvisor import page_merge
        page_merge.offer()
    from qvisor.supervisor import Supervisor
    logfile.log_to(a.log_file or a.store.path(a.state.id, "supervisor.log"), a.log_format if a.log_file else "text")
    from qvisor import security
    security.log_report(a.state.annotations)
    a.state.supervisor_pid = os.getpid()
    from qvisor import pods
    Supervisor(a.store, a.state, a.spec, a.platform, a.console_socket, ready_fd, launcher, a.preserve_fds,
               caller_may_reap=launcher != 0, cgroup=a.cgroup,
               pod_scope=a.pod_scope and pods.is_sandbox(a.state.annotations)).main()


def _to_pod(ready_fd: int, args: SupervisorArgs) -> bool:
    """A container of a pod whose sandbox's supervisor takes the pod's containers: built here and
    handed to it (qvisor/supervisor/pod.py), which reports on `ready_fd`. Only in a factory's
    worker: its callers never reap the init, and the factory (a child subreaper) adopts it."""
    from qvisor import pods
    if not args.pod_scope or pods.sandbox_of(args.state.id, args.state.annotations) is None:
        return False
    from qvisor.supervisor import pod
    return pod.create_in_pod(args, ready_fd)


def _hand_over(ready_fd: int, args: SupervisorArgs) -> bool:
    """In a factory worker that was given a seed: hand it the create (qvisor/factory/seeds.py),
    and it becomes the supervisor (supervise_handed_over). False when there is no seed, or it
    cannot take the hand-over."""
    from qvisor import phases
    from qvisor.factory import seeds
    return seeds.hand_over("quark", {"args": args, "verb_started": phases.verb_started}, [ready_fd]) is not None


def supervise_handed_over(data: bytes, fds: list[int]) -> None:
    """In a seed of the factory's (quark's "become"): take on what the worker handed over, as a
    fork of that worker would have it, and supervise its container. Never returns."""
    from qvisor.factory import seeds
    ready_fd = fds[seeds.CONTEXT_FDS] if len(fds) == seeds.CONTEXT_FDS + 1 else -1
    try:
        from qvisor import phases
        if ready_fd < 0:
            raise ValueError(f"{len(fds)} fds handed over, not {seeds.CONTEXT_FDS + 1}")
        os.set_inheritable(ready_fd, False)   # as the pipe the worker made (O_CLOEXEC)
        payload = seeds.take_on(data, fds[:seeds.CONTEXT_FDS])
        phases.verb_started = payload["verb_started"]
        args = payload["args"]
    except BaseException as e:   # noqa: BLE001 — tell the waiting create; nothing was made yet
        if ready_fd >= 0:
            msg = {"error": f"the supervisor could not take on the create's context: {e}"}
            try:
                os.write(ready_fd, json.dumps(msg).encode() + b"\n")
            except OSError:
                pass
        os._exit(1)
    try:
        supervise(ready_fd, 0, args)
    finally:
        os._exit(0)
