"""QKernel's dispatcher: trapped syscalls from either platform go through one handler table
(qkernel/table.py); handlers see a `Request` (qkernel/request.py) and return its answer."""
from __future__ import annotations

import errno
import logging
from dataclasses import dataclass
from typing import Any, Protocol

from qkernel import table
from qkernel.config import check_platform
from qkernel.errors import MemoryFault, TaskGone
from qkernel.request import Answer, Continue, Deferred, Errno, Request
from qkernel.seccomp_platform import SeccompPlatform
from qkernel.sockets import SocketHooks

log = logging.getLogger("quark.qkernel")

# How often pending deferred answers are checked for an interrupting signal or a dead task.
DEFERRED_POLL_S = 0.01


class SysinfoFigures(Protocol):
    def __call__(self, host: dict[str, int]) -> dict[str, Any]:
        """sysinfo(2)'s fields for the container (totalram, freeram, ..., uptime, procs, loads), given
        the host's MemTotal, SwapTotal and SwapFree in kB; fields it leaves out stay the host's."""


@dataclass
class SandboxContext:
    container_id: str
    init_pid: int
    # What the container's resources look like (the runtime's /proc view supplies it: qvisor/procview.py);
    # None: sysinfo(2) answers the host's figures.
    sysinfo: SysinfoFigures | None = None
    # What the socket handlers ask (qkernel/sockets.py): TSoR's interception for a sandbox registered
    # with tsord (tsor/intercept.py); None: every socket is native.
    tsor: SocketHooks | None = None


class Kernel:
    def __init__(self, loop, platform: str, context: SandboxContext) -> None:
        check_platform(platform)
        self.loop = loop
        self.context = context
        self.platform_name = platform
        self.arch = table.native_arch()
        self.handlers: dict[int, table.Syscall] = table.handlers(self.arch)
        self._pending: list[Request] = []
        self._polling = False
        if platform == "seccomp":
            self._platform = SeccompPlatform(self)
        else:
            # imported only when chosen: python-ptrace costs start-up time every sandbox would pay
            from qkernel.ptrace_platform import PtracePlatform
            self._platform = PtracePlatform(self)

    @property
    def can_install_fds(self) -> bool:
        """Whether handlers may answer InstallFd (seccomp ADDFD; ptrace has no equivalent)."""
        return getattr(self._platform, "can_install_fds", False)

    # --- the supervisor's interface --------------------------------------------------------------
    def serve_listener(self, fd: int) -> None:
        self._platform.serve_listener(fd)

    def attach(self, pid: int) -> None:
        self._platform.attach(pid)

    def on_child_status(self, pid: int, status: int) -> bool:
        return self._platform.on_child_status(pid, status)

    def close(self) -> None:
        for req in self._pending:
            req.deferred.cancel()
            req.release()
        self._pending.clear()
        self._platform.close()
        if self.context.tsor is not None:
            self.context.tsor.close()
            self.context.tsor = None

    # --- used by the platforms -------------------------------------------------------------------
    def dispatch(self, req: Request) -> None:
        try:
            answer = req.syscall.handler(req)
        except TaskGone:
            log.debug("%s from pid %d: task gone, dropped", req.name, req.pid)
            req.release()
            return
        except MemoryFault:
            answer = Errno(errno.EFAULT)
        except Exception:
            answer = self._failed(req)
        if isinstance(answer, Deferred):
            if not answer.done:   # (a handler may complete it before returning it)
                self._pending.append(req)
                self._schedule_poll()
            return
        self.finish(req, answer)

    @staticmethod
    def _failed(req: Request) -> Answer:
        """A handler raised (a bug in quark): the task must not pay for it where it need not."""
        if req.syscall.native_on_error:
            # Safe for these calls only (see table.Syscall.native_on_error): the native call is what
            # the application would have got without quark (SECCOMP_USER_NOTIF_FLAG_CONTINUE on the
            # seccomp platform; ptrace lets the stopped syscall run).
            log.exception("handler for %s from pid %d failed; the call runs natively", req.name, req.pid)
            return Continue()
        log.exception("handler for %s from pid %d failed; the call fails with ENOSYS", req.name, req.pid)
        return Errno(errno.ENOSYS)

    def finish(self, req: Request, answer: Answer) -> None:
        """Answer `req` (now, or when a deferred answer completes) and forget it."""
        if req in self._pending:
            self._pending.remove(req)
        req.release()
        req.send(answer)

    def task_exited(self, pid: int) -> None:
        for req in [r for r in self._pending if r.pid == pid]:
            self._pending.remove(req)
            req.deferred.cancel()
            req.release()

    def _schedule_poll(self) -> None:
        if not self._polling:
            self._polling = True
            self.loop.call_later(DEFERRED_POLL_S, self._poll_pending)

    def _poll_pending(self) -> None:
        self._polling = False
        for req in list(self._pending):
            if req.deferred.done or not req.is_interrupted():
                continue
            log.debug("%s from pid %d interrupted while deferred", req.name, req.pid)
            self._pending.remove(req)
            req.interrupt()
            req.deferred.cancel()
            req.release()
        if self._pending:
            self._schedule_poll()
