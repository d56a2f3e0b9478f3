"""JSON messages with file descriptors over unix sockets.

Used between the supervisor and the processes it forks (SOCK_SEQPACKET: one message per record)
and between the CLI and the supervisor's control socket (SOCK_STREAM: one message per line, with
any fds attached to the line's first byte).
"""
from __future__ import annotations

import fcntl
import json
import socket
from typing import Any

MAX_FDS = 253   # SCM_MAX_FD: the most one sendmsg can carry
MAX_MSG = 1 << 20


class ChannelClosed(EOFError):
    pass


def send(sock: socket.socket, msg: dict[str, Any], fds: list[int] | tuple[int, ...] = ()) -> None:
    data = json.dumps(msg).encode() + b"\n"
    # one sendmsg: on SOCK_SEQPACKET the message must be one record, and the fds ride with it
    sent = socket.send_fds(sock, [data], list(fds)) if fds else sock.send(data)
    if sent < len(data):
        sock.sendall(data[sent:])


def numbered_from(sock: socket.socket, lowest: int) -> socket.socket:
    """`sock`, moved to an fd number >= lowest if it has a lower one (a child's channel, above the
    fds it passes on at 3, 4, ...)."""
    if sock.fileno() >= lowest:
        return sock
    moved = socket.socket(fileno=fcntl.fcntl(sock.fileno(), fcntl.F_DUPFD_CLOEXEC, lowest))
    sock.close()
    return moved


def recv_packet(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """One SOCK_SEQPACKET record."""
    data, fds, _, _ = socket.recv_fds(sock, MAX_MSG, MAX_FDS)
    if not data:
        for fd in fds:
            _close(fd)
        raise ChannelClosed()
    return json.loads(data), fds


class LineReader:
    """Reads newline-delimited JSON with fds from a SOCK_STREAM socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""
        self.fds: list[int] = []

    def feed(self) -> bool:
        """Read what is available; False at EOF. Raise ValueError if a line grows too long."""
        data, fds, _, _ = socket.recv_fds(self.sock, 65536, MAX_FDS)
        self.fds.extend(fds)
        if not data:
            return False
        self.buf += data
        if len(self.buf) > MAX_MSG:
            raise ValueError("message too long")
        return True

    def next(self) -> tuple[dict[str, Any], list[int]] | None:
        """The next complete message, or None if more bytes are needed."""
        line, sep, rest = self.buf.partition(b"\n")
        if not sep:
            return None
        self.buf = rest
        fds, self.fds = self.fds, []
        msg = json.loads(line)
        if not isinstance(msg, dict):
            raise ValueError("message is not an object")
        return msg, fds

    def read(self) -> tuple[dict[str, Any], list[int]]:
        """Blocking: the next message."""
        while True:
            m = self.next()
            if m is not None:
                return m
            if not self.feed():
                raise ChannelClosed()


def _close(fd: int) -> None:
    import os
    try:
        os.close(fd)
    except OSError:
        pass
