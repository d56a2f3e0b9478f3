"""The door of a tsord listening socket: connections nobody has vouched for yet.

tsord spends a thread on a connection only once it has passed its check (a sandbox's hello, a peer
tsord's proof of the cluster secret). Until then one thread holds every new connection: at most
`max_pending` of them, each for at most `timeout` seconds. When a new one comes and all places are
taken, the oldest is closed: a flood of connections that send nothing costs one thread and
`max_pending` fds, and a legitimate client, which sends its greeting at once, still gets through
unless `max_pending` flood connections arrive within its round trip.
"""
from __future__ import annotations

import logging
import os
import selectors
import socket
import threading
import time
from typing import Any, Callable

log = logging.getLogger("tsor.gate")
WARN_EVERY_S = 10.0


class Pending:
    """A connection at the door; `state` is the owner's (a session, a partly read header)."""

    def __init__(self, conn: socket.socket, peer: Any, deadline: float) -> None:
        self.conn, self.peer, self.deadline = conn, peer, deadline
        self.fd = conn.fileno()
        self.state: Any = None


# opened(pending) -> False to refuse it; readable(pending) -> True: passed (the owner now has the
# connection), False: refused (the gate closes it), None: still waiting for more.
Opened = Callable[[Pending], bool]
Readable = Callable[[Pending], "bool | None"]


class Gate:
    def __init__(self, server: socket.socket, name: str, opened: Opened, readable: Readable,
                 max_pending: int, timeout: float) -> None:
        self.server, self.name = server, name
        self.opened, self.readable = opened, readable
        self.max_pending, self.timeout = max_pending, timeout
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._pending: dict[int, Pending] = {}
        self._closed = False
        self._warned = 0.0
        self.evicted = 0
        server.setblocking(False)
        self._sel.register(server, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._run, name=f"{name}-gate", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop accepting and close every pending connection (the server socket stays the owner's)."""
        self._closed = True
        os.write(self._wake_w, b"x")
        if self._thread is not threading.current_thread():
            self._thread.join(5)

    def _run(self) -> None:
        try:
            while not self._closed:
                now = time.monotonic()
                wait = min((p.deadline for p in self._pending.values()), default=now + 3600) - now
                for key, _ in self._sel.select(max(0.0, wait)):
                    if key.fileobj is self.server:
                        self._accept()
                    elif key.fd in self._pending:
                        self._on_readable(self._pending[key.fd])
                self._expire()
        finally:
            for p in list(self._pending.values()):
                self._drop(p, close=True)
            self._sel.close()
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, peer = self.server.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:   # the owner closed the server
                log.debug("%s: accept: %s", self.name, e)
                self._closed = True
                return
            if len(self._pending) >= self.max_pending:
                self._evict_oldest()
            p = Pending(conn, peer, time.monotonic() + self.timeout)
            try:
                if not self.opened(p):
                    conn.close()
                    continue
            except OSError as e:
                log.debug("%s: new connection from %s: %s", self.name, peer, e)
                conn.close()
                continue
            self._pending[p.fd] = p
            self._sel.register(p.fd, selectors.EVENT_READ)

    def _evict_oldest(self) -> None:
        self._drop(min(self._pending.values(), key=lambda p: p.deadline), close=True)
        self.evicted += 1
        now = time.monotonic()
        if now - self._warned > WARN_EVERY_S:
            self._warned = now
            log.warning("%s: %d connections wait for their check; closing the oldest (%d so far)",
                        self.name, self.max_pending, self.evicted)

    def _on_readable(self, p: Pending) -> None:
        try:
            verdict = self.readable(p)
        except Exception:   # one bad connection must not take the door down
            log.exception("%s: checking a connection from %s", self.name, p.peer)
            verdict = False
        if verdict is not None:
            self._drop(p, close=not verdict)

    def _expire(self) -> None:
        now = time.monotonic()
        for p in [p for p in self._pending.values() if p.deadline <= now]:
            log.info("%s: connection from %s sent no valid greeting in %.0fs; closed",
                     self.name, p.peer or "a local peer", self.timeout)
            self._drop(p, close=True)

    def _drop(self, p: Pending, close: bool) -> None:
        self._pending.pop(p.fd, None)
        try:
            self._sel.unregister(p.fd)
        except (KeyError, ValueError):
            pass
        if close:
            p.conn.close()
