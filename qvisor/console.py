"""A terminal for `quark run -t` / `quark exec -t` without --console-socket: receive the pty
master and copy between it and our own stdin/stdout, as runc does in the foreground."""
from __future__ import annotations

import contextlib
import os
import select
import socket
import tempfile
import termios
import tty
from typing import Iterator


@contextlib.contextmanager
def console_socket() -> Iterator[tuple[str, socket.socket]]:
    """A listening unix socket in a private temp dir; yields (path, socket)."""
    d = tempfile.mkdtemp(prefix="quark-console-")
    path = os.path.join(d, "console.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        s.bind(path)
        s.listen(1)
        yield path, s
    finally:
        s.close()
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        os.rmdir(d)


def receive_master(listener: socket.socket, timeout: float = 30.0) -> int:
    listener.settimeout(timeout)
    conn, _ = listener.accept()
    with conn:
        _, fds, _, _ = socket.recv_fds(conn, 4096, 1)
    return fds[0]


def proxy(master: int) -> None:
    """Copy stdin -> master and master -> stdout until the pty closes."""
    restore = None
    if os.isatty(0):
        restore = termios.tcgetattr(0)
        tty.setraw(0)
        try:
            import fcntl
            fcntl.ioctl(master, termios.TIOCSWINSZ, fcntl.ioctl(0, termios.TIOCGWINSZ, b"\0" * 8))
        except OSError:
            pass
    fds = [master, 0]
    try:
        while True:
            r, _, _ = select.select(fds, [], [])
            if master in r:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: the slave side is gone
                    data = b""
                if not data:
                    break
                os.write(1, data)
            if 0 in r:
                data = os.read(0, 65536)
                if data:
                    os.write(master, data)
                else:
                    fds.remove(0)
    finally:
        if restore is not None:
            termios.tcsetattr(0, termios.TCSADRAIN, restore)
