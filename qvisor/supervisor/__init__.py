"""The per-sandbox supervisor: one process per container, started by `quark create` (qvisor/birth.py).

It forks the container's init (sandbox.py), puts it in its cgroup, runs the runtime-side hooks,
then owns the container for its whole life: it is the init's parent (a child subreaper), reaps it
and every exec'd process, records exit statuses in the state file, serves the control socket the
CLI talks to (start, exec, wait), and hosts QKernel, which services the seccomp listener.
Under a runc-driving manager that reaps the init itself (containerd's runc shim, conmon), the
manager is the parent instead and exit statuses come from pidfds (see reaper.py, _choose_reaper).
Everything runs on one single-threaded event loop (see eventloop.py for why).

The parts, each an object that owns its state and is handed the others it calls (core.py wires them):
  core.py      the Supervisor: the parts, and its life cycle (main: set up, create, serve until done)
  context.py   the Container every part reads: state, spec, cgroup, loop, QKernel, the init
  child.py     a process being forked (the init, an exec) and the channel the supervisor reads it on
  create.py    Creation: the init, its cgroup, id maps, procview, QKernel, the set-up messages, the
               report to `quark create`, and the clean-up of a failed create
  control.py   Control: the control socket server, its clients, each op to the part that owns it
  start.py     Starter: the start op
  exec.py      Execs: exec'd processes, their creation, their set-up messages, signals to them
  reaper.py    Reaper: who reaps (SIGCHLD and waitpid, or pidfds), exits and their bookkeeping
               (wait), the kill of what is left in the cgroup
  snapshot.py  Hibernation: hibernate and wake, on request, on a connection, when idle
"""
from qvisor.supervisor.core import Supervisor

__all__ = ["Supervisor"]
