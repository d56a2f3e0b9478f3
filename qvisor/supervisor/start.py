"""The start op: the init told to exec the container's process, and the reply once it has (or
failed to)."""
from __future__ import annotations

import socket
from collections.abc import Callable

from qlib.errors import InvalidState, QuarkError
from qvisor import channel
from qvisor.state import CREATED, RUNNING
from qvisor.supervisor.context import Container
from qvisor.supervisor.control import fail, reply


class Starter:
    def __init__(self, c: Container, started: Callable[[], None]) -> None:
        self.c = c
        self.started = started   # the container runs (the idle check starts counting)
        self.pending: socket.socket | None = None   # the start waiting for the init's exec

    def start(self, conn: socket.socket, msg: dict, fds: list[int]) -> None:
        c = self.c
        # `direct`: the C front end's `quark start` (qvisor/frontend.c), which cannot run poststart
        # hooks or word a refusal as the CLI does: what it cannot finish goes back to the CLI
        # before anything happened
        if msg.get("direct") is True and (c.state.status != CREATED or self.pending is not None
                                          or c.spec.hooks.poststart):
            return reply(conn, {"fallback": True})
        if c.state.status != CREATED or self.pending is not None:
            return fail(conn, InvalidState(f"cannot start a container in state {c.state.status}"))
        self.pending = conn
        c.phases.mark("start")
        c.state.status = RUNNING  # the hooks' state says running from startContainer on
        channel.send(c.init.sock, {"type": "start", "state": c.hook_state(), "platform": c.platform,
                                   **c.socket_filter()})

    def done(self, error: QuarkError | None) -> None:
        """The init exec'd the container's process (None), or could not."""
        conn, self.pending = self.pending, None
        if error is None:
            self.c.store.save(self.c.state)
            self.started()
        if conn is None:
            return
        if error is None:
            reply(conn, {"ok": True})   # poststart hooks run in `quark start`, as runc does
        else:
            fail(conn, error)
