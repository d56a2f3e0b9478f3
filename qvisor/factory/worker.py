"""A factory worker: a fork of the factory that becomes one caller's `quark` process, runs the verb
as the CLI would, and answers its exit status. Spares are forked ahead of their request and
rehearse a verb while they wait, so a request pays neither the fork nor most of the
copy-on-write faults its first steps would take."""
from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import traceback

from qlib import linux as L
from qvisor.factory import caller, seeds
from qvisor.factory.programs import PROGRAMS
from qvisor.factory.wire import MAX_REQUEST, decline, decode_request, done, worker_pid

log = logging.getLogger("quark.factory")


def serve_spare(sock: socket.socket) -> None:
    """A spare worker (already detached from the factory): rehearse, wait for the request the
    factory hands on (the caller's pid, its request, the client's connection, its fds and, for a
    create, a seed), and run it. Never returns."""
    background()   # until a request comes: the rehearsal never competes with one
    rehearse()
    try:
        data, fds, _flags, _ = socket.recv_fds(sock, MAX_REQUEST + 4, 6)
    except OSError:
        os._exit(0)
    if len(fds) not in (5, 6) or len(data) < 4:
        os._exit(0)   # the factory exited, or was done with us
    sock.close()
    if len(fds) == 6:   # a seed to hand over to (seeds.py: a create's supervisor, the shim's server)
        seeds.keep_seed(fds.pop())
    try:
        argv, env, umask, prog = decode_request(data[4:])
    except ValueError:
        os._exit(1)   # cannot be: the factory decoded it before handing it on
    work(socket.socket(fileno=fds[0]), fds[1:], argv, env, umask, int.from_bytes(data[:4], "little"), prog)


def work(conn: socket.socket, fds: list[int], argv: list[str], env: dict[str, str],
         umask: int, caller_pid: int, prog: str = "quark") -> None:
    """Become the caller's `quark` process and run the verb. Never returns."""
    code = 1
    # what the verb forks (a create's supervisor, the shim's server) must not hold the
    # client's connection: its child closes its copy at once (a no-op further down, where the
    # object already says closed)
    os.register_at_fork(after_in_child=conn.close)
    try:
        conn.settimeout(None)
        signal.signal(signal.SIGINT, signal.default_int_handler)   # as in a fresh Python process
        program = PROGRAMS[prog]
        try:
            caller.adopt(caller_pid, fds, env, umask, [prog, *argv], program["adopts_cgroups"](argv))
        except OSError as e:
            decline(conn, f"cannot take on the caller's context: {e}")
            os._exit(0)
        if program.get("forwards_signals", _never)(argv):
            worker_pid(conn, os.getpid())   # the client's signals come here from now on
        try:
            code = program["main"](argv)
        except SystemExit as e:   # argparse's usage errors, --help, --version
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except KeyboardInterrupt:   # a SIGINT the client forwarded before the verb took it over
            code = 128 + signal.SIGINT
        except BaseException:
            traceback.print_exc()
            code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        _forget_the_caller()
        done(conn, code)
        # the exit of a process this size (its page tables: a few ms) runs when a CPU has
        # nothing else to do, not beside the caller's next step (a create's supervisor, or start)
        background()
        os._exit(code & 0xFF)


def _never(argv: list[str]) -> bool:
    return False


def background() -> None:
    """Run at SCHED_IDLE: only when no other task wants the CPU. For the factory's own work off a
    request's path (a spare's rehearsal, a worker's exit), which on a machine of two CPUs otherwise
    ran beside the create or start that followed it."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except OSError:
        pass


def foreground(pid: int) -> None:
    """Back to the default policy (a spare handed a request, which then takes on its caller's)."""
    try:
        os.sched_setscheduler(pid, os.SCHED_OTHER, os.sched_param(0))
    except OSError:   # (gone: the hand-off fails and the request gets a fork of its own)
        pass


def rehearse() -> None:
    """In a spare worker, while no request waits: run `quark state` of a container under a root
    that does not exist (it fails at once, writes nothing; its output goes to /dev/null). A forked
    process pays a copy-on-write fault for each page it first writes, and running Python writes
    to every object it touches (reference counts): a verb takes hundreds of such faults. The
    rehearsal takes more than half of them before the request comes (how many, and what it saves
    `quark state`: bench/README.md, "Start-up and supervisor memory")."""
    null = os.open(os.devnull, os.O_RDWR)
    saved = [os.dup(fd) for fd in (0, 1, 2)]
    try:
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        PROGRAMS["quark"]["main"](["--root", "/nonexistent/quark-factory-rehearsal", "state", "rehearsal"])
    except BaseException:   # noqa: BLE001 — a rehearsal's outcome is no one's concern
        pass
    finally:
        for fd, old in zip((0, 1, 2), saved):
            os.dup2(old, fd)
            os.close(old)
        os.close(null)


def _forget_the_caller() -> None:
    """The verb is done; before the caller hears so, drop what this process holds of it: its stdio
    (a pipe reader sees end of file now), its cwd (a bundle the caller is in) and its command line
    (`ps` and /proc/PID/cmdline name the bundle). The exit that follows takes a few ms for a process
    this size (its page tables); the caller does not wait for it."""
    for fd in (0, 1, 2):
        try:
            os.close(fd)
        except OSError:
            pass
    try:
        os.chdir("/")
        L.set_cmdline(["quark-factory-worker"], {})
    except OSError:
        pass
