"""The per-sandbox supervisor: one process per container, started by `quark create`.

It forks the container's init (sandbox.py), puts it in its cgroup, runs the runtime-side hooks,
then owns the container for its whole life: it is the init's parent (a child subreaper), reaps it
and every exec'd process, records exit statuses in the state file, serves the control socket the
CLI talks to (start, exec, wait), and hosts QKernel, which services the seccomp listener.
Under a runc-driving manager that reaps the init itself (containerd's runc shim, conmon), the
manager is the parent instead and exit statuses come from pidfds (see _choose_reaper).
Everything runs on one single-threaded event loop (see eventloop.py for why).
"""
from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import signal
import socket
import time
from typing import Any, NoReturn

from qvisor import cgroups, channel, confine, hooks, rootfs, sandbox
from qvisor.devices import cgroup_resources
from qvisor import linux as L
from qvisor.errors import InvalidArgument, InvalidState, NotFound, QuarkError, SetupError, from_kind
from qvisor.eventloop import Loop
from qvisor.spec import Spec, parse_process
from qvisor.state import CREATED, RUNNING, SOCK_NAME, STOPPED, ContainerState, StateStore, now_rfc3339

log = logging.getLogger("quark.supervisor")
_WALL = 0x40000000  # __WALL: also wait for tasks the ptrace platform traces
# runc-compatible managers that reap the container's init themselves (see Supervisor._choose_reaper)
RUNC_MANAGERS = ("containerd-shim-runc", "conmon")
REAP_WAIT_S = 10
UNKNOWN_EXIT = 255   # the exit status of a process reaped by the caller on a kernel without PIDFD_GET_INFO
# exits of exec'd processes kept for a wait that has not come yet (`quark exec -d` whose caller
# never waits): bounded, so such execs cannot grow the table for the container's whole life
MAX_KEPT_EXITS = 1024


def exit_code(status: int) -> int:
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


@dataclasses.dataclass
class _Child:
    """A process being created: stage 1 (namespaces) then the process itself."""
    sock: socket.socket
    on_msg: Any
    stage1_pid: int = 0
    pid: int = 0
    client: socket.socket | None = None        # exec: the CLI connection waiting for the pid
    console: list[int] = dataclasses.field(default_factory=list)  # exec: pty master for the client
    pidfd: int = -1  # exec: the process, held until it is reaped; signals go through it, never the pid


def _numbered_from(sock: socket.socket, lowest: int) -> socket.socket:
    """`sock`, moved to an fd number >= lowest if it has a lower one."""
    if sock.fileno() >= lowest:
        return sock
    moved = socket.socket(fileno=fcntl.fcntl(sock.fileno(), fcntl.F_DUPFD_CLOEXEC, lowest))
    sock.close()
    return moved


def _child_log(msg: dict) -> None:
    """A forked child's log record (it has no fd of our log file): into our log."""
    level = msg.get("level")
    logging.getLogger(str(msg.get("logger", "quark"))).log(
        level if isinstance(level, int) else logging.WARNING, "%s", msg.get("message"))


class Supervisor:
    def __init__(self, store: StateStore, state: ContainerState, spec: Spec, platform: str,
                 console_socket: str, ready_fd: int, launcher_pid: int = 0, preserve_fds: int = 0) -> None:
        self.store, self.state, self.spec = store, state, spec
        self.preserve_fds = preserve_fds       # the caller's fds 3.. that go to the init (--preserve-fds)
        self.platform, self.console_socket, self.ready_fd = platform, console_socket, ready_fd
        self.loop = Loop()
        self.cgroup = cgroups.open_cgroup(state.cgroup_path)
        self.kernel: Any = None
        self.init: _Child | None = None
        self.pending_start: socket.socket | None = None
        self.waiters: dict[int, list[socket.socket]] = {}
        self.exits: dict[int, tuple[int, str]] = {}   # exec pid -> exit no wait has collected yet
        self.execs: dict[int, _Child] = {}
        self.control: socket.socket | None = None
        self.clients: dict[int, tuple[socket.socket, channel.LineReader]] = {}
        self.launcher_pid = launcher_pid       # the process that forked us and exits at once
        self.caller_reaps = False              # see _choose_reaper
        self.exit_statuses = True              # caller reaps: statuses come from pidfds (6.15+)
        self.killing = False                   # the cgroup's processes are being killed (_kill_rest)

    # ---- life cycle -------------------------------------------------------------------------

    def main(self) -> NoReturn:
        try:
            self._setup_process()
            self._create()
            while self.ready_fd >= 0:
                self.loop.run_once()
        except Exception as e:  # tell `quark create`, and never leave half a sandbox behind
            log.exception("create failed")
            self._abort(e)
            os._exit(1)
        while not self._done():
            try:
                self.loop.run_once()
            except Exception:  # one bad request or hook must not orphan a running container
                log.exception("supervisor loop")
        if self.kernel is not None:
            self.kernel.close()   # and the sandbox's tsord session (TSoR) with it
        try:
            os.unlink(self.store.path(self.state.id, SOCK_NAME))
        except OSError:
            pass
        os._exit(0)

    def _setup_process(self) -> None:
        self.caller_reaps = self._choose_reaper()
        if not self.caller_reaps:
            L.prctl(L.PR_SET_CHILD_SUBREAPER, 1)
        for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_IGN)
        r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.loop.add_reader(r, lambda: (self._drain(r), self._reap()))

    def _choose_reaper(self) -> bool:
        """Who becomes the parent of the container's processes.

        By default the supervisor (a child subreaper) does, and reaps them. A manager that drives
        quark as a runc-compatible binary (containerd's runc shim with BinaryName, conmon) is a
        child subreaper itself and waits for the init it was told about in --pid-file, as it does
        with runc: then the container's processes go to it (the supervisor is no subreaper, so
        they are re-parented past it when their first stage exits), and the supervisor learns
        their exit statuses from their pidfds once the manager has reaped them (qvisor/pidfs.py).
        QUARK_INIT_REAPER=caller|supervisor overrides the choice."""
        from qvisor import pidfs
        deadline = time.monotonic() + 1.0
        while self.launcher_pid and os.getppid() == self.launcher_pid and time.monotonic() < deadline:
            time.sleep(0.0002)   # the launcher exits right after forking us
        choice = os.environ.get("QUARK_INIT_REAPER", "")
        if choice == "supervisor":
            return False
        adopter = os.getppid()
        if choice != "caller":
            if adopter in (0, 1):
                return False   # nobody adopts orphans above us
            try:
                name = os.path.basename(os.readlink(f"/proc/{adopter}/exe"))
            except OSError:
                return False
            if not name.startswith(RUNC_MANAGERS):
                return False
        # Before Linux 6.15 (no PIDFD_GET_INFO) the caller still reaps, as it must to learn the exits
        # it waits for, and the supervisor learns only that a process ended (its pidfd turns readable).
        self.exit_statuses = pidfs.supported()
        if not self.exit_statuses:
            log.info("this kernel cannot report exit statuses through pidfds (Linux 6.15+): the caller "
                     "has them; quark records %d for each", UNKNOWN_EXIT)
        log.info("the container's processes go to pid %d, which reaps them", adopter)
        return True

    def _watch_exit(self, pid: int) -> None:
        """(caller reaps) Learn when `pid` exits and, once reaped by its parent, its status."""
        try:
            fd = L.pidfd_open(pid)
        except OSError:
            return self._exited(pid, 255)   # already gone and reaped: the status is lost
        self.loop.add_reader(fd, lambda: self._pidfd_readable(pid, fd, time.monotonic()))

    def _pidfd_readable(self, pid: int, fd: int, since: float) -> None:
        from qvisor import pidfs
        if not self.exit_statuses:   # an old kernel: the process ended, its status is the reaper's
            self.loop.remove_reader(fd)
            os.close(fd)
            if self._running(pid):
                self._exited(pid, UNKNOWN_EXIT)
            return
        status = pidfs.exit_status(fd)
        if status is None:   # exited, not reaped yet: the pidfd stays readable, so look again later
            self.loop.remove_reader(fd)
            if time.monotonic() - since > REAP_WAIT_S:
                log.warning("process %d exited but its parent did not reap it in %ds", pid, REAP_WAIT_S)
                os.close(fd)
                if self._running(pid):
                    self._exited(pid, 255)
                return
            self.loop.call_later(0.002, lambda: self._pidfd_readable(pid, fd, since))
            return
        if self.loop.has_reader(fd):
            self.loop.remove_reader(fd)
        os.close(fd)
        if self._running(pid):   # the ptrace platform may have seen the exit first
            self._exited(pid, exit_code(status))

    def _done(self) -> bool:
        return self.state.status == STOPPED and not self.execs and not self.killing

    @staticmethod
    def _drain(fd: int) -> None:
        try:
            while os.read(fd, 512):
                pass
        except BlockingIOError:
            pass

    # ---- create ------------------------------------------------------------------------------

    def _create(self) -> None:
        self.cgroup.create()
        self.cgroup.apply(cgroup_resources(self.spec))
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:
            parent.close()
            sandbox.run_child(child, lambda: sandbox.stage1(child, self.spec, self.preserve_fds))
        child.close()
        os.closerange(3, 3 + self.preserve_fds)   # stage 1 has them for the init: none are ours to keep
        self.init = _Child(parent, self._on_init_msg, stage1_pid=pid)
        # the container's stdio now live in stage 1 and the init; ours go to /dev/null so that
        # a caller reading them sees EOF when the container, not the runtime, closes them
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.close(null)
        self.cgroup.add_pid(pid)
        channel.send(parent, {"type": "go"})
        self.loop.add_reader(parent.fileno(), lambda: self._on_child_readable(self.init))

    def _on_child_readable(self, child: _Child) -> bool:
        """Dispatch one message; False if there was none (an exit's _drain_child read it first)."""
        try:
            msg, fds = channel.recv_packet(child.sock)
        except BlockingIOError:
            return False
        except (channel.ChannelClosed, ConnectionResetError):
            self.loop.remove_reader(child.sock.fileno())
            child.on_msg(child, {"type": "eof"}, [])
            return True
        child.on_msg(child, msg, fds)
        return True

    def _drain_child(self, child: _Child) -> None:
        """Dispatch what a child has left in its channel (a dead one's, up to its EOF)."""
        if child.sock.fileno() < 0:
            return
        child.sock.setblocking(False)
        while child.sock.fileno() >= 0 and self.loop.has_reader(child.sock.fileno()):
            if not self._on_child_readable(child):
                return

    def _hook_state(self) -> dict:
        return self.state.oci() | {"status": self.state.status, "pid": self.state.pid}

    def _on_init_msg(self, child: _Child, msg: dict, fds: list[int]) -> None:
        kind = msg.get("type")
        if kind == "log":
            return _child_log(msg)
        if kind == "userns":
            self._write_id_maps(child.stage1_pid)
            channel.send(child.sock, {"type": "userns-ok"})
        elif kind == "pid":
            child.pid = msg["pid"]
            self.state.pid = child.pid
            self.state.pid_start_time = L.proc_start_time(child.pid) or 0
            if self.caller_reaps:
                self._watch_exit(child.pid)
            self._start_kernel(child.pid)
            self._send_prepare(child)
        elif kind == "create-runtime":
            st = self._hook_state()
            hooks.run_hooks("prestart", self.spec.hooks.prestart, st)
            hooks.run_hooks("createRuntime", self.spec.hooks.create_runtime, st)
            channel.send(child.sock, {"type": "create-runtime-ok", "state": st})
        elif kind == "console":
            self._forward_console(fds[0], msg.get("name", ""))
        elif kind == "procview":
            self._serve_procview(child)
        elif kind == "created":
            self.state.status = CREATED
            self.store.save(self.state)
            self._open_control()
            # from here on the supervisor serves the container: hold only what that needs (before
            # the report: if this fails, create fails and leaves nothing; it costs ~1.3 ms)
            confine.confine_supervisor(self.platform, self.spec.process.capabilities,
                                       allow_chroot=not self.spec.linux.new_namespace("mount"))
            self._report({"ok": True, "pid": child.pid})
        elif kind == "listener":
            self.kernel.serve_listener(fds[0])
        elif kind == "error":
            if self.ready_fd >= 0:
                raise from_kind(msg.get("kind"), msg["error"])
            self._start_done(from_kind(msg.get("kind"), msg["error"]))
        elif kind == "eof":
            if self.ready_fd >= 0:
                raise RuntimeError("container init exited during set-up")
            if self.pending_start is not None:
                self._start_done(None)

    def _send_prepare(self, child: _Child) -> None:
        # in a user namespace the init is a mapped uid: bind sources are opened here, as host root
        fds = rootfs.bind_sources(self.spec) if self.spec.linux.namespace("user") else {}
        try:
            if len(fds) > channel.MAX_FDS:
                raise SetupError(f"mounts: at most {channel.MAX_FDS} bind mounts in a container with a user "
                                 "namespace")
            channel.send(child.sock, {"type": "prepare", "cgroup_path": self.state.cgroup_path,
                                      "source_fds": list(fds)}, list(fds.values()))
        finally:
            for fd in fds.values():
                os.close(fd)

    def _serve_procview(self, child: _Child) -> None:
        """The init asks for the container's /proc view (qvisor/procview.py): serve it on our loop
        and send the filesystem for the init to bind in, or nothing, and the container goes without."""
        from qvisor import procview
        try:
            mnt = procview.serve(self.loop, self.cgroup, child.pid, self.state.pid_start_time)
        except OSError as e:
            log.warning("the container's /proc view is off: it sees the host's /proc/meminfo, cpuinfo, ... (%s; "
                        "annotation %s=false skips the view)", e, procview.ANNOTATION)
            return channel.send(child.sock, {"type": "procview-ok"})
        try:
            channel.send(child.sock, {"type": "procview-ok"}, [mnt])
        finally:
            os.close(mnt)

    def _write_id_maps(self, pid: int) -> None:
        for name, maps in (("uid_map", self.spec.linux.uid_mappings), ("gid_map", self.spec.linux.gid_mappings)):
            text = "".join(f"{m.container_id} {m.host_id} {m.size}\n" for m in maps)
            with open(f"/proc/{pid}/{name}", "w") as f:
                f.write(text)

    def _start_kernel(self, init_pid: int) -> None:
        import qkernel
        ctx = qkernel.SandboxContext(container_id=self.state.id, cgroup=self.cgroup, init_pid=init_pid)
        self.kernel = qkernel.Kernel(self.loop, self.platform, ctx)
        if self.platform == "ptrace":
            self.kernel.attach(init_pid)   # no fd installation there, so no TSoR: sockets stay native
        elif self.kernel.can_install_fds:
            # TSoR: register with the node's tsord (None: no tsord socket, or the host's network)
            from tsor.sandbox import SandboxNet
            ctx.tsor = SandboxNet.attach(self.loop, self.state.id, init_pid, self.cgroup.pids,
                                         self.spec.annotations)

    def _forward_console(self, master: int, name: str) -> None:
        """Send the pty master to --console-socket (runc's protocol: one fd with the pty name)."""
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(self.console_socket)
                socket.send_fds(s, [name.encode() or b"/dev/ptmx"], [master])
        finally:
            os.close(master)

    def _report(self, msg: dict) -> None:
        """Tell the waiting `quark create` how it went; it exits on this line."""
        try:
            os.write(self.ready_fd, json.dumps(msg).encode() + b"\n")
        except OSError:
            pass
        os.close(self.ready_fd)
        self.ready_fd = -1

    def _abort(self, error: Exception) -> None:
        """A failed create leaves nothing: no process, no cgroup, no state directory."""
        for pid in (self.init.pid, self.init.stage1_pid) if self.init else ():
            if pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        try:
            self.cgroup.kill_all(signal.SIGKILL)
        except OSError:
            pass
        while True:
            try:
                os.waitpid(-1, _WALL)
            except ChildProcessError:
                break
        try:
            self.cgroup.destroy()
        except Exception:
            log.exception("destroying cgroup after failed create")
        self.store.remove(self.state.id)
        self._report({"error": str(error), "kind": getattr(error, "kind", QuarkError.kind)})

    # ---- control socket ----------------------------------------------------------------------

    def _open_control(self) -> None:
        path = self.store.path(self.state.id, SOCK_NAME)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        s.bind(path)
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
                self._start(conn)
            elif op == "wait":
                self._wait(conn, msg.get("pid") or self.state.pid)
            elif op == "exec":
                self._exec(conn, msg, fds)
            elif op == "signal":
                self._signal(conn, msg.get("pid"), msg.get("signal"))
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

    def _start(self, conn: socket.socket) -> None:
        if self.state.status != CREATED or self.pending_start is not None:
            return self._fail(conn, InvalidState(f"cannot start a container in state {self.state.status}"))
        self.pending_start = conn
        self.state.status = RUNNING  # the hooks' state says running from startContainer on
        channel.send(self.init.sock, {"type": "start", "state": self._hook_state(), "platform": self.platform})

    def _start_done(self, error: QuarkError | None) -> None:
        conn, self.pending_start = self.pending_start, None
        if error is None:
            self.store.save(self.state)
        if conn is None:
            return
        if error is None:
            self._reply(conn, {"ok": True})   # poststart hooks run in `quark start`, as runc does
        else:
            self._fail(conn, error)

    # ---- exec --------------------------------------------------------------------------------

    def _exec(self, conn: socket.socket, msg: dict, fds: list[int]) -> None:
        """Start an exec'd process; `fds` are its stdio (none with a terminal) then the caller's
        preserved fds (msg["preserve_fds"] of them)."""
        if self.state.status != RUNNING:
            return self._fail(conn, InvalidState(f"cannot exec in a container in state {self.state.status}"))
        try:
            proc = parse_process(msg.get("process"), "process.json")
        except Exception as e:
            return self._fail(conn, e if isinstance(e, QuarkError) else InvalidArgument(f"process.json: {e}"))
        n = msg.get("preserve_fds", 0)
        if type(n) is not int or not 0 <= n <= len(fds):
            return self._fail(conn, InvalidArgument(f"exec: preserve_fds: {n!r} does not fit the {len(fds)} fds sent"))
        stdio, preserved = fds[:len(fds) - n], fds[len(fds) - n:]
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        child = _numbered_from(child, 3 + n)   # the preserved fds take 3.. in the child
        pid = os.fork()
        if pid == 0:
            parent.close()
            for i, fd in enumerate(stdio):
                os.dup2(fd, i, inheritable=True)
            sandbox.run_child(child, lambda: sandbox.exec_stage1(child, self.state.pid, self.spec, proc, preserved))
        child.close()
        ex = _Child(parent, self._on_exec_msg, stage1_pid=pid, client=conn)
        self.execs[pid] = ex
        self.cgroup.add_pid(pid)
        channel.send(parent, {"type": "go"})
        self.loop.add_reader(parent.fileno(), lambda: self._on_child_readable(ex))

    def _on_exec_msg(self, ex: _Child, msg: dict, fds: list[int]) -> None:
        kind = msg.get("type")
        if kind == "log":
            return _child_log(msg)
        if kind == "pid":
            ex.pid = msg["pid"]
            self.execs[ex.pid] = self.execs.pop(ex.stage1_pid)
            self.exits.pop(ex.pid, None)   # kept for an earlier process with this pid: stale now
            try:
                ex.pidfd = L.pidfd_open(ex.pid)   # it waits for "start", so this is still our process
            except ProcessLookupError:
                # killed before it was told to start, and already reaped: by us (then we are in
                # _exited for it, which finishes it) or by the manager that reaps for us
                if self.caller_reaps:
                    self._exited(ex.pid, 255)
                return
            if self.caller_reaps:
                self._watch_exit(ex.pid)
            if self.platform == "ptrace":
                self.kernel.attach(ex.pid)
            channel.send(ex.sock, {"type": "start", "platform": self.platform})
        elif kind == "console":
            ex.console.extend(fds)
        elif kind == "listener":
            self.kernel.serve_listener(fds[0])
        elif kind in ("error", "eof"):
            if ex.client is None:
                return
            if kind == "error":
                reply = {"error": msg["error"], "kind": msg.get("kind", QuarkError.kind)}
            elif ex.pid == 0:
                reply = {"error": "exec: process setup failed", "kind": QuarkError.kind}
            else:
                reply = {"ok": True, "pid": ex.pid}
            self._reply(ex.client, reply, ex.console)
            for fd in ex.console:
                os.close(fd)
            ex.client, ex.console = None, []

    # ---- exits -------------------------------------------------------------------------------

    def _wait(self, conn: socket.socket, pid: int) -> None:
        """Answer with `pid`'s exit once it has one. The init's stays in the state for every wait;
        an exec'd process's goes to the waits that are there when it exits, else to the first
        one that comes (the shim's, right after `quark exec -d`), and is then forgotten."""
        if pid == self.state.pid and self.state.status == STOPPED:
            return self._reply(conn, _exit_reply(pid, self.state.exit_status, self.state.exited_at))
        if pid in self.exits:
            return self._reply(conn, _exit_reply(pid, *self.exits.pop(pid)))
        if not self._running(pid):
            return self._fail(conn, NotFound(f"process {pid} is not a running process of this container "
                                             "(or its exit status was collected already)"))
        self.waiters.setdefault(pid, []).append(conn)

    def _running(self, pid: int) -> bool:
        """Whether `pid` is the container's init or an exec'd process, not yet reaped."""
        if pid == self.state.pid:
            return self.state.status != STOPPED
        ex = self.execs.get(pid)
        return ex is not None and ex.pid == pid

    def _signal(self, conn: socket.socket, pid: object, sig: object) -> None:
        """Signal an exec'd process through the pidfd held since its start: once it is reaped its
        pid may name another process, which the caller (the shim) cannot tell from here."""
        if type(sig) is not int or type(pid) is not int:
            return self._fail(conn, InvalidArgument(f"signal: pid {pid!r} and signal {sig!r} must be numbers"))
        ex = self.execs.get(pid)
        if ex is None or ex.pid != pid or ex.pidfd < 0:
            return self._fail(conn, NotFound(f"process {pid} is not a running process of this container"))
        try:
            L.pidfd_send_signal(ex.pidfd, sig)
        except ProcessLookupError:   # reaped by the manager that reaps for us: its exit is on the way
            return self._fail(conn, NotFound(f"process {pid} has exited"))
        except OSError as e:
            return self._fail(conn, InvalidArgument(f"signal {sig}: {e.strerror}"))
        self._reply(conn, {"ok": True})

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG | _WALL)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if self.kernel is not None and self.kernel.on_child_status(pid, status):
                continue
            if os.WIFSTOPPED(status):
                continue
            self._exited(pid, exit_code(status))

    def _kill_rest(self) -> None:
        """Kill what is left in the cgroup without holding the loop: freezing can take seconds to
        settle, so each step of the kill runs on a timer (trapped syscalls and requests of the
        remaining processes are served meanwhile)."""
        steps = self.cgroup.kill_steps(signal.SIGKILL)
        self.killing = True

        def step() -> None:
            try:
                pause = next(steps)
            except StopIteration:
                self.killing = False
                return
            except (OSError, QuarkError) as e:
                log.warning("killing the container's remaining processes: %s", e)
                self.killing = False
                return
            self.loop.call_later(pause, step)
        step()

    def _exited(self, pid: int, code: int) -> None:
        at = now_rfc3339()
        if self.init is not None and pid == self.init.pid:
            log.info("init %d exited with %d", pid, code)
            self._drain_child(self.init)  # its last words (an error) come before the exit
            if self.ready_fd >= 0:
                raise RuntimeError(f"container init exited with status {code} during set-up")
            self.state.status = STOPPED
            self.state.exit_status, self.state.exited_at = code, at
            self.store.save(self.state)
            if self.pending_start is not None:
                self._start_done(QuarkError(f"container process exited with status {code} before it started"))
            # processes left in a container that shares the host pid namespace die with its init
            self._kill_rest()
        elif pid in self.execs and self.execs[pid].pid == pid:
            ex = self.execs.pop(pid)
            self._drain_child(ex)
            ex.sock.close()
            if ex.pidfd >= 0:
                os.close(ex.pidfd)
            if not self.waiters.get(pid):
                self._keep_exit(pid, code, at)
        elif pid in self.execs and self.execs[pid].pid == 0:
            # an exec's stage 1: its "pid" message may still be queued; if it never forked the
            # process (setns or fork failed), the exec is over and must not keep us alive
            ex = self.execs[pid]
            self._drain_child(ex)
            if ex.pid == 0:
                del self.execs[pid]
                if ex.client is not None:
                    self._on_exec_msg(ex, {"type": "eof"}, [])
                ex.sock.close()
        else:
            # not a process we know: a stage 1 whose process was reported, an orphan the container
            # left us. Or an exec'd process whose "pid" message is still queued (stage 1 sends it
            # before it exits, and only then does its process become our child): read those first.
            pending = [ex for ex in self.execs.values() if ex.pid == 0]
            for ex in pending:
                self._drain_child(ex)
            if any(ex.pid == pid for ex in pending):
                return self._exited(pid, code)
        for conn in self.waiters.pop(pid, []):
            self._reply(conn, _exit_reply(pid, code, at))

    def _keep_exit(self, pid: int, code: int, at: str) -> None:
        """Keep an exec'd process's exit for the wait still to come, at most MAX_KEPT_EXITS."""
        if len(self.exits) >= MAX_KEPT_EXITS:
            oldest = next(iter(self.exits))
            del self.exits[oldest]
            log.warning("forgetting the exit status of process %d: no one waited for it", oldest)
        self.exits[pid] = (code, at)


def _exit_reply(pid: int, code: int | None, at: str | None) -> dict:
    return {"pid": pid, "exit_status": code, "exited_at": at}
