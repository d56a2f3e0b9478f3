"""Exec'd processes: fork an exec's stage 1 into the running
container, answer its set-up messages, hand the caller its pid (and pty master), and signal it
through the pidfd held from its start until it is reaped (its exit is reaper.py's).
"""
from __future__ import annotations

import logging
import os
import pickle
import socket
from typing import NoReturn

from qlib import linux as L
from qlib import procfs
from qlib.errors import ConfigError, InvalidArgument, InvalidState, NotFound, QuarkError
from qvisor import channel, sandbox, validate
from qvisor.spec import parse_process
from qvisor.state import RUNNING
from qvisor.supervisor import child as children
from qvisor.supervisor.child import Child, child_log
from qvisor.supervisor.context import Container
from qvisor.supervisor.control import fail, reply

log = logging.getLogger("quark.supervisor")


def _refuse(field: str, why: str) -> NoReturn:
    raise ConfigError("process.json", field, why)


class Execs:
    """The exec'd processes: each from its stage 1's fork until it is reaped (reaper.py ends it)."""

    def __init__(self, c: Container) -> None:
        self.c = c
        self.table: dict[int, Child] = {}   # by stage 1's pid, then by the process's own
        self.reaper = None   # reaper.py's Reaper, which needs this table too (set by core.py)

    def exec(self, conn: socket.socket, msg: dict, fds: list[int]) -> None:
        """Start an exec'd process; `fds` are its stdio (none with a terminal) then the caller's
        preserved fds (msg["preserve_fds"] of them), or, where the caller forked its stage 1
        (msg["forked"]), that stage 1's channel and pidfd."""
        if self.c.state.status != RUNNING:
            return fail(conn, InvalidState(f"cannot exec in a container in state {self.c.state.status}"))
        try:
            proc = parse_process(msg.get("process"), "process.json")
            validate.check_process(proc, _refuse)
        except Exception as e:  # noqa: BLE001 - any malformed process.json is the caller's error
            return fail(conn, e if isinstance(e, QuarkError) else InvalidArgument(f"process.json: {e}"))
        if msg.get("forked"):
            try:
                parent, pid = self._stage1_of_caller(fds, proc)
            except (OSError, ValueError) as e:
                return fail(conn, InvalidArgument(f"exec: the caller's stage 1: {e}"))
        else:
            n = msg.get("preserve_fds", 0)
            if type(n) is not int or not 0 <= n <= len(fds):
                return fail(conn, InvalidArgument(f"exec: preserve_fds: {n!r} does not fit the {len(fds)} fds sent"))
            stdio, preserved = fds[:len(fds) - n], fds[len(fds) - n:]
            parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            child = channel.numbered_from(child, 3 + n)   # the preserved fds take 3.. in the child
            pid = os.fork()
            if pid == 0:
                parent.close()
                for i, fd in enumerate(stdio):
                    os.dup2(fd, i, inheritable=True)
                sandbox.run_child(child, lambda: sandbox.exec_stage1(child, self.c.state.pid, self.c.spec, proc, preserved))
            child.close()
        ex = Child(parent, self.on_msg, stage1_pid=pid, client=conn, by_caller=bool(msg.get("forked")))
        self.table[pid] = ex
        go = {"type": "go"}
        affinity = proc.exec_cpu_affinity or (self.c.spec.process.exec_cpu_affinity if self.c.spec.process else None)
        if affinity is not None and affinity.initial is not None:   # before the move (runc's order)
            try:
                os.sched_setaffinity(pid, affinity.initial)
            except OSError as e:   # stage 1 fails the exec with it
                go["error"] = f"process.execCPUAffinity.initial: {e.strerror}"
        self.c.cgroup.add_pid(pid)
        self._leave_quark_cgroup(pid)
        channel.send(parent, go)
        children.watch(self.c.loop, ex)

    def _stage1_of_caller(self, fds: list[int], proc) -> tuple[socket.socket, int]:
        """An exec whose stage 1 the caller forked (`fds`: its channel and its pidfd), as runc's
        process tree has it where the caller reaps (qvisor/container/exec.py): it gets what a fork of
        ours would have had, the init's pid, the spec and the process, as its first message."""
        if len(fds) != 2:
            raise ValueError(f"{len(fds)} fds sent, not its channel and its pidfd")
        pid = int(procfs.fdinfo(fds[1]).get("Pid", "0"))
        if pid <= 0:
            raise ValueError("it has exited")
        parent = socket.socket(fileno=os.dup(fds[0]))   # (the request's fds are closed after it)
        try:
            parent.send(pickle.dumps((self.c.state.pid, self.c.spec, proc), pickle.HIGHEST_PROTOCOL))
        except OSError:
            parent.close()
            raise
        return parent, pid

    def _leave_quark_cgroup(self, pid: int) -> None:
        """With TSoR's option offload this supervisor sits in quark's own cgroup
        (tsor/sockopt_offload.py), where a child would stay on a hybrid host."""
        tsor = self.c.tsor()
        if tsor is None or tsor.offload is None or self.c.cgroup.version == "v2":
            return
        try:
            tsor.offload.release(pid, self.c.state.pid)
        except OSError as e:
            log.warning("exec'd pid %d stays in %s: %s", pid, tsor.offload.cgroup, e)

    def on_msg(self, ex: Child, msg: dict, fds: list[int]) -> None:
        kind = msg.get("type")
        if kind == "log":
            return child_log(msg)
        if kind == "pid":
            ex.pid = msg["pid"]
            self.table[ex.pid] = self.table.pop(ex.stage1_pid)
            self.reaper.exits.pop(ex.pid, None)   # kept for an earlier process with this pid: stale now
            try:
                ex.pidfd = L.pidfd_open(ex.pid)   # it waits for "start", so this is still our process
            except ProcessLookupError:
                # killed before it was told to start, and already reaped: by us (then we are in
                # _exited for it, which finishes it) or by the manager that reaps for us
                if self.reaper.caller_reaps:
                    self.reaper.exited(ex.pid, 255)
                return
            if self.reaper.caller_reaps:
                self.reaper.watch_exit(ex.pid)
            if self.c.platform == "ptrace":
                self.c.kernel.attach(ex.pid)
            channel.send(ex.sock, {"type": "start", "platform": self.c.platform, **self.c.socket_filter()})
        elif kind == "console":
            ex.console.extend(fds)
        elif kind == "listener":
            self.c.kernel.serve_listener(fds[0])
        elif kind in ("error", "eof"):
            if kind == "eof" and ex.pid == 0 and ex.by_caller:
                # a stage 1 of the caller's that forked nothing: no exit of it comes to us (the
                # caller reaps it), so the end of its channel ends the exec
                del self.table[ex.stage1_pid]
                ex.sock.close()
            if ex.client is None:
                return
            if kind == "error":
                answer = {"error": msg["error"], "kind": msg.get("kind", QuarkError.kind)}
            elif ex.pid == 0:
                answer = {"error": "exec: process setup failed", "kind": QuarkError.kind}
            else:
                answer = {"ok": True, "pid": ex.pid}
            reply(ex.client, answer, ex.console)
            for fd in ex.console:
                os.close(fd)
            ex.client, ex.console = None, []

    def signal(self, conn: socket.socket, msg: dict, fds: list[int]) -> None:
        """Signal an exec'd process through the pidfd held since its start: once it is reaped its
        pid may name another process, which the caller (the shim) cannot tell from here."""
        pid, sig = msg.get("pid"), msg.get("signal")
        if type(sig) is not int or type(pid) is not int:
            return fail(conn, InvalidArgument(f"signal: pid {pid!r} and signal {sig!r} must be numbers"))
        ex = self.table.get(pid)
        if ex is None or ex.pid != pid or ex.pidfd < 0:
            return fail(conn, NotFound(f"process {pid} is not a running process of this container"))
        try:
            L.pidfd_send_signal(ex.pidfd, sig)
        except ProcessLookupError:   # reaped by the manager that reaps for us: its exit is on the way
            return fail(conn, NotFound(f"process {pid} has exited"))
        except OSError as e:
            return fail(conn, InvalidArgument(f"signal {sig}: {e.strerror}"))
        reply(conn, {"ok": True})
