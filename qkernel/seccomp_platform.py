"""The seccomp platform: the filter returns SECCOMP_RET_USER_NOTIF for trapped syscalls and the
supervisor answers them.

Each listener has a receiver thread blocked in SECCOMP_IOCTL_NOTIF_RECV, with the listener in
SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP mode (Linux 6.6): the trapping task hands its CPU straight to
the receiver and gets it back with the answer, instead of two cross-CPU wake-ups (on older kernels
the event loop waits for the listener instead: see serve_listener). A trapped round trip through
the event loop's epoll (epoll does not pass the same-CPU hint on) took several times as long as
with the receiver, where the Python handler is most of it (measured with bench/syscalls.py:
bench/README.md, "Syscall interception"). The receiver dispatches holding the loop's lock
(qlib/eventloop.py), so handlers and loop callbacks never run at once; deferred answers complete
from loop callbacks as before.
"""
from __future__ import annotations

import errno
import logging
import os
import select
import threading
from typing import TYPE_CHECKING

from qkernel import seccomp_notify as sn
from qkernel import table
from qkernel.errors import QuarkError
from qkernel.request import Answer, Continue, Errno, InstallFd, Request, Return

if TYPE_CHECKING:   # the kernel creates its platform; a platform only talks back to it
    from qkernel.kernel import Kernel

log = logging.getLogger("quark.qkernel")

AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
# Notifications taken per wakeup of the event loop: many threads trapping at once are drained in one callback.
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
        self._listeners: set[int] = set()
        self._closed = False
        # the compiled receiver loop (qkernel/fastpath.py), for a sandbox with socket hooks: None
        # not decided yet, False not available (every notification goes through Python)
        self._fast = None

    def serve_listener(self, fd: int) -> None:
        """Serve a listener from its own receiver thread (the supervisor calls this once it is
        confined: threads inherit its capabilities and seccomp filter).

        Only where the kernel knows SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP (6.6+): the same patch series
        made a blocked RECV return once no task uses the filter any more. Before it, RECV waits on
        a semaphore that nothing raises then, so a receiver would outlive its process (one thread and
        fd per `quark exec`); there the event loop waits for the listener as before (no same-CPU
        hand-off to gain there either)."""
        self._listeners.add(fd)
        if not sn.sync_wake_up(fd):
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            self.kernel.loop.add_reader(fd, lambda: self._on_readable(fd, poller))
            return
        hooks = self.kernel.context.tsor
        if self._fast is None and hooks is not None:
            from qkernel import fastpath
            self._fast = fastpath.load() or False
            if self._fast:
                names = table.by_name()
                self._fast.init(names["setsockopt"].nr(self.kernel.arch), self.audit_arch,
                                names["sendmsg"].nr(self.kernel.arch), names["sendmmsg"].nr(self.kernel.arch),
                                strict=not hooks.ends_refuse_rights)
                hooks.use_option_table(self._fast)
        threading.Thread(target=self._receive_loop, args=(fd,), name=f"qkernel-recv-{fd}", daemon=True).start()

    def attach(self, pid: int) -> None:
        raise QuarkError("attach() is for the ptrace platform; this sandbox uses seccomp")

    def on_child_status(self, pid: int, status: int) -> bool:
        if os.WIFEXITED(status) or os.WIFSIGNALED(status):
            self.kernel.task_exited(pid)
        return False

    def close(self) -> None:
        for fd in [fd for fd in self._listeners if self.kernel.loop.has_reader(fd)]:
            self.kernel.loop.remove_reader(fd)   # served by the loop (a kernel before 6.6)
            self._listeners.discard(fd)
            os.close(fd)
        # A receiver blocked in RECV keeps its listener: closing the fd under it could hand the
        # number to another file before the thread looks again. It closes the fd itself when it
        # wakes (the last task gone, or one more notification, answered ENOSYS) or at exit.
        self._closed = True

    def _on_readable(self, fd: int, poller: select.poll) -> None:
        # The loop cannot tell POLLIN from POLLHUP (no task left using the filter), and RECV would
        # block on the latter: ask poll() which one it is.
        for _ in range(_BATCH):
            events = poller.poll(0)
            revents = events[0][1] if events else 0
            if revents & select.POLLIN:
                try:
                    notif = sn.recv(fd)
                except OSError as e:
                    if e.errno in (errno.ENOENT, errno.EINTR):
                        return   # the task was killed between poll and receive
                    raise
                self._receive(fd, notif)
            elif revents & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
                self.kernel.loop.remove_reader(fd)
                self._listeners.discard(fd)
                os.close(fd)
                return
            else:
                return

    def _receive_loop(self, fd: int) -> None:
        lock = self.kernel.loop.lock
        try:
            while True:
                try:
                    # blocks without the GIL; the compiled loop answers the calls it can inside
                    notif = self._fast.serve(fd) if self._fast else sn.recv(fd)
                except OSError as e:
                    if e.errno == errno.EINTR:
                        continue
                    # ENOENT: the task was killed between its wake-up and ours, or no task uses
                    # the filter any more (POLLHUP): then this listener is done
                    if e.errno == errno.ENOENT and not _hung_up(fd):
                        continue
                    return
                with lock:
                    if self._closed:
                        _refuse(fd, notif.id)
                        return
                    try:
                        self._receive(fd, notif)
                    except Exception:   # a bug must not leave the task waiting forever
                        log.exception("trapped syscall %d from pid %d", notif.data.nr, notif.pid)
                        _refuse(fd, notif.id)
        finally:
            with lock:
                self._listeners.discard(fd)
                os.close(fd)

    def _receive(self, fd: int, notif: sn.SeccompNotif) -> None:
        if notif.data.arch != self.audit_arch or notif.data.nr not in self.kernel.handlers:
            # Only quark's filter notifies, for native-ABI numbers from the table.
            log.warning("unexpected notification: arch %#x nr %d", notif.data.arch, notif.data.nr)
            return _refuse(fd, notif.id)
        self.kernel.dispatch(NotifRequest(self.kernel, fd, notif))


def _hung_up(fd: int) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    events = poller.poll(0)
    return bool(events and events[0][1] & (select.POLLHUP | select.POLLERR | select.POLLNVAL))


def _refuse(fd: int, notif_id: int) -> None:
    try:
        sn.send(fd, notif_id, error=-errno.ENOSYS)
    except OSError:
        pass
