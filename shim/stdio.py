"""A process's stdio as containerd hands it over: fifo paths, `binary://` loggers, `file://` logs, ptys.

Without a terminal, stdout and stderr fifos are opened O_RDWR (the open never blocks, and the
container never gets EPIPE when the client goes away) and given to the container directly: the
reader sees EOF once the container's last writer closes, with no copy through the shim. stdin is
copied from its fifo into a pipe, so CloseIO and the client's close reach the container as EOF.
With a terminal, the pty master arrives on a console socket and two threads copy between it and
the fifos.
"""
from __future__ import annotations

import array
import fcntl
import logging
import os
import select
import socket
import struct
import tempfile
import termios
import threading
from urllib.parse import parse_qsl, urlparse

from shim.runtime import Stdio
from shim.ttrpc import Code, RpcError

log = logging.getLogger("quark.shim.stdio")

BINARY_READY_TIMEOUT_S = 10.0


class ProcessIO:
    """The stdio of one container process, from creation until the process has exited."""

    def __init__(self, stdin: str, stdout: str, stderr: str, terminal: bool,
                 container_id: str, namespace: str) -> None:
        self.paths = (stdin, stdout, stderr)
        self.terminal = terminal
        self._to_close_after_spawn: list[int] = []
        self._stdin_w: int | None = None
        self._stdin_lock = threading.Lock()
        self._console: socket.socket | None = None
        self._console_dir: str | None = None
        self.master: int | None = None
        self._out_done = threading.Event()
        self._logger: int | None = None   # the logging binary's pid
        self._out_fd: int | None = None
        try:
            if terminal:
                self._console_dir = tempfile.mkdtemp(prefix="qshim-pty-")
                self.console_path = os.path.join(self._console_dir, "pty.sock")
                self._console = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self._console.bind(self.console_path)
                self._console.listen(1)
                null = self._keep(os.open(os.devnull, os.O_RDWR))
                self.fds = Stdio(null, null, null)
            else:
                self.console_path = None
                self.fds = Stdio(self._stdin_fd(stdin), *self._output_fds(stdout, stderr, container_id, namespace))
                self._out_done.set()
        except BaseException:
            self.close()
            raise

    def _keep(self, fd: int) -> int:
        self._to_close_after_spawn.append(fd)
        return fd

    def _stdin_fd(self, path: str) -> int:
        if not path:
            return self._keep(os.open(os.devnull, os.O_RDONLY))
        r, w = os.pipe()
        self._keep(r)
        self._stdin_w = w
        threading.Thread(target=self._copy_stdin, args=(path,), daemon=True, name="stdin").start()
        return r

    def _output_fds(self, stdout: str, stderr: str, cid: str, ns: str) -> tuple[int, int]:
        if stdout.startswith("binary://"):
            return self._binary_logger(stdout, cid, ns)
        if stdout.startswith("file://"):
            path = urlparse(stdout).path
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd = self._keep(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o640))
            return fd, fd
        return self._open_output(stdout), self._open_output(stderr)

    def _open_output(self, path: str) -> int:
        if not path:
            return self._keep(os.open(os.devnull, os.O_WRONLY))
        try:
            return self._keep(os.open(path, os.O_RDWR | os.O_CLOEXEC))
        except OSError as e:
            raise RpcError(Code.INVALID_ARGUMENT, f"cannot open stdio {path}: {e.strerror}") from None

    def _binary_logger(self, uri: str, cid: str, ns: str) -> tuple[int, int]:
        """containerd's binary logging protocol: fds 3 and 4 carry stdout and stderr, 5 says ready."""
        u = urlparse(uri)
        args: list[str] = []
        for k, v in parse_qsl(u.query, keep_blank_values=True):
            args += [k, v] if v else [k]
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        ready_r, ready_w = os.pipe()
        self._keep(out_w)
        self._keep(err_w)
        env = dict(os.environ, CONTAINER_ID=cid, CONTAINER_NAMESPACE=ns)
        # the ends go to 3, 4 and 5 by dup2 in the child, from copies above any of those numbers (a
        # source may be 3, 4 or 5 itself); posix_spawn's file actions do it without a Python
        # callback in the child, and need none of 3, 4, 5 open here (Popen's pass_fds does)
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in (out_r, err_r, ready_w)]
        try:
            self._logger = os.posix_spawn(u.path, [u.path, *args], env, setsid=True, file_actions=[
                (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
                (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0),
                *((os.POSIX_SPAWN_DUP2, fd, target) for fd, target in zip(high, (3, 4, 5)))])
        except OSError as e:
            for fd in (out_r, err_r, ready_r, ready_w):
                os.close(fd)
            raise RpcError(Code.INVALID_ARGUMENT, f"cannot start logging binary {u.path}: {e.strerror}") from None
        finally:
            for fd in high:
                os.close(fd)
        for fd in (out_r, err_r, ready_w):
            os.close(fd)
        threading.Thread(target=os.waitpid, args=(self._logger, 0), daemon=True, name="logger-reaper").start()
        try:
            ready, _, _ = select.select([ready_r], [], [], BINARY_READY_TIMEOUT_S)
            if not ready:
                raise RpcError(Code.DEADLINE_EXCEEDED, f"logging binary {u.path} did not signal ready")
        finally:
            os.close(ready_r)
        return out_w, err_w

    def close_after_spawn(self) -> None:
        """The CLI process holds the container's ends now; the shim lets go of its copies."""
        fds, self._to_close_after_spawn = set(self._to_close_after_spawn), []
        for fd in fds:
            os.close(fd)

    def receive_console(self, timeout: float = 10.0) -> None:
        """Take the pty master quark sent to the console socket and start copying."""
        assert self._console is not None
        self._console.settimeout(timeout)
        try:
            conn, _ = self._console.accept()
        except OSError as e:
            raise RpcError(Code.UNKNOWN, f"no pty master arrived on {self.console_path}: {e}") from None
        with conn:
            fds = array.array("i")
            _msg, ancdata, _flags, _addr = conn.recvmsg(4096, socket.CMSG_SPACE(4 * fds.itemsize))
            for level, kind, data in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
        if not fds:
            raise RpcError(Code.UNKNOWN, f"console socket {self.console_path} got no fd")
        self.master = fds[0]
        for extra in fds[1:]:
            os.close(extra)
        self._close_console_socket()
        stdin, stdout, _ = self.paths
        if stdout:
            self._out_fd = os.open(stdout, os.O_RDWR | os.O_CLOEXEC)
            threading.Thread(target=self._copy_master_out, daemon=True, name="pty-out").start()
        else:
            self._out_done.set()
        if stdin:
            threading.Thread(target=self._copy_stdin, args=(stdin,), daemon=True, name="pty-in").start()

    def resize(self, width: int, height: int) -> None:
        if self.master is None:
            return
        fcntl.ioctl(self.master, termios.TIOCSWINSZ, struct.pack("HHHH", height, width, 0, 0))

    def close_stdin(self) -> None:
        with self._stdin_lock:
            if self._stdin_w is not None:
                os.close(self._stdin_w)
                self._stdin_w = None

    def wait_output(self, timeout: float) -> None:
        """Let the pty copier drain what the process wrote before its exit is reported."""
        self._out_done.wait(timeout)

    def close(self) -> None:
        self.close_after_spawn()
        self.close_stdin()
        self._close_console_socket()

    def _close_console_socket(self) -> None:
        if self._console is not None:
            self._console.close()
            self._console = None
        if self._console_dir is not None:
            for name in os.listdir(self._console_dir):
                os.unlink(os.path.join(self._console_dir, name))
            os.rmdir(self._console_dir)
            self._console_dir = None

    def _copy_stdin(self, path: str) -> None:
        try:
            src = os.open(path, os.O_RDONLY | os.O_CLOEXEC)  # blocks until the client opens its end
        except OSError as e:
            log.warning("cannot open stdin %s: %s", path, e)
            self.close_stdin()
            return
        try:
            while True:
                data = os.read(src, 65536)
                if not data:
                    break
                with self._stdin_lock:
                    dst = self.master if self.terminal else self._stdin_w
                    if dst is None:
                        break
                    _write_all(dst, data)
        except OSError as e:
            log.debug("stdin copy from %s ended: %s", path, e)
        finally:
            os.close(src)
            if not self.terminal:
                self.close_stdin()

    def _copy_master_out(self) -> None:
        assert self.master is not None and self._out_fd is not None
        try:
            while True:
                try:
                    data = os.read(self.master, 65536)
                except OSError:  # EIO: the last slave fd closed, the process is gone
                    break
                if not data:
                    break
                _write_all(self._out_fd, data)
        except OSError as e:
            log.debug("pty output copy ended: %s", e)
        finally:
            os.close(self._out_fd)
            self._out_fd = None
            self._out_done.set()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
