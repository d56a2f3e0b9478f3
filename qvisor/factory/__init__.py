"""The sandbox factory: a pre-imported quark that forks supervisors and runs the hot verbs.

Every `quark` call used to be a new CPython process that paid the interpreter's start and then
its imports before any work, each longer than runc's whole `start`, and every supervisor paid the
imports again (measured: bench/README.md, "Start-up and supervisor memory"). The factory
imports everything once, freezes its objects out of the garbage collector's reach (so forked
children keep sharing those pages), and listens on a unix socket. A client (the C front end,
qvisor/frontend.c, the Python CLI, or the shim) sends one request: the argv of a `quark` call, its
environment and umask, and its stdin, stdout, stderr and working directory as fds. The factory
checks that the caller may do what it asks and is in the same place, forks a worker that becomes
that caller's `quark` process (its stdio, cwd, environment, umask, rlimits, oom_score_adj, nice,
scheduling policy, I/O priority and CPUs, for create its cgroups, and a cmdline naming the call),
and the worker runs the verb exactly as the CLI does and sends back the exit status. The factory
itself runs with the kernel's default scheduling attributes, whatever its first caller had. A
create's supervisor is forked from the worker as it is from the CLI, so it is its own process,
session and confinement; it only shares, copy-on-write, the factory's pages of imported code.

The factory is optional. It answers "fall back" (and the client runs the verb itself, as before)
when the verb is not one it serves, when the caller is not root or not in the factory's
namespaces, root, credentials, capabilities, seccomp and LSM context, when the caller's
rlimits exceed the factory's, when the caller's parent chain holds a runc-compatible manager
that reaps the container's init itself (the supervisor must then be re-parented to it, see
Supervisor._choose_reaper), and when quark's code on disk changed since the factory imported it
(then it also exits; the next create starts a fresh one). It is started by the first create and
exits after QUARK_FACTORY_IDLE seconds without a request (default 300). "Exits" means it stops
serving: socket and lock go at once, and the process stays, as the child subreaper of what it
adopted (a pod's handed-over inits, the supervisors of its zygote), until those have exited. QUARK_FACTORY=0 turns it
off; QUARK_FACTORY_DIR moves its socket, lock and pid file (default /run/quark).

The parts: wire.py (the one message each way, and where the factory's files live), client.py (the
clients' side: request, start, stop), server.py (the factory process: accepting, refusing, keeping
a spare worker and a seed ahead), caller.py (what the factory checks of its caller, and what a
worker takes on from it), worker.py (running one request), seeds.py (supervisors forked ahead of
their create, and the zygote that forks them), programs.py (the programs it runs, found as entry
points) and verbs.py (quark's own program: its served verbs and what they load ahead).
"""
