"""The control socket: the server the CLI and the shim talk to, one JSON request a line. Each op
goes to the part that owns it (core.py wires them: start to start.py, exec and signal to exec.py,
wait to reaper.py, hibernation to snapshot.py); replies carry an error's kind.
"""
from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable

from qlib.errors import InvalidArgument, QuarkError
from qvisor import channel, paths
from qvisor.state import SOCK_NAME
from qvisor.supervisor.context import Container

log = logging.getLogger("quark.supervisor")

# an op's handler: (the client's connection, the request, the fds it brought) -> None; it replies
# (now, or later: a wait) through reply / fail
Op = Callable[[socket.socket, dict, list[int]], None]


def reply(conn: socket.socket, msg: dict, fds: list[int] = ()) -> None:
    try:
        channel.send(conn, msg, fds)
    except OSError:
        pass


def fail(conn: socket.socket, error: QuarkError) -> None:
    """An error reply: its kind travels with it, so the caller never reads the message to act."""
    reply(conn, {"error": str(error), "kind": error.kind})


class Control:
    """The control socket and its clients."""

    def __init__(self, c: Container, ops: dict[str, Op], on_drop: Callable[[socket.socket], None]) -> None:
        self.c = c
        self.ops = ops
        self.on_drop = on_drop   # a client left: forget what it waited for
        self.sock: socket.socket | None = None
        self.clients: dict[int, tuple[socket.socket, channel.LineReader]] = {}

    def open(self) -> None:
        path = self.c.store.path(self.c.state.id, SOCK_NAME)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        with paths.socket_address(path) as address:
            s.bind(address)
        os.chmod(path, 0o600)
        s.listen(16)
        self.serve(s)

    def serve(self, sock: socket.socket) -> None:
        """Serve on a control socket bound already (a container handed over: pod.py)."""
        sock.setblocking(False)
        self.sock = sock
        self.c.loop.add_reader(sock.fileno(), self._accept)

    def close(self) -> None:
        """Stop serving: the socket and every client's connection."""
        for conn, _ in list(self.clients.values()):
            self._drop(conn)
        if self.sock is not None:
            self.c.loop.remove_reader(self.sock.fileno())
            self.sock.close()
            self.sock = None

    def _accept(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except BlockingIOError:
            return
        conn.setblocking(True)
        self.clients[conn.fileno()] = (conn, channel.LineReader(conn))
        self.c.loop.add_reader(conn.fileno(), lambda: self._on_client(conn))

    def _drop(self, conn: socket.socket) -> None:
        self.on_drop(conn)
        self.c.loop.remove_reader(conn.fileno())
        self.clients.pop(conn.fileno(), None)
        conn.close()

    def _on_client(self, conn: socket.socket) -> None:
        _, reader = self.clients[conn.fileno()]
        try:
            if not reader.feed():
                return self._drop(conn)
            while (m := reader.next()) is not None:
                self._request(conn, *m)
        except (ValueError, OSError) as e:
            log.warning("dropping control client: %s", e)
            self._drop(conn)

    def _request(self, conn: socket.socket, msg: dict, fds: list[int]) -> None:
        try:
            op = self.ops.get(msg.get("op"))
            if op is None:
                fail(conn, InvalidArgument(f"unknown op {msg.get('op')!r}"))
            else:
                op(conn, msg, fds)
        finally:
            # the fds a request brings (an exec's stdio) live only while it is handled: a refused
            # exec must not keep the caller's pipes open, and a started one has its own copies
            for fd in fds:
                os.close(fd)
