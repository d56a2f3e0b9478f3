"""The control socket (part of Supervisor, core.py): the server the CLI and the shim talk to,
one JSON request a line; it dispatches the ops (start here, exec to exec.py, wait and signal to
reaper.py and exec.py) and replies, errors with their kind.
"""
from __future__ import annotations

import logging
import os
import socket

from qlib.errors import InvalidArgument, InvalidState, QuarkError
from qvisor import channel, paths
from qvisor.state import CREATED, RUNNING, SOCK_NAME

log = logging.getLogger("quark.supervisor")


class ControlMixin:
    """The control socket and its requests (part of Supervisor, core.py)."""

    def _open_control(self) -> None:
        path = self.store.path(self.state.id, SOCK_NAME)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        with paths.socket_address(path) as address:
            s.bind(address)
        os.chmod(path, 0o600)
        s.listen(16)
        s.setblocking(False)
        self.control = s
        self.loop.add_reader(s.fileno(), self._accept)

    def _accept(self) -> None:
        try:
            conn, _ = self.control.accept()
        except BlockingIOError:
            return
        conn.setblocking(True)
        self.clients[conn.fileno()] = (conn, channel.LineReader(conn))
        self.loop.add_reader(conn.fileno(), lambda: self._on_client(conn))

    def _drop_client(self, conn: socket.socket) -> None:
        for pid, conns in list(self.waiters.items()):   # a wait whose caller left
            if conn in conns:
                conns.remove(conn)
                if not conns:
                    del self.waiters[pid]
        self.loop.remove_reader(conn.fileno())
        self.clients.pop(conn.fileno(), None)
        conn.close()

    def _on_client(self, conn: socket.socket) -> None:
        _, reader = self.clients[conn.fileno()]
        try:
            if not reader.feed():
                return self._drop_client(conn)
            while (m := reader.next()) is not None:
                self._request(conn, *m)
        except (ValueError, OSError) as e:
            log.warning("dropping control client: %s", e)
            self._drop_client(conn)

    def _reply(self, conn: socket.socket, msg: dict, fds: list[int] = ()) -> None:
        try:
            channel.send(conn, msg, fds)
        except OSError:
            pass

    def _fail(self, conn: socket.socket, error: QuarkError) -> None:
        """An error reply: its kind travels with it, so the caller never reads the message to act."""
        self._reply(conn, {"error": str(error), "kind": error.kind})

    def _request(self, conn: socket.socket, msg: dict, fds: list[int]) -> None:
        try:
            op = msg.get("op")
            if op == "start":
                self._start(conn, msg.get("direct") is True)
            elif op == "wait":
                self._wait(conn, msg.get("pid") or self.state.pid)
            elif op == "exec":
                self._exec(conn, msg, fds)
            elif op == "signal":
                self._signal(conn, msg.get("pid"), msg.get("signal"))
            elif op == "hibernate":
                self._op_hibernate(conn, msg)
            elif op == "wake":
                self._op_wake(conn, msg)
            elif op == "snapshot":
                self._op_snapshot_info(conn)
            elif op == "tables":   # read-only: how much the supervisor holds (tests check it stays bounded)
                self._reply(conn, {"execs": len(self.execs), "exits": len(self.exits),
                                   "waiters": sum(map(len, self.waiters.values()))})
            else:
                self._fail(conn, InvalidArgument(f"unknown op {op!r}"))
        finally:
            # the fds a request brings (an exec's stdio) live only while it is handled: a refused
            # exec must not keep the caller's pipes open, and a started one has its own copies
            for fd in fds:
                os.close(fd)

    # ---- start -------------------------------------------------------------------------------

    def _start(self, conn: socket.socket, direct: bool = False) -> None:
        # `direct`: the C front end's `quark start` (qvisor/frontend.c), which cannot run poststart
        # hooks or word a refusal as the CLI does: what it cannot finish goes back to the CLI
        # before anything happened
        if direct and (self.state.status != CREATED or self.pending_start is not None or self.spec.hooks.poststart):
            return self._reply(conn, {"fallback": True})
        if self.state.status != CREATED or self.pending_start is not None:
            return self._fail(conn, InvalidState(f"cannot start a container in state {self.state.status}"))
        self.pending_start = conn
        self.phases.mark("start")
        self.state.status = RUNNING  # the hooks' state says running from startContainer on
        channel.send(self.init.sock, {"type": "start", "state": self._hook_state(), "platform": self.platform,
                                       **self._socket_filter()})

    def _start_done(self, error: QuarkError | None) -> None:
        conn, self.pending_start = self.pending_start, None
        if error is None:
            self.store.save(self.state)
            self._schedule_idle_check()
        if conn is None:
            return
        if error is None:
            self._reply(conn, {"ok": True})   # poststart hooks run in `quark start`, as runc does
        else:
            self._fail(conn, error)
