"""The seccomp platform: the filter returns SECCOMP_RET_USER_NOTIF for trapped syscalls and the
supervisor services the listener fds from its event loop."""
from __future__ import annotations

import errno
import logging
import os
import select
from typing import TYPE_CHECKING

from qkernel import seccomp_notify as sn
from qkernel.errors import QuarkError
from qkernel.request import Answer, Continue, Errno, InstallFd, Request, Return

if TYPE_CHECKING:   # the kernel creates its platform; a platform only talks back to it
    from qkernel.kernel import Kernel

log = logging.getLogger("quark.qkernel")

AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
# Notifications taken per wakeup: many threads trapping at once are drained in one callback.
_BATCH = 64


class NotifRequest(Request):
    def __init__(self, kernel: Kernel, listener: int, notif: sn.SeccompNotif) -> None:
        super().__init__(kernel, notif.pid, notif.data.nr, tuple(notif.data.args))
        self.listener = listener
        self.id = notif.id

    def is_valid(self) -> bool:
        return sn.id_valid(self.listener, self.id)

    def is_interrupted(self) -> bool:
        # A signal makes the kernel abandon the notification (the syscall then returns EINTR or
        # restarts, with a fresh notification); so does the task's death.
        return not self.is_valid()

    def send(self, answer: Answer) -> None:
        if isinstance(answer, InstallFd):
            return self._install(answer)
        if isinstance(answer, Continue):
            args = {"flags": sn.SECCOMP_USER_NOTIF_FLAG_CONTINUE}
        elif isinstance(answer, Return):
            args = {"val": answer.value}
        else:
            args = {"error": -answer.errno}
        try:
            sn.send(self.listener, self.id, **args)
        except OSError as e:
            if e.errno != errno.ENOENT:
                raise
            log.debug("%s from pid %d abandoned before the answer", self.name, self.pid)

    def _install(self, answer: InstallFd) -> None:
        """SECCOMP_IOCTL_NOTIF_ADDFD: SETFD puts the fd at the task's `target` number (replacing what
        was there); SEND installs and answers in one step, with the new fd number as the return
        value, so an abandoned notification never gets an fd. Either way the kernel refuses with
        ENOENT once the notification is gone, and our fd is closed in every case."""
        flags = sn.SECCOMP_ADDFD_FLAG_SETFD if answer.target is not None else 0
        atomic = answer.value is None and not answer.errno
        try:
            sn.addfd(self.listener, self.id, answer.fd, answer.target or 0,
                     flags | (sn.SECCOMP_ADDFD_FLAG_SEND if atomic else 0), answer.flags)
        except OSError as e:
            answer.discard()
            if e.errno == errno.ENOENT:
                log.debug("%s from pid %d abandoned before its fd was installed", self.name, self.pid)
                return
            log.debug("%s from pid %d: installing an fd failed: %s", self.name, self.pid, e)
            return self.send(Errno(e.errno))   # e.g. EMFILE: the task's fd table is full
        answer.discard()
        if not atomic:
            self.send(Errno(answer.errno) if answer.errno else Return(answer.value))


class SeccompPlatform:
    can_install_fds = True

    def __init__(self, kernel: Kernel) -> None:
        self.kernel = kernel
        self.audit_arch = AUDIT_ARCH[kernel.arch]
        self._listeners: dict[int, select.poll] = {}

    def serve_listener(self, fd: int) -> None:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        self._listeners[fd] = poller
        self.kernel.loop.add_reader(fd, lambda: self._on_readable(fd))

    def attach(self, pid: int) -> None:
        raise QuarkError("attach() is for the ptrace platform; this sandbox uses seccomp")

    def on_child_status(self, pid: int, status: int) -> bool:
        if os.WIFEXITED(status) or os.WIFSIGNALED(status):
            self.kernel.task_exited(pid)
        return False

    def close(self) -> None:
        for fd in list(self._listeners):
            self._drop_listener(fd)

    def _on_readable(self, fd: int) -> None:
        # The loop cannot tell POLLIN from POLLHUP (no task left using the filter), and RECV would
        # block on the latter: ask poll() which one it is.
        poller = self._listeners[fd]
        for _ in range(_BATCH):
            events = poller.poll(0)
            revents = events[0][1] if events else 0
            if revents & select.POLLIN:
                self._receive(fd)
            elif revents & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
                self._drop_listener(fd)
                return
            else:
                return

    def _receive(self, fd: int) -> None:
        try:
            notif = sn.recv(fd)
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.EINTR):
                return   # the task was killed between poll and receive
            raise
        if notif.data.arch != self.audit_arch or notif.data.nr not in self.kernel.handlers:
            # Only quark's filter notifies, for native-ABI numbers from the table.
            log.warning("unexpected notification: arch %#x nr %d", notif.data.arch, notif.data.nr)
            try:
                sn.send(fd, notif.id, error=-errno.ENOSYS)
            except OSError:
                pass
            return
        self.kernel.dispatch(NotifRequest(self.kernel, fd, notif))

    def _drop_listener(self, fd: int) -> None:
        self.kernel.loop.remove_reader(fd)
        del self._listeners[fd]
        os.close(fd)
