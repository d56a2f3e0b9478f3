"""The processes the supervisor forks (the container's init, exec'd processes) while they are
being created: each is a Child, first stage 1 (namespaces) then the process itself, with the
channel the supervisor reads its set-up messages on and the part that handles them (on_msg).
"""
from __future__ import annotations

import dataclasses
import logging
import socket
from typing import Any

from qlib.eventloop import Loop
from qvisor import channel


@dataclasses.dataclass
class Child:
    """A process being created: stage 1 (namespaces) then the process itself."""
    sock: socket.socket
    on_msg: Any   # (child, message, fds) -> None
    stage1_pid: int = 0
    pid: int = 0
    client: socket.socket | None = None        # exec: the CLI connection waiting for the pid
    console: list[int] = dataclasses.field(default_factory=list)  # exec: pty master for the client
    pidfd: int = -1  # exec: the process, held until it is reaped; signals go through it, never the pid
    by_caller: bool = False  # exec: stage 1 is the caller's child, not ours (container/exec.py)


def child_log(msg: dict) -> None:
    """A forked child's log record (it has no fd of our log file): into our log."""
    level = msg.get("level")
    logging.getLogger(str(msg.get("logger", "quark"))).log(
        level if isinstance(level, int) else logging.WARNING, "%s", msg.get("message"))


def watch(loop: Loop, child: Child) -> None:
    """Dispatch the child's messages as they come."""
    loop.add_reader(child.sock.fileno(), lambda: read(loop, child))


def read(loop: Loop, child: Child) -> bool:
    """Dispatch one message; False if there was none (an exit's drain read it first)."""
    try:
        msg, fds = channel.recv_packet(child.sock)
    except BlockingIOError:
        return False
    except (channel.ChannelClosed, ConnectionResetError):
        loop.remove_reader(child.sock.fileno())
        child.on_msg(child, {"type": "eof"}, [])
        return True
    child.on_msg(child, msg, fds)
    return True


def drain(loop: Loop, child: Child) -> None:
    """Dispatch what a child has left in its channel (a dead one's, up to its EOF)."""
    if child.sock.fileno() < 0:
        return
    child.sock.setblocking(False)
    while child.sock.fileno() >= 0 and loop.has_reader(child.sock.fileno()):
        if not read(loop, child):
            return
