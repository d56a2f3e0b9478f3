"""The ptrace platform (python-ptrace): the filter returns SECCOMP_RET_TRACE for trapped syscalls,
so only those stop the task (PTRACE_O_TRACESECCOMP); everything else runs without a stop.

The supervisor reaps every child itself and hands each status to `on_child_status`; all ptrace
requests come from its one thread, which is the tracer. x86_64 only (registers below).
"""
from __future__ import annotations

import errno
import logging
import os
import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ptrace.binding import func as pt
from ptrace.error import PtraceError

from qkernel.errors import QuarkError
from qkernel.policy import TRACE_DATA
from qkernel.request import Answer, Continue, Request, Return
from qlib import procfs

if TYPE_CHECKING:   # the kernel creates its platform; a platform only talks back to it
    from qkernel.kernel import Kernel

log = logging.getLogger("quark.qkernel")

# python-ptrace 0.9.9 lacks these (DESIGN.md).
PTRACE_SEIZE = 0x4206
PTRACE_LISTEN = 0x4208
PTRACE_O_TRACESECCOMP = 0x80
PTRACE_O_EXITKILL = 0x100000
PTRACE_EVENT_SECCOMP = 7
PTRACE_EVENT_STOP = 128
ERESTARTSYS = 512
_SKIP = 2**64 - 1   # orig_rax = -1: the kernel skips the syscall and returns rax

OPTIONS = (pt.PTRACE_O_TRACESYSGOOD | pt.PTRACE_O_TRACEFORK | pt.PTRACE_O_TRACEVFORK
           | pt.PTRACE_O_TRACECLONE | pt.PTRACE_O_TRACEEXEC | PTRACE_O_TRACESECCOMP
           # if the supervisor dies, its sandbox dies with it rather than run untraced
           | PTRACE_O_EXITKILL)
_STOP_SIGNALS = {signal.SIGSTOP, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU}
_FORK_EVENTS = {pt.PTRACE_EVENT_FORK, pt.PTRACE_EVENT_VFORK, pt.PTRACE_EVENT_CLONE}


@dataclass
class _Task:
    started: bool = False            # its first stop (auto-attach) has been seen and resumed
    restart_nr: int | None = None    # interrupted: at the next syscall-exit stop make it ERESTARTSYS


class StopRequest(Request):
    def __init__(self, platform: "PtracePlatform", pid: int, regs) -> None:
        args = (regs.rdi, regs.rsi, regs.rdx, regs.r10, regs.r8, regs.r9)
        super().__init__(platform.kernel, pid, regs.orig_rax, args)
        self.platform = platform
        self.regs = regs
        self.task = platform.tasks.get(pid)

    def is_valid(self) -> bool:
        # The task stays in its seccomp stop until we resume it, and its pid cannot be reused
        # before the supervisor reaps it, which tells us first. By identity, not by pid: a
        # non-leader thread's execve gives the leader's pid to a new program image (see
        # PTRACE_EVENT_EXEC below), which must never receive this stop's answer.
        return self.task is not None and self.platform.tasks.get(self.pid) is self.task

    def is_interrupted(self) -> bool:
        return not self.is_valid() or _signal_pending(self.pid)

    def send(self, answer: Answer) -> None:
        if not isinstance(answer, Continue):
            self.regs.orig_rax = _SKIP
            value = answer.value if isinstance(answer, Return) else -answer.errno
            self.regs.rax = value & (2**64 - 1)
            self.platform.ptrace(pt.ptrace_setregs, self.pid, self.regs)
        self.platform.ptrace(pt.ptrace_cont, self.pid, 0)

    def interrupt(self) -> None:
        # Linux returns -ERESTARTSYS from a blocking call a signal interrupts; the signal code then
        # restarts it (SA_RESTART) or makes it EINTR. Skip the call, stop at its exit, and set that
        # return there, where the restart logic sees a real syscall number again.
        self.platform.tasks[self.pid].restart_nr = self.nr
        self.regs.orig_rax = _SKIP
        self.platform.ptrace(pt.ptrace_setregs, self.pid, self.regs)
        self.platform.ptrace(pt.ptrace_syscall, self.pid, 0)


def _listen(pid: int) -> None:
    pt.ptrace(PTRACE_LISTEN, pid)


def _signal_pending(pid: int) -> bool:
    """A signal that would be delivered now is pending for this thread or its process."""
    try:
        status = procfs.status(pid)
    except FileNotFoundError:
        return True
    masks = {key: int(status[key], 16) for key in ("SigPnd", "ShdPnd", "SigBlk", "SigIgn")}
    return bool((masks["SigPnd"] | masks["ShdPnd"]) & ~masks["SigBlk"] & ~masks["SigIgn"])


class PtracePlatform:
    def __init__(self, kernel: Kernel) -> None:
        if kernel.arch != "x86_64":
            raise QuarkError(f"the ptrace platform supports x86_64 only, not {kernel.arch}")
        self.kernel = kernel
        self.tasks: dict[int, _Task] = {}

    def serve_listener(self, fd: int) -> None:
        raise QuarkError("serve_listener() is for the seccomp platform; this sandbox uses ptrace")

    def attach(self, pid: int) -> None:
        pt.ptrace(PTRACE_SEIZE, pid, 0, OPTIONS)
        self.tasks[pid] = _Task(started=True)   # SEIZE does not stop the task

    def close(self) -> None:
        self.tasks.clear()

    def ptrace(self, fn, pid: int, *args):
        """A ptrace request that tolerates the task having been killed meanwhile."""
        try:
            return fn(pid, *args)
        except PtraceError as e:
            if e.errno != errno.ESRCH:
                raise
            log.debug("pid %d gone before %s", pid, fn.__name__)
            return None

    def on_child_status(self, pid: int, status: int) -> bool:
        if os.WIFEXITED(status) or os.WIFSIGNALED(status):
            self.tasks.pop(pid, None)
            self.kernel.task_exited(pid)
            return False
        if not os.WIFSTOPPED(status):
            return False
        # Without WUNTRACED, waitpid reports only ptrace stops: every stop here is ours.
        sig, event = os.WSTOPSIG(status), status >> 16
        task = self.tasks.setdefault(pid, _Task())
        if event == PTRACE_EVENT_SECCOMP:
            self._seccomp_stop(pid)
        elif event in _FORK_EVENTS:
            child = self.ptrace(pt.ptrace_geteventmsg, pid)
            if child:
                self.tasks.setdefault(child, _Task())
            self.ptrace(pt.ptrace_cont, pid, 0)
        elif event == pt.PTRACE_EVENT_EXEC:
            former = self.ptrace(pt.ptrace_geteventmsg, pid)
            if former and former != pid:   # a non-leader thread exec'd and took the leader's pid
                self.tasks.pop(former, None)
                # the old leader's pending stop died with its image: a new _Task for the pid
                self.tasks[pid] = _Task(started=True)
                self.kernel.task_exited(pid)
            self.ptrace(pt.ptrace_cont, pid, 0)
        elif event == PTRACE_EVENT_STOP:
            if not task.started:   # an auto-attached child's first stop
                task.started = True
                self.ptrace(pt.ptrace_cont, pid, 0)
            elif sig in _STOP_SIGNALS:   # group stop: stay stopped, as without a tracer
                self.ptrace(_listen, pid)
            else:
                self.ptrace(pt.ptrace_cont, pid, 0)
        elif sig == signal.SIGTRAP | 0x80 and task.restart_nr is not None:
            self._restart_stop(pid, task)
        else:   # signal-delivery stop: deliver it
            task.started = True
            self.ptrace(pt.ptrace_cont, pid, sig)
        return True

    def _seccomp_stop(self, pid: int) -> None:
        regs = self.ptrace(pt.ptrace_getregs, pid)
        data = self.ptrace(pt.ptrace_geteventmsg, pid)
        if regs is None or data is None:
            return
        if data != TRACE_DATA or regs.orig_rax not in self.kernel.handlers:
            self.ptrace(pt.ptrace_cont, pid, 0)   # a bundle's own SCMP_ACT_TRACE rule: run it
            return
        self.kernel.dispatch(StopRequest(self, pid, regs))

    def _restart_stop(self, pid: int, task: _Task) -> None:
        regs = self.ptrace(pt.ptrace_getregs, pid)
        if regs is None:
            return
        regs.rax = -ERESTARTSYS & (2**64 - 1)
        regs.orig_rax = task.restart_nr
        task.restart_nr = None
        self.ptrace(pt.ptrace_setregs, pid, regs)
        self.ptrace(pt.ptrace_cont, pid, 0)
