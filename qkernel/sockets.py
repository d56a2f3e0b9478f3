"""What QKernel's socket handlers (qkernel/syscalls/sys_socket.py) ask of the sandbox's socket layer.

The handlers decode the syscall ABI (fds, sockaddrs and option values in the trapped task's memory)
and write the answers back; *what* to do with a socket (carry it elsewhere, emulate an option, swap
an accepted connection) is the business of the `SocketHooks` the sandbox context carries
(`SandboxContext.tsor`: TSoR's tsor/intercept.py implements it). The hooks see the trapped call only
through `TrappedCall`, so they need nothing of qkernel, and qkernel nothing of them.
"""
from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Protocol


class ConnectReply(Protocol):
    """The answer to a connect() that waits for something (a round trip to tsord)."""

    @property
    def done(self) -> bool:
        """Whether the call was already answered, interrupted, or the task died."""

    def native(self) -> None:
        """Let the connect run natively after all."""

    def answer(self, err: int) -> None:
        """Answer 0, or -1 with `err`."""

    def install(self, fd: int, cloexec: bool, in_progress: bool) -> None:
        """Install `fd` (ours, handed over) over the application's socket and answer 0 (EINPROGRESS
        when `in_progress`)."""


class TrappedCall(Protocol):
    """One trapped socket call, as the hooks see it."""

    pid: int

    def check(self) -> None:
        """After reading anything of the task's through /proc: raises unless it is still the trapped task."""

    def gone(self) -> Exception:
        """The exception that says the trapped task is gone (for the hooks to raise)."""

    def cloexec(self, fd: int) -> bool:
        """Whether the task's `fd` is close-on-exec."""

    def defer(self, on_cancel: Callable[[], None]) -> ConnectReply:
        """Answer later; `on_cancel` runs if the task is interrupted or dies first."""


class OptionTable(Protocol):
    """TCP_NODELAY (1) and TCP_CORK (3) of the sockets registered here, by socket inode."""

    def add(self, inode: int, nodelay: bool, cork: bool) -> bool:
        """Register a socket with its values; False when the table is full (the hooks keep them)."""

    def remove(self, inode: int) -> None: ...

    def get(self, inode: int, opt: int) -> int | None: ...

    def set(self, inode: int, opt: int, value: bool) -> bool: ...


class SocketHooks(Protocol):
    """The sandbox's socket policy. Every method may answer None: the call runs natively. An int
    answer is an errno for the call (0: the call succeeded)."""

    def connect(self, call: TrappedCall, fd: int, addr: bytes) -> int | ConnectReply | None:
        """connect(fd, addr): `addr` is the sockaddr the task passed (at most 28 bytes of it)."""

    def sockname(self, call: TrappedCall, fd: int, peer: bool) -> bytes | None:
        """The sockaddr getsockname (getpeername when `peer`) answers with."""

    def getsockopt(self, call: TrappedCall, fd: int, level: int, opt: int) -> bytes | int | None:
        """The option's value, or an errno."""

    def setsockopt(self, call: TrappedCall, fd: int, level: int, opt: int,
                   value: Callable[[], bytes]) -> int | None:
        """`value()` reads the option value from the task (only when the hook needs it)."""

    def listen(self, call: TrappedCall, fd: int, backlog: int) -> int | None:
        """listen(fd, backlog), carried out here (0) or failed (an errno)."""

    @property
    def ends_refuse_rights(self) -> bool:
        """Whether the kernel makes local-path ends refuse fds (SO_PASSRIGHTS): if not, every sendmsg
        on an end is sent by the supervisor, never let through to the kernel's own read."""

    def local_end(self, call: TrappedCall, fd: int) -> socket.socket | None:
        """Our duplicate of the task's `fd` when it is a local-path end (an AF_UNIX socket standing
        for TCP), else None. The caller closes it."""

    def shutdown(self, call: TrappedCall, fd: int, how: int) -> int | ConnectReply | None:
        """shutdown(fd, how), carried out here (0, or the reply `call.defer` gave, answered later) or
        failed (an errno)."""

    def listener(self, call: TrappedCall, fd: int) -> object | None:
        """The listener whose accepts the hooks answer (opaque to the handlers), or None."""

    def listener_socket(self, call: TrappedCall, fd: int, listener: object) -> socket.socket | None:
        """Our own duplicate of the task's listening socket at `fd`, if it still is `listener`'s."""

    def accept_next(self, listener: object, sock: socket.socket) -> tuple[int, bytes] | int | None:
        """The next connection on `sock` (our duplicate of `listener`'s socket): (fd, the peer's
        sockaddr), the fd ours to install or close; an errno accept(2) failed with; None when none
        is queued."""

    def accept_waiting(self, listener: object, deliver: Callable[[int, bytes], bool]) -> Callable[[], None]:
        """A blocking accept() waits on `listener`: the hooks may hand it a connection directly,
        `deliver(fd, sockaddr)` (True: the accept took the fd; False: it no longer waits, the fd is
        still the hooks'). Returns what to call once the accept no longer waits."""

    def use_option_table(self, table: OptionTable) -> None:
        """QKernel answers TCP_NODELAY/TCP_CORK itself for the sockets the hooks put in `table`
        (qkernel/fastpath.py): the hooks keep those two options there, and read them from there."""

    def close(self) -> None:
        """The sandbox is gone."""
