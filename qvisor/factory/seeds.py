"""Supervisor seeds: processes forked ahead of a create that become its supervisor.

A process forked from the factory pays a private page for every page of the factory's it writes;
CPython writes to every object it touches (reference counts). A supervisor forked from the worker
that ran `quark create` inherited the pages that worker wrote (the rehearsal, argument parsing,
loading and checking the spec: pages it never touches again) and kept them for the container's
life (measured: bench/README.md, "Start-up and supervisor memory"). So a seed is forked ahead by
the zygote — a process that does nothing but fork seeds, and so writes little of what its seeds
share with it — and waits; the worker that runs the request hands it what its fork would have
given it (hand_over: the process context a fork keeps, the program's payload and fds) and it
becomes what the program makes of it (take_on, then the program's "become": quark's create makes
it the supervisor, qvisor/birth.py; the shim's `start` its server, shim/main.py). A request that
gets no seed forks as before.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import struct
import sys
from typing import Callable

log = logging.getLogger("quark.factory")

MAX_HAND_OVER = 1 << 20
CONTEXT_FDS = 4   # stdin, stdout, stderr and the working directory come first in a hand-over
# what a seed becomes once a worker hands it a request: (the hand-over's data, its fds) -> never returns
Become = Callable[[bytes, list[int]], None]

# in a worker handed a seed with its request: the channel to it (take_seed)
_seed_channel: socket.socket | None = None


def keep_seed(fd: int) -> None:
    """In a worker: the seed that came with this request (SCM_RIGHTS gave it without O_CLOEXEC)."""
    global _seed_channel
    os.set_inheritable(fd, False)
    _seed_channel = socket.socket(fileno=fd)


def take_seed() -> socket.socket | None:
    """In a factory worker: the channel to a pristine supervisor-to-be, if this request came with
    one (only once: a create forks one supervisor)."""
    global _seed_channel
    seed, _seed_channel = _seed_channel, None
    return seed


def zygote(sock: socket.socket, become: Become) -> None:
    """Fork a seed for each byte the factory sends, and send it back our end of the seed's
    socket; exit on EOF. Its children (the seeds, then the supervisors they become) are reaped by
    the kernel (SIGCHLD ignored here, and set back to the default in each of them)."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    fill_free_blocks()
    while True:
        try:
            if not sock.recv(16):
                os._exit(0)
        except OSError:
            os._exit(0)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            pid = os.fork()
        except OSError:
            pid = -1
        if pid == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            sock.close()
            ours.close()
            await_hand_over(theirs, become)   # never returns
        theirs.close()
        try:
            socket.send_fds(sock, [b"s"], [ours.fileno()] if pid > 0 else [])
        except OSError:
            os._exit(0)
        finally:
            ours.close()


def await_hand_over(sock: socket.socket, become: Become) -> None:
    """The seed: wait for a worker's hand-over, tell it our pid, and become what it asks; exit on
    EOF (the factory is gone, or the worker that had us used us for nothing)."""
    try:
        data, fds, flags, _ = socket.recv_fds(sock, MAX_HAND_OVER, 8)
        if data and not flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            sock.send(struct.pack("=i", os.getpid()))
    except OSError:
        os._exit(0)
    sock.close()
    if not data or flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        os._exit(0)
    become(data, fds)   # never returns


def become_program(data: bytes, fds: list[int]) -> None:
    """A seed's Become: the program named ahead of the payload (hand_over) makes it what it is."""
    from qvisor.factory.programs import PROGRAMS
    name, _, payload = data.partition(b"\0")
    program = PROGRAMS.get(name.decode(errors="replace"))
    if program is None or "become" not in program:
        os._exit(1)
    program["become"](payload, fds)   # never returns


def hand_over(program: str, payload: object, fds: list[int]) -> int | None:
    """In a factory worker that was given a seed: hand it what a fork of this worker would give a
    child (stdio, cwd, environment, umask, rlimits, oom score, scheduling attributes, cgroups,
    command line, log level), `payload` (pickled) and `fds` (after the context's: take_on), for
    `program`'s "become". The seed's pid; None when there is no seed or it cannot take the
    hand-over (the caller then forks)."""
    import pickle
    import resource

    from qlib import sched
    from qvisor.factory import caller
    seed = take_seed()
    if seed is None:
        return None
    cwd = -1
    try:
        with open("/proc/self/cgroup") as f:
            cgroup = f.read()
        with open("/proc/self/oom_score_adj") as f:
            oom = f.read().strip()
        with open("/proc/self/cmdline", "rb") as f:
            cmdline = [os.fsdecode(a) for a in f.read().split(b"\0")[:-1]]
        context = {"payload": payload, "umask": caller.current_umask(), "env": dict(os.environ), "cmdline": cmdline,
                   "rlimits": {r: resource.getrlimit(r) for r in caller.RLIMITS}, "oom_score_adj": oom,
                   "cgroup": cgroup, "log_level": logging.getLogger().level, "sched": sched.Scheduling.of(os.getpid())}
        cwd = os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        data = program.encode() + b"\0" + pickle.dumps(context, pickle.HIGHEST_PROTOCOL)
        socket.send_fds(seed, [data], [0, 1, 2, cwd, *fds])
        # no timeout: a seed answers right after it has the message, or its end closes (it died
        # before it took anything on, and the caller forks instead): never both
        reply = seed.recv(4)
        if len(reply) != 4:
            raise OSError("the seed exited before it took the hand-over")
        return struct.unpack("=i", reply)[0]
    except OSError as e:   # it died, or the message is too big for its socket
        log.debug("seed not used: %s", e)
        return None
    finally:
        if cwd >= 0:
            os.close(cwd)
        seed.close()


def take_on(data: bytes, fds: list[int]) -> object:
    """In a seed: take on the context hand_over sent (`fds`: its first CONTEXT_FDS), as a fork of
    that worker would have it, in a session of its own; the payload. Raises what went wrong: the
    program tells its waiting caller."""
    import pickle
    import resource

    from qvisor import cgroups, logfile
    from qlib import linux as L
    if len(fds) < CONTEXT_FDS:
        raise ValueError(f"{len(fds)} fds handed over, fewer than {CONTEXT_FDS}")
    context = pickle.loads(data)
    for i in range(3):
        os.dup2(fds[i], i)   # inheritable: what a fork would have had (the container's stdio, for stage 1)
    os.fchdir(fds[3])
    for fd in fds[:CONTEXT_FDS]:
        os.close(fd)
    os.umask(context["umask"])
    _set_environ(context["env"])
    for r, limits in context["rlimits"].items():
        resource.setrlimit(r, limits)
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write(context["oom_score_adj"])
    context["sched"].apply()   # the worker's, which it took on from its caller
    cgroups.join(context["cgroup"])
    try:
        L.set_cmdline(context["cmdline"], context["env"])
    except OSError:   # cosmetic (ps), as in the worker
        pass
    os.setsid()   # detach: a new session
    logfile.root_level(context["log_level"])
    return context["payload"]


def _set_environ(env: dict[str, str]) -> None:
    """Make os.environ `env`, changing only what differs: the caller's environment is mostly the
    factory's own, and clearing and refilling it wrote new objects and touched the shared ones, a
    seed's private pages for the supervisor's life (bench/README.md, "Start-up and supervisor
    memory")."""
    for key in [k for k in os.environ if k not in env]:
        del os.environ[key]
    for key, value in env.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


_fillers: list = []   # the zygote's: objects that fill the free blocks of the allocator's pools


def fill_free_blocks() -> None:
    """Fill every free block of pymalloc's partly used pools with an object kept for good, so that
    what a seed allocates goes to fresh pools instead. Each free block sits on a page the seed
    shares with us; an object a supervisor allocates there costs it that whole 4 KiB page, and
    the few thousand objects it keeps were spread over as many pages. In fresh pools they lie
    side by side, and a supervisor keeps fewer private pages (measured: bench/README.md, "Start-up
    and supervisor memory")."""
    for size, free in free_blocks().items():
        if size == 32:
            _fillers.extend(1_000_000_000 + i for i in range(free))   # a one-digit int: 28 bytes
        elif size >= 48:
            _fillers.extend(bytes(size - 33) for _ in range(free))   # bytes(n): a block of n + 33
        # (16: no object of CPython's is that small; a few such blocks stay free)


def free_blocks() -> dict[int, int]:
    """Free blocks in used pools per block size, from sys._debugmallocstats (which prints to fd 2:
    nothing of it is shown). Empty when the interpreter does not report them (PYTHONMALLOC=malloc)."""
    import tempfile   # only the zygote, once: not worth every create's import of this module
    with tempfile.TemporaryFile() as out:
        saved = os.dup(2)
        try:
            os.dup2(out.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        out.seek(0)
        text = out.read().decode(errors="replace")
    free = {}
    for line in text.splitlines():   # "class size pools in-use free", after its header
        fields = line.split()
        if len(fields) == 5 and all(f.isdigit() for f in fields):
            free[int(fields[1])] = int(fields[4])
    return free
