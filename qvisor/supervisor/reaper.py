"""Reaping and exits: who reaps the container's processes (the
supervisor as a child subreaper on SIGCHLD, or a runc-driving manager, then statuses come from
pidfds), what an exit does (the init's stops the container and kills what is left in its cgroup,
an exec's finishes it), and the bookkeeping of exits for the waits to come.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import time
from collections.abc import Callable

from qlib import linux as L
from qlib import procfs
from qlib.errors import NotFound, QuarkError
from qvisor.state import STOPPED, now_rfc3339
from qvisor.supervisor import child as children
from qvisor.supervisor.context import Container
from qvisor.supervisor.control import fail, reply
from qvisor.supervisor.exec import Execs
from qvisor.supervisor.snapshot import Hibernation
from qvisor.supervisor.start import Starter

log = logging.getLogger("quark.supervisor")
WAIT_ALL = 0x40000000  # __WALL: also wait for tasks the ptrace platform traces
REAP_WAIT_S = 10
UNKNOWN_EXIT = 255   # the exit status of a process reaped by the caller on a kernel without PIDFD_GET_INFO
# exits of exec'd processes kept for a wait that has not come yet (`quark exec -d` whose caller
# never waits): bounded, so such execs cannot grow the table for the container's whole life
MAX_KEPT_EXITS = 1024


class Reaper:
    """Reaping, exits and their bookkeeping."""

    def __init__(self, c: Container, execs: Execs, starter: Starter, hibernation: Hibernation,
                 launcher_pid: int, caller_may_reap: bool) -> None:
        self.c, self.execs, self.starter, self.hibernation = c, execs, starter, hibernation
        self.launcher_pid = launcher_pid        # the process that forked us and exits at once
        self.caller_may_reap = caller_may_reap  # False: we reap, whoever adopts us (a factory's create)
        self.caller_reaps = False               # see _choose_reaper
        self.exit_statuses = True               # caller reaps: statuses come from pidfds (6.15+)
        self.killing = False                    # the cgroup's processes are being killed (_kill_rest)
        self.waiters: dict[int, list[socket.socket]] = {}
        self.exits: dict[int, tuple[int, str]] = {}   # exec pid -> exit no wait has collected yet

    def setup_process(self, reap: Callable[[], None]) -> None:
        """Choose who reaps, and reap on SIGCHLD where we do (`reap`: the supervisor's, which gives
        each exit to the container it belongs to); the signals a supervisor ignores."""
        self.caller_reaps = self.c.state.caller_reaps = self._choose_reaper()
        if not self.caller_reaps:
            L.prctl(L.PR_SET_CHILD_SUBREAPER, 1)
        for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_IGN)
        r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.c.loop.add_reader(r, lambda: (self._drain(r), reap()))

    def _choose_reaper(self) -> bool:
        """Who becomes the parent of the container's processes.

        By default the supervisor (a child subreaper) does, and reaps them. A manager that drives
        quark as a runc-compatible binary (containerd's runc shim with BinaryName, conmon) is a
        child subreaper itself and waits for the init it was told about in --pid-file, as it does
        with runc: then the container's processes go to it (the supervisor is no subreaper, so
        they are re-parented past it when their first stage exits), and the supervisor learns
        their exit statuses from their pidfds once the manager has reaped them (PIDFD_GET_INFO, qlib/linux.py).
        QUARK_INIT_REAPER=caller|supervisor overrides the choice. A supervisor a sandbox factory's
        worker forked always reaps (caller_may_reap False): the factory sends those callers to the CLI."""
        if not self.caller_may_reap:
            return False
        deadline = time.monotonic() + 1.0
        while self.launcher_pid and os.getppid() == self.launcher_pid and time.monotonic() < deadline:
            time.sleep(0.0002)   # the launcher exits right after forking us
        choice = os.environ.get("QUARK_INIT_REAPER", "")
        if choice == "supervisor":
            return False
        adopter = os.getppid()
        if choice != "caller":
            if adopter in (0, 1):
                return False   # nobody adopts orphans above us
            name = procfs.exe_name(adopter)
            if name is None or not name.startswith(procfs.RUNC_MANAGERS):
                return False
        # Before Linux 6.15 (no PIDFD_GET_INFO) the caller still reaps, as it must to learn the exits
        # it waits for, and the supervisor learns only that a process ended (its pidfd turns readable).
        self.exit_statuses = L.pidfd_exit_status_supported()
        if not self.exit_statuses:
            log.info("this kernel cannot report exit statuses through pidfds (Linux 6.15+): the caller "
                     "has them; quark records %d for each", UNKNOWN_EXIT)
        log.info("the container's processes go to pid %d, which reaps them", adopter)
        return True

    def watch_exit(self, pid: int, fd: int = -1) -> None:
        """(another process reaps) Learn when `pid` exits and, once reaped by its parent, its
        status; `fd`: a pidfd of it opened already (ours from now on)."""
        if fd < 0:
            try:
                fd = L.pidfd_open(pid)
            except OSError:
                return self.exited(pid, 255)   # already gone and reaped: the status is lost
        self.c.loop.add_reader(fd, lambda: self._pidfd_readable(pid, fd, time.monotonic()))

    def _pidfd_readable(self, pid: int, fd: int, since: float) -> None:
        if not self.exit_statuses:   # an old kernel: the process ended, its status is the reaper's
            self.c.loop.remove_reader(fd)
            os.close(fd)
            if self.running(pid):
                self.exited(pid, UNKNOWN_EXIT)
            return
        status = L.pidfd_exit_status(fd)
        if status is None:   # exited, not reaped yet: the pidfd stays readable, so look again later
            self.c.loop.remove_reader(fd)
            if time.monotonic() - since > REAP_WAIT_S:
                log.warning("process %d exited but its parent did not reap it in %ds", pid, REAP_WAIT_S)
                os.close(fd)
                if self.running(pid):
                    self.exited(pid, 255)
                return
            self.c.loop.call_later(0.002, lambda: self._pidfd_readable(pid, fd, since))
            return
        if self.c.loop.has_reader(fd):
            self.c.loop.remove_reader(fd)
        os.close(fd)
        if self.running(pid):   # the ptrace platform may have seen the exit first
            self.exited(pid, L.exit_code(status))

    @staticmethod
    def _drain(fd: int) -> None:
        try:
            while os.read(fd, 512):
                pass
        except BlockingIOError:
            pass

    # ---- exits -------------------------------------------------------------------------------

    def wait(self, conn: socket.socket, msg: dict, fds: list[int]) -> None:
        """Answer with `pid`'s exit once it has one. The init's stays in the state for every wait;
        an exec'd process's goes to the waits that are there when it exits, else to the first
        one that comes (the shim's, right after `quark exec -d`), and is then forgotten."""
        pid = msg.get("pid") or self.c.state.pid
        if pid == self.c.state.pid and self.c.state.status == STOPPED:
            return reply(conn, _exit_reply(pid, self.c.state.exit_status, self.c.state.exited_at))
        if pid in self.exits:
            return reply(conn, _exit_reply(pid, *self.exits.pop(pid)))
        if not self.running(pid):
            return fail(conn, NotFound(f"process {pid} is not a running process of this container "
                                             "(or its exit status was collected already)"))
        self.waiters.setdefault(pid, []).append(conn)

    def running(self, pid: int) -> bool:
        """Whether `pid` is the container's init or an exec'd process, not yet reaped."""
        if pid == self.c.state.pid:
            return self.c.state.status != STOPPED
        ex = self.execs.table.get(pid)
        return ex is not None and ex.pid == pid

    def knows(self, pid: int) -> bool:
        """`pid` is this container's init, an exec'd process or an exec's stage 1."""
        return (self.c.init is not None and pid == self.c.init.pid) or pid in self.execs.table

    def drain_pending(self) -> None:
        """Read the messages of the execs whose process is not known yet: stage 1 sends its "pid"
        before it exits, and only then does that process become our child, so its exit can come
        first."""
        for ex in [ex for ex in self.execs.table.values() if ex.pid == 0]:
            children.drain(self.c.loop, ex)

    def kill_rest(self) -> None:
        """Kill what is left in the cgroup without holding the loop: freezing can take seconds to
        settle, so each step of the kill runs on a timer (trapped syscalls and requests of the
        remaining processes are served meanwhile)."""
        steps = self.c.cgroup.kill_steps(signal.SIGKILL)
        self.killing = True

        def step() -> None:
            try:
                pause = next(steps)
            except StopIteration:
                self.killing = False
                return
            except (OSError, QuarkError) as e:
                log.warning("killing the container's remaining processes: %s", e)
                self.killing = False
                return
            self.c.loop.call_later(pause, step)
        step()

    def exited(self, pid: int, code: int) -> None:
        at = now_rfc3339()
        init = self.c.init is not None and pid == self.c.init.pid
        if init:
            log.info("init %d exited with %d", pid, code)
            children.drain(self.c.loop, self.c.init)  # its last words (an error) come before the exit
            if self.c.in_setup:
                raise RuntimeError(f"container init exited with status {code} during set-up")
            self.c.state.status = STOPPED
            self.c.state.exit_status, self.c.state.exited_at = code, at
            self.c.store.save(self.c.state)
            self.hibernation.over()
            if self.starter.pending is not None:
                self.starter.done(QuarkError(f"container process exited with status {code} before it started"))
        elif pid in self.execs.table and self.execs.table[pid].pid == pid:
            ex = self.execs.table.pop(pid)
            children.drain(self.c.loop, ex)
            ex.sock.close()
            if ex.pidfd >= 0:
                os.close(ex.pidfd)
            if not self.waiters.get(pid):
                self._keep_exit(pid, code, at)
        elif pid in self.execs.table and self.execs.table[pid].pid == 0:
            # an exec's stage 1: its "pid" message may still be queued; if it never forked the
            # process (setns or fork failed), the exec is over and must not keep us alive
            ex = self.execs.table[pid]
            children.drain(self.c.loop, ex)
            if ex.pid == 0:
                del self.execs.table[pid]
                if ex.client is not None:
                    self.execs.on_msg(ex, {"type": "eof"}, [])
                ex.sock.close()
        else:
            # not a process we know (the supervisor's _reap asks knows first, after drain_pending):
            # a stage 1 whose process was reported, an orphan the container left us
            return
        for conn in self.waiters.pop(pid, []):
            reply(conn, _exit_reply(pid, code, at))
        if init:
            # processes left in a container that shares the host pid namespace die with its init;
            # after the waiters' answers: `run` deletes the container next, which kills them anyway
            self.kill_rest()

    def forget(self, conn: socket.socket) -> None:
        """A client left: its waits go with it."""
        for pid, conns in list(self.waiters.items()):
            if conn in conns:
                conns.remove(conn)
                if not conns:
                    del self.waiters[pid]

    def tables(self, conn: socket.socket, msg: dict, fds: list[int]) -> None:
        """How much the supervisor holds (read-only: tests check it stays bounded)."""
        reply(conn, {"execs": len(self.execs.table), "exits": len(self.exits),
                     "waiters": sum(map(len, self.waiters.values()))})

    def _keep_exit(self, pid: int, code: int, at: str) -> None:
        """Keep an exec'd process's exit for the wait still to come, at most MAX_KEPT_EXITS."""
        if len(self.exits) >= MAX_KEPT_EXITS:
            oldest = next(iter(self.exits))
            del self.exits[oldest]
            log.warning("forgetting the exit status of process %d: no one waited for it", oldest)
        self.exits[pid] = (code, at)


def _exit_reply(pid: int, code: int | None, at: str | None) -> dict:
    return {"pid": pid, "exit_status": code, "exited_at": at}
