"""The shim's server process: Task service on the socket `start` bound, events to containerd, logs to
the `log` fifo of the oldest container it serves.

A pod's shim (`shim: {scope: pod}`) goes once containerd's Shutdown finds it serving nothing. The
node's shim (`shim: {scope: node}`) serves every quark container of its containerd and namespace: it
goes once it has served no container and answered no call for NODE_IDLE_S, decided under the lock
a `start` holds while it looks for it (shim/paths.py, sockets_locked), so a shim a `start` found
stays for the container containerd creates next.
"""
from __future__ import annotations

import logging
import os
import resource
import socket
import threading
import time
from collections.abc import Callable

from shim import paths
from shim.events import Publisher
from shim.runtime import Quark
from shim.service import TaskService
from shim.ttrpc import MAX_CONNECTIONS, Server, socket_path

log = logging.getLogger("quark.shim")

SHUTDOWN_GRACE_S = 0.2  # lets the Shutdown answer leave before the process does
# containerd creates the task within milliseconds of the `start` that found the node's shim; the
# margin covers a loaded node
NODE_IDLE_S = 5.0
# one connection per container containerd has loaded (a node of 110 pods: a few hundred)
NODE_MAX_CONNECTIONS = 4096


def _open_log(bundle: str) -> int | None:
    try:
        # O_RDWR: opening never blocks or fails for want of a reader (containerd may be restarting)
        return os.open(os.path.join(bundle, "log"), os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None


class _FifoHandler(logging.Handler):
    """Writes to a bundle's log fifo, which containerd copies to its own log; while containerd is
    away the fifo is full or unread, and a log line is dropped rather than blocking or killing the
    shim. It follows the oldest container served: once that one is deleted containerd reads its
    fifo no more."""

    def __init__(self, bundle: str, fd: int | None) -> None:
        super().__init__()
        self.bundle = bundle
        self.fd = fd

    def emit(self, record: logging.LogRecord) -> None:
        if self.fd is None:
            return
        try:
            os.write(self.fd, (self.format(record) + "\n").encode(errors="replace"))
        except OSError:
            pass

    def follow(self, bundles: list[str]) -> None:
        """`bundles`: those of the containers served, oldest first."""
        if not bundles or bundles[0] == self.bundle:
            return
        fd = _open_log(bundles[0])
        self.acquire()   # (emit runs under this lock: no line goes to a closed or reused fd)
        try:
            old, self.fd, self.bundle = self.fd, fd, bundles[0]
        finally:
            self.release()
        if old is not None:
            os.close(old)


def setup_logging(bundle: str, debug: bool) -> _FifoHandler:
    handler = _FifoHandler(bundle, _open_log(bundle))
    handler.setFormatter(logging.Formatter(
        "time=%(asctime)s level=%(levelname)s msg=%(message)s runtime=io.containerd.quark.v1 pid=%(process)d"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if debug else logging.INFO)
    return handler


def serve(listener: socket.socket, address: str, namespace: str, bundle: str, debug: bool,
          scope: str = "pod") -> int:
    handler = setup_logging(bundle, debug)
    publisher = Publisher(os.environ.get("TTRPC_ADDRESS", ""), namespace)
    done = threading.Event()
    # the inode of our socket file: a new shim for the same id may replace the file while we
    # linger after Shutdown, and then it is not ours to remove
    try:
        bound_ino = os.stat(socket_path(address)).st_ino
    except FileNotFoundError:
        bound_ino = None
    node = scope == "node"
    if node:
        os.chdir("/")   # it outlives the bundle it was started in
        _raise_open_files_limit()
    server = Server(listener, NODE_MAX_CONNECTIONS if node else MAX_CONNECTIONS)
    if node:
        on_shutdown = _ExitWhenIdle(server, address, bound_ino, done, lambda: service.idle_seconds()).kick
    else:
        def on_shutdown() -> None:   # a pod's shim: once the answer has left
            threading.Timer(SHUTDOWN_GRACE_S, done.set).start()
    service = TaskService(Quark(paths.quark_root(bundle, namespace)), publisher.publish, namespace,
                          on_shutdown=on_shutdown, on_containers=handler.follow)
    service.register(server)
    threading.Thread(target=server.serve_forever, daemon=True, name="accept").start()
    log.info("serving %s for namespace %s (one shim per %s)", address, namespace, scope)
    done.wait()
    server.close()
    _remove_socket(address, bound_ino)
    publisher.close()
    log.info("shim exiting")
    return 0


def _remove_socket(address: str, bound_ino: int | None) -> None:
    try:
        if os.stat(socket_path(address)).st_ino == bound_ino:
            os.unlink(socket_path(address))
    except FileNotFoundError:
        pass


def _raise_open_files_limit() -> None:
    # each container served holds a connection, its stdio fifos and an OOM eventfd
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 1 << 20), hard))
        except (ValueError, OSError):
            pass


class _ExitWhenIdle:
    """The node's shim's way out: after a Shutdown, once it has served no container and answered no
    call for NODE_IDLE_S, it removes its socket and stops accepting under the lock `start` holds."""

    def __init__(self, server: Server, address: str, bound_ino: int | None, done: threading.Event,
                 idle_seconds: Callable[[], float | None]) -> None:
        self.server = server
        self.address = address
        self.bound_ino = bound_ino
        self.done = done
        self.idle_seconds = idle_seconds   # the Task service's (None while it serves a container)
        self._kicked = threading.Event()
        self._thread: threading.Thread | None = None

    def kick(self) -> None:
        self._kicked.set()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True, name="idle-exit")
            self._thread.start()

    def _run(self) -> None:
        while True:
            self._kicked.wait()
            self._kicked.clear()   # a Shutdown from now on looks again after this look
            while True:
                idle = self.idle_seconds()
                if idle is None:   # serving a container: its Shutdown will kick again
                    break
                if idle < NODE_IDLE_S:
                    time.sleep(NODE_IDLE_S - idle)
                    continue
                with paths.sockets_locked():
                    idle = self.idle_seconds()
                    if idle is None or idle < NODE_IDLE_S:
                        continue
                    _remove_socket(self.address, self.bound_ino)   # a `start` from now on makes a shim
                    self.server.close()
                self.done.set()
                return
