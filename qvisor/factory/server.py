"""The factory process: it holds the socket, decides whether it may run each request, and keeps a
spare worker, a supervisor seed and the seeds' zygote forked ahead (worker.py, seeds.py).
`python -m qvisor.factory` runs it; `--stop` stops the one serving a directory."""
from __future__ import annotations

import argparse
import array
import fcntl
import gc
import logging
import os
import select
import signal
import socket
import sys
import time
from pathlib import Path

from qlib import linux as L
from qlib import sched
from qlib.errors import QuarkError
from qvisor.factory import caller, client, programs, seeds, worker
from qvisor.factory.programs import PROGRAMS
from qvisor.factory.wire import (LOCK_NAME, MAX_REQUEST, PID_NAME, decline, decode_request, directory, idle_seconds,
                                 socket_path)

log = logging.getLogger("quark.factory")

_PACKAGES = ("qlib", "qvisor", "qkernel", "tsor")


class Factory:
    def __init__(self, where: str, idle_s: float) -> None:
        self.where, self.idle_s = where, idle_s
        self.listener: socket.socket | None = None
        self.lock_fd = -1
        self.me: tuple = ()
        self.watch = -1                # inotify on quark's code (watch_code)
        self.stale = False
        self.interpreter = os.path.realpath(sys.executable)   # (another version made current: moved())
        self.spare: socket.socket | None = None   # our end of the pre-forked worker's socket
        self.spare_pid = 0
        self.seed: socket.socket | None = None    # our end of the pre-forked supervisor's socket (fork_seed)
        self.zygote: socket.socket | None = None  # our end of the seeds' forking process's socket (seeds.zygote)
        self.seed_asked = False                   # the zygote is forking one
        self.wakeup: tuple[int, int] = (-1, -1)   # the signal wake-up pipe

    def serve(self) -> int:
        os.makedirs(self.where, mode=0o700, exist_ok=True)
        self.lock_fd = os.open(os.path.join(self.where, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return 0   # another factory serves this directory
        self.watch = watch_code()
        programs.load()
        # the factory serves every caller: it runs with the kernel's defaults, not the first
        # caller's (a `nice -n 19` or `taskset -c 0` create started it); workers take on theirs
        try:
            sched.NEUTRAL.apply()
        except OSError as e:
            log.warning("the factory keeps its starter's scheduling attributes: %s", e)
        path = socket_path(self.where)
        try:
            os.unlink(path)   # a dead factory's (we hold the lock: no live one owns it)
        except FileNotFoundError:
            pass
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)
        try:
            self.listener.bind(path)   # 0600 from birth: only root may connect (and SO_PEERCRED checks)
        finally:
            os.umask(old)
        self.listener.listen(64)
        with open(os.path.join(self.where, PID_NAME + ".tmp"), "w") as f:
            f.write(str(os.getpid()))
        os.rename(os.path.join(self.where, PID_NAME + ".tmp"), os.path.join(self.where, PID_NAME))
        self.me = caller.identity(os.getpid())
        stop_r, stop_w = self.wakeup = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(stop_w)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda *_: None)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        # the init of a pod's container that a worker built for the pod's supervisor comes to us when
        # its stage 1 exits (qvisor/supervisor/pod.py): reaped below, its status read from its pidfd
        L.prctl(L.PR_SET_CHILD_SUBREAPER, 1)
        gc.collect()
        gc.freeze()   # the imported objects stay out of the collector's passes: their pages stay shared
        log.info("serving %s (pid %d)", path, os.getpid())
        self.fork_spare()
        self.start_zygote()
        self.fork_seed()
        idle_until = time.monotonic() + self.idle_s
        try:
            while not self.stale:
                watched = [self.listener, stop_r] + ([self.zygote] if self.zygote is not None else [])
                wait = None if self.idle_s == float("inf") else max(0.0, idle_until - time.monotonic())
                ready, _, _ = select.select(watched, [], [], wait)
                if self.zygote is not None and self.zygote in ready:
                    ready.remove(self.zygote)
                    self.take_seed_from_zygote()
                if stop_r in ready:
                    sigs = os.read(stop_r, 64)
                    L.reap_exited()   # workers (spares included), and what we adopted
                    if set(sigs) - {signal.SIGCHLD}:
                        break   # SIGTERM, SIGINT or SIGHUP
                if self.listener in ready:
                    self.accept()
                    idle_until = time.monotonic() + self.idle_s
                elif not ready and time.monotonic() >= idle_until:
                    log.info("idle for %.0f s: exiting", self.idle_s)
                    break
        finally:
            self.close()
        self.reap_what_is_left(stop_r)
        return 0

    def reap_what_is_left(self, wakeup: int) -> None:
        """Stopped serving (socket and lock given up: another factory may start): stay, as the
        child subreaper that the processes we adopted have, until the last of them has exited. Those
        are the inits of containers handed to a pod's supervisor (qvisor/supervisor/pod.py), which
        reads their exit statuses from pidfds once we reap them, and the supervisors our zygote
        forked (theirs once it exits). Going sooner would hand them to whatever reaps above us,
        and on a host whose pid 1 does not reap, a container's exit status would never come.
        Another SIGTERM does not end this: their exits would be lost."""
        try:
            L.set_cmdline(["quark-factory (reaping)"], {})   # what `ps` shows: it serves nothing now
        except OSError:
            pass
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return   # none left
            if pid:
                continue
            select.select([wakeup], [], [])   # the next signal: SIGCHLD, most likely
            try:
                os.read(wakeup, 64)
            except BlockingIOError:
                pass

    def close(self) -> None:
        # the socket first, while the lock still says the name is ours
        for name in (socket_path(self.where), os.path.join(self.where, PID_NAME)):
            try:
                os.unlink(name)
            except OSError:
                pass
        if self.listener is not None:
            self.listener.close()
        for channel in (self.spare, self.seed, self.zygote):
            if channel is not None:
                channel.close()   # each reads EOF and exits
        os.close(self.lock_fd)

    def accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        fds: list[int] = []
        try:
            conn.settimeout(5)   # a client that connects and sends nothing must not block the factory
            data, fds, flags, _ = socket.recv_fds(conn, MAX_REQUEST, 4)
            pid, uid, _gid = array.array("i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            if not data and not fds:
                return   # a probe (ensure_running): it connected to see that we answer, and left
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or len(fds) != 4:
                return decline(conn, "malformed request")
            try:
                argv, env, umask, prog = decode_request(data)
            except ValueError as e:
                return decline(conn, str(e))
            reason = self.refusal(pid, uid, argv, env, prog)
            if reason:
                return decline(conn, reason)
            if not self.hand_to_spare(pid, data, conn, fds, self.seed_for(prog, argv)):
                if os.fork() == 0:
                    self.detach()
                    worker.work(conn, fds, argv, env, umask, pid, prog)   # never returns
        except (OSError, ValueError) as e:
            log.warning("request failed: %s", e)
        finally:
            for fd in fds:
                os.close(fd)
            conn.close()
        if not self.stale:
            self.fork_spare()   # the next request's worker, forked while nobody waits for it
            self.fork_seed()    # and the next create's supervisor, if this request took it

    def refusal(self, pid: int, uid: int, argv: list[str], env: dict[str, str], prog: str = "quark") -> str:
        """Why this request must run in the client instead ("" when the factory may run it)."""
        if uid != 0:
            return "the caller is not root"
        program = PROGRAMS.get(prog)
        if program is None:
            return f"not a program the factory runs: {prog!r}"
        if not program["serves"](argv):
            return "not a verb the factory serves"
        if any(a.startswith("--preserve-fds") for a in argv):
            return "--preserve-fds: the fds are the client's to hand on"
        if env.get("QUARK_INIT_REAPER") or env.get("QUARK_FACTORY") == "0":
            return "the caller chose how the init is reaped, or turned the factory off"
        if self.stale or code_changed(self.watch) or self.moved():
            self.stale = True
            return "quark's code changed since the factory started: it exits"
        try:
            # conmon and containerd's runc shim wait for the container's processes as their children,
            # which those a create here would fork could never be; the other verbs fork none
            if program["adopts_cgroups"](argv) and caller.runc_managers_above(pid):
                return "a runc-compatible manager above the caller reaps the container's init"
            return caller.context_refusal(pid, self.me)
        except (OSError, KeyError):
            return "the caller went away"

    def seed_for(self, prog: str, argv: list[str]) -> socket.socket | None:
        """The seed's channel when this request starts something long-lived that its program has
        a seed become (a quark create's supervisor, the shim's server)."""
        wants = PROGRAMS[prog].get("wants_seed")
        if wants is None or not wants(argv):
            return None
        if self.seed is None and self.seed_asked:   # creates back to back: the zygote is forking it
            self.take_seed_from_zygote(timeout=0.5)
        seed, self.seed = self.seed, None
        return seed

    def hand_to_spare(self, caller_pid: int, data: bytes, conn: socket.socket, fds: list[int],
                      seed: socket.socket | None = None) -> bool:
        spare, self.spare = self.spare, None
        try:
            if spare is None:
                return False
            worker.foreground(self.spare_pid)   # (it may still be rehearsing, at idle priority)
            socket.send_fds(spare, [caller_pid.to_bytes(4, "little") + data],
                            [conn.fileno(), *fds] + ([seed.fileno()] if seed is not None else []))
            return True
        except OSError:
            return False   # it died: fork one for this request (which forks its supervisor itself)
        finally:
            if spare is not None:
                spare.close()
            if seed is not None:
                seed.close()   # the worker has it now (or, if it could not take it, the seed exits)

    def fork_spare(self) -> None:
        """Fork a worker ahead of its request: the fork of a process this size (a few ms, and
        the copy-on-write faults of its first steps) is then off the path of the next request."""
        if self.spare is not None:
            return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            pid = os.fork()
        except OSError as e:
            log.warning("cannot fork a spare worker: %s", e)
            ours.close()
            theirs.close()
            return
        if pid == 0:
            ours.close()
            self.detach()
            worker.serve_spare(theirs)   # never returns
        theirs.close()
        self.spare, self.spare_pid = ours, pid

    def fork_seed(self) -> None:
        """Have the next create's supervisor forked ahead (seeds.py): by the zygote, or by the
        factory itself when there is none."""
        if self.seed is not None or self.seed_asked:
            return
        if self.zygote is not None:
            try:
                self.zygote.send(b"s")   # its answer comes to the loop (take_seed_from_zygote)
                self.seed_asked = True
                return
            except OSError:
                self.lost_zygote()
        self.seed = self.fork_detached("a supervisor seed",
                                       lambda sock: seeds.await_hand_over(sock, seeds.become_program))

    def start_zygote(self) -> None:
        """Fork the process that forks the seeds. Every page the factory writes after a fork is a
        page the child no longer shares with it, and the factory writes many of them serving each
        request (a waiting seed's private memory grows with every request; measured:
        bench/README.md, "Start-up and supervisor memory"); a supervisor, which lives as long as
        its container, kept a copy of them all. The zygote runs one small loop and writes little,
        so what its seeds share with it stays shared."""
        self.zygote = self.fork_detached("the seeds' zygote",
                                         lambda sock: seeds.zygote(sock, seeds.become_program))

    def fork_detached(self, what: str, run) -> socket.socket | None:
        """Fork a child that drops what is the factory's own (detach) and runs `run` with its end
        of a new channel, never to return; our end, or None when it could not be forked."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            pid = os.fork()
        except OSError as e:
            log.warning("cannot fork %s: %s", what, e)
            ours.close()
            theirs.close()
            return None
        if pid == 0:
            ours.close()
            self.detach()
            try:
                run(theirs)
            finally:
                os._exit(0)
        theirs.close()
        return ours

    def take_seed_from_zygote(self, timeout: float | None = None) -> None:
        self.zygote.settimeout(timeout)
        try:
            data, fds, _, _ = socket.recv_fds(self.zygote, 16, 1)
        except TimeoutError:
            return   # still forking: this create forks its own supervisor
        except OSError:
            data, fds = b"", []
        finally:
            self.zygote.settimeout(None)
        self.seed_asked = False
        if not data:
            return self.lost_zygote()
        if not fds:
            return   # it could not fork one: the next create forks its supervisor itself
        self.seed = socket.socket(fileno=fds[0])
        self.seed.set_inheritable(False)

    def lost_zygote(self) -> None:
        log.warning("the seeds' zygote is gone: seeds are forked from the factory")
        self.zygote.close()
        self.zygote = None
        self.seed_asked = False

    def moved(self) -> bool:
        """Does the path it was started by name another interpreter now? On a node, an upgrade
        makes another version's tree current and leaves this one's unchanged (deploy/versions.py),
        which no inotify watch of it would see."""
        return os.path.realpath(sys.executable) != self.interpreter

    def detach(self) -> None:
        """In a forked child: drop everything of the factory's own, so none of it goes on to a
        supervisor (its socket, lock, wake-up pipe, code watch, the next spare's channel)."""
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        if self.listener is not None:
            self.listener.close()
        for channel in (self.spare, self.seed, self.zygote):
            if channel is not None:
                channel.close()
        for fd in (self.lock_fd, self.watch, *self.wakeup):
            if fd >= 0:
                os.close(fd)


def package_dirs() -> list[str]:
    """The directories of quark's modules (and the compiled fast path): a change in any of them
    makes a running factory stale."""
    base = Path(__file__).resolve().parents[2]
    dirs = []
    for pkg in _PACKAGES:
        for d, subdirs, _files in os.walk(base / pkg):
            subdirs[:] = [x for x in subdirs if x != "__pycache__"]
            dirs.append(d)
    return dirs


def watch_code() -> int:
    """An inotify fd that has an event queued once any of quark's modules changes (written,
    touched, added, removed, renamed). Set up before the imports, so nothing changed in between
    goes unseen; checking it costs one read(2) per request."""
    fd = L.inotify_init()
    for d in package_dirs():
        L.inotify_add_watch(fd, d, L.IN_CHANGES)
    return fd


def code_changed(fd: int) -> bool:
    # __pycache__ appearing (the first import of a never-compiled package) is no change of code
    return any(name != "__pycache__" for name in L.inotify_names(fd))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qvisor.factory", description="quark's sandbox factory")
    p.add_argument("--dir", default=directory(), help="where its socket, lock and pid file live")
    p.add_argument("--idle", type=float, default=None,
                   help="exit after this many seconds without a request (0: never; default: $QUARK_FACTORY_IDLE, "
                        "else quark's host configuration, factory.idle_seconds, else 300)")
    p.add_argument("--stop", action="store_true", help="stop the factory serving --dir")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.stop:
        pid = client.stop(args.dir)
        print(f"stopped {pid}" if pid else "no factory was running")
        return 0
    try:
        idle = (args.idle if args.idle > 0 else float("inf")) if args.idle is not None else idle_seconds()
    except QuarkError as e:
        log.error("not started: %s", e)
        return 1
    return Factory(args.dir, idle).serve()
