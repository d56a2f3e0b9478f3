"""What a handler sees and returns: a trapped `Request` and its answer.

A handler returns `Continue()` (run the syscall natively), `Return(value)`, `Errno(err)`,
`InstallFd(...)` (put one of our fds into the task, then return) or a `Deferred` it completes later
from a loop callback. It never learns which platform trapped the call; only platforms whose
`can_install_fds` is true (seccomp) may be given an InstallFd.
"""
from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from qkernel.errors import MemoryFault, TaskGone
from qkernel.memory import TaskMemory
from qlib import linux

if TYPE_CHECKING:
    from qkernel.kernel import Kernel

_PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class Continue:
    """Run the syscall natively, as if it had not been trapped."""


@dataclass(frozen=True)
class Return:
    value: int


@dataclass(frozen=True)
class Errno:
    errno: int


@dataclass(frozen=True)
class InstallFd:
    """Install our `fd` in the trapped task, then make the syscall return.

    `target`: the task's fd number to replace (dup2 semantics: what was there is closed); None: the
    lowest free number. `flags`: O_CLOEXEC or 0, for the task's new fd. `value`: the syscall's return
    value; None returns the installed fd number (accept), atomically with the installation. `errno`,
    if set, is returned instead of `value` once the fd is installed (a non-blocking connect's
    EINPROGRESS). The answer owns `fd`: it is closed once sent, or when the request is dropped.
    """
    fd: int
    target: int | None = None
    flags: int = 0
    value: int | None = None
    errno: int = 0

    def discard(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


Answer = Continue | Return | Errno | InstallFd


class Request:
    """One trapped syscall. Platforms subclass it with how to check, answer and interrupt it."""

    def __init__(self, kernel: "Kernel", pid: int, nr: int, args: tuple[int, ...]) -> None:
        self.kernel = kernel
        self.context = kernel.context
        self.pid = pid
        self.nr = nr
        self.args = args
        self.syscall = kernel.handlers[nr]
        self._memory: TaskMemory | None = None
        self.deferred: Deferred | None = None

    @property
    def name(self) -> str:
        return self.syscall.name

    def read(self, addr: int, size: int) -> bytes:
        if self._memory is None and size:
            # One process_vm_readv: no /proc/PID/mem to open, check and close for the small reads
            # most handlers make (an option value, a sockaddr). Writes keep the open file (below).
            try:
                data = linux.process_vm_readv(self.pid, addr, size)
            except OSError as e:
                if e.errno == errno.ESRCH:
                    raise TaskGone(self.pid) from e
                if e.errno != errno.EPERM:
                    raise MemoryFault(addr) from e
                data = None   # not allowed here (e.g. Yama): the file below is
            if data is not None:
                # The pid may have died and been reused while we read: only trust data from a live request.
                self._check_valid()
                if len(data) != size:
                    raise MemoryFault(addr)
                return data
        data = self._mem().read(addr, size)
        self._check_valid()
        return data

    def read_string(self, addr: int, limit: int) -> bytes | None:
        """The NUL-terminated string at `addr`, without its NUL; None if none ends within `limit`
        bytes. Read a page at a time, so a string that ends just before an unmapped page is read
        as the kernel would read it."""
        out = b""
        while len(out) < limit:
            chunk = self.read(addr + len(out), min(_PAGE - (addr + len(out)) % _PAGE, limit - len(out)))
            end = chunk.find(b"\0")
            if end >= 0:
                return out + chunk[:end]
            out += chunk
        return None

    def write(self, addr: int, data: bytes) -> None:
        self._mem().write(addr, data)

    def defer(self) -> "Deferred":
        """Answer later: the handler returns this and calls `complete()` from a loop callback."""
        self.deferred = Deferred(self)
        return self.deferred

    def _mem(self) -> TaskMemory:
        if self._memory is None:
            self._memory = TaskMemory(self.pid)
            # Checked after the open: the open file then belongs to the trapped task for good.
            self._check_valid()
        return self._memory

    def _check_valid(self) -> None:
        if not self.is_valid():
            raise TaskGone(self.pid)

    def check_valid(self) -> None:
        """Raise TaskGone unless the request is still the task's: after opening anything of the
        task's by pid (/proc/PID/...), so that what was opened is not a reused pid's."""
        self._check_valid()

    def release(self) -> None:
        if self._memory is not None:
            self._memory.close()
            self._memory = None

    # --- what a platform provides -------------------------------------------------------------
    def is_valid(self) -> bool:
        raise NotImplementedError

    def is_interrupted(self) -> bool:
        """For a deferred answer: has the task died or a signal arrived that must interrupt it?"""
        raise NotImplementedError

    def send(self, answer: Answer) -> None:
        raise NotImplementedError

    def interrupt(self) -> None:
        """Make the syscall return as Linux does for a signal during a blocking call."""


class Deferred:
    """An answer that comes later. If the task is interrupted first, `on_cancel` callbacks run and a
    later `complete()` is dropped: nothing is ever acted on for an abandoned request."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.done = False
        self._on_cancel: list[Callable[[], None]] = []

    def complete(self, answer: Answer) -> None:
        if self.done:
            if isinstance(answer, InstallFd):
                answer.discard()   # never install an fd for an abandoned request
            return
        self.done = True
        self.request.kernel.finish(self.request, answer)

    def on_cancel(self, callback: Callable[[], None]) -> None:
        self._on_cancel.append(callback)

    def cancel(self) -> None:
        if self.done:
            return
        self.done = True
        for cb in self._on_cancel:
            cb()
