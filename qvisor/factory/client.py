"""The factory from its clients' side (the Python CLI, the shim): send a request, start a factory
when none answers, stop one. Imports nothing of the server, so a client pays for none of it."""
from __future__ import annotations

import fcntl
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time

from qlib.errors import QuarkError
from qvisor.factory.caller import current_umask
from qvisor.factory.wire import (LOCK_NAME, LOG_NAME, MAX_REQUEST, PID_NAME, directory, enabled, encode_request,
                                 socket_path)

log = logging.getLogger("quark.factory")


def request(argv: list[str], stdio: tuple[int, int, int] = (0, 1, 2), env: dict[str, str] | None = None,
            where: str | None = None, prog: str = "quark") -> int | None:
    """Run `quark argv` (or `prog argv`) in the factory; its exit status, or None when the caller
    must run it itself (no factory, or it declined)."""
    data = encode_request(argv, dict(os.environ) if env is None else env, current_umask(), prog)
    if len(data) > MAX_REQUEST:
        return None
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    except OSError:
        return None
    cwd = -1
    try:
        s.connect(socket_path(where))
        cwd = os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        socket.send_fds(s, [data], [*stdio, cwd])
    except OSError:
        s.close()
        return None   # no factory, or it went away before taking the request
    finally:
        if cwd >= 0:
            os.close(cwd)
    try:
        reply = s.recv(4096)
        while reply[:1] == b"P":   # the worker's pid: for a client that forwards signals (not this one)
            reply = s.recv(4096)
    except ConnectionResetError:
        return None   # the factory exited with our request still queued: nothing of it ran
    except OSError:
        reply = b""
    finally:
        s.close()
    if reply[:1] == b"X":
        return int(reply[1:])
    if reply[:1] == b"F":
        log.debug("factory declined: %s", reply[1:].decode(errors="replace"))
        return None   # declined before anything ran
    # the worker ran (part of) the verb and died: running it again could do it twice
    raise QuarkError(f"{prog}: the factory's worker ended without an exit status")


def ensure_running(where: str | None = None) -> None:
    """Start a factory in the background unless one answers (called by a create that ran without
    one). Never waits for it: this create goes on by itself, the next one uses it."""
    if not enabled():
        return
    path = socket_path(where)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        s.connect(path)
        return
    except OSError:
        pass
    finally:
        s.close()
    where = where or directory()
    try:
        os.makedirs(where, mode=0o700, exist_ok=True)
        logf = os.open(os.path.join(where, LOG_NAME), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    except OSError as e:
        log.warning("cannot start the sandbox factory in %s: %s", where, e.strerror)
        return
    try:
        subprocess.Popen([sys.executable, "-m", "qvisor.factory", "--dir", where], stdin=subprocess.DEVNULL,
                         stdout=logf, stderr=logf, close_fds=True, start_new_session=True, cwd="/")
    except OSError as e:
        log.warning("cannot start the sandbox factory: %s", e.strerror)
    finally:
        os.close(logf)


def stop(where: str | None = None, timeout: float = 5.0) -> int:
    """Stop the factory serving `where` (SIGTERM by the pid it recorded, confirmed by the lock it
    holds) and wait until it serves no more; its pid, or 0 when none ran."""
    where = where or directory()
    try:
        with open(os.path.join(where, PID_NAME)) as f:
            pid = int(f.read().strip() or 0)
        lock = os.open(os.path.join(where, LOCK_NAME), os.O_RDWR | os.O_CLOEXEC)
    except (OSError, ValueError):
        return 0
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return 0   # nobody holds the lock: no factory runs; the pid file is stale
        except BlockingIOError:
            pass
        pidfd = os.pidfd_open(pid)
        try:
            signal.pidfd_send_signal(pidfd, signal.SIGTERM)
            # until it has stopped serving: its lock is free (it may stay on as the reaper of what
            # it adopted, server.py's reap_what_is_left) or it has exited
            deadline = time.monotonic() + timeout
            while not select.select([pidfd], [], [], 0.01)[0] and time.monotonic() < deadline:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    pass
        finally:
            os.close(pidfd)
        return pid
    except ProcessLookupError:
        return 0
    finally:
        os.close(lock)
