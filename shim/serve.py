"""The shim's server process: Task service on the socket `start` bound, events to containerd, logs to the bundle's `log` fifo."""
from __future__ import annotations

import logging
import os
import socket
import threading

from shim import paths
from shim.events import Publisher
from shim.runtime import Quark
from shim.service import TaskService
from shim.ttrpc import Server, socket_path

log = logging.getLogger("quark.shim")

SHUTDOWN_GRACE_S = 0.2  # lets the Shutdown answer leave before the process does


class _FifoHandler(logging.Handler):
    """Writes to containerd's log fifo; while containerd is away the fifo is full or unread, and
    a log line is dropped rather than blocking or killing the shim."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self.fd = fd

    def emit(self, record: logging.LogRecord) -> None:
        try:
            os.write(self.fd, (self.format(record) + "\n").encode(errors="replace"))
        except OSError:
            pass


def setup_logging(bundle: str, debug: bool) -> None:
    try:
        # O_RDWR: opening never blocks or fails for want of a reader (containerd may be restarting)
        fd = os.open(os.path.join(bundle, "log"), os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        handler: logging.Handler = _FifoHandler(fd)
    except OSError:
        handler = logging.NullHandler()
    handler.setFormatter(logging.Formatter(
        "time=%(asctime)s level=%(levelname)s msg=%(message)s runtime=io.containerd.quark.v1 pid=%(process)d"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if debug else logging.INFO)


def serve(listener: socket.socket, address: str, namespace: str, bundle: str, debug: bool) -> int:
    setup_logging(bundle, debug)
    publisher = Publisher(os.environ.get("TTRPC_ADDRESS", ""), namespace)
    done = threading.Event()
    service = TaskService(Quark(paths.quark_root(bundle, namespace)), publisher.publish, namespace,
                          on_shutdown=lambda: threading.Timer(SHUTDOWN_GRACE_S, done.set).start())
    # the inode of our socket file: a new shim for the same id may replace the file while we
    # linger after Shutdown, and then it is not ours to remove
    try:
        bound_ino = os.stat(socket_path(address)).st_ino
    except FileNotFoundError:
        bound_ino = None
    server = Server(listener)
    service.register(server)
    threading.Thread(target=server.serve_forever, daemon=True, name="accept").start()
    log.info("serving %s for namespace %s", address, namespace)
    done.wait()
    server.close()
    try:
        if os.stat(socket_path(address)).st_ino == bound_ino:
            os.unlink(socket_path(address))
    except FileNotFoundError:
        pass
    publisher.close()
    log.info("shim exiting")
    return 0
