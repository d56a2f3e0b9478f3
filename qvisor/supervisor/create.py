"""Creating the container: fork the init's stage 1, put it in its
cgroup, answer its set-up messages (id maps, the prepare message with bind sources, hooks,
console, the /proc view, QKernel and its listener), report to the waiting `quark create`, and
leave nothing behind if any of it fails.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import signal
import socket
from collections.abc import Callable

from qlib.errors import QuarkError, SetupError, from_kind
from qvisor import channel, confine, hooks, rootfs, sandbox
from qlib import procfs
from qvisor.devices import cgroup_resources
from qvisor.state import CREATED
from qvisor.supervisor import child as children
from qvisor.supervisor.child import Child, child_log
from qvisor.supervisor.context import Container
from qvisor.supervisor.control import Control
from qvisor.supervisor.reaper import WAIT_ALL, Reaper
from qvisor.supervisor.start import Starter

log = logging.getLogger("quark.supervisor")


class Creation:
    """Creating the container: the init and its set-up, until `quark create` has its report."""

    def __init__(self, c: Container, reaper: Reaper, control: Control, starter: Starter, console_socket: str,
                 preserve_fds: int) -> None:
        self.c, self.reaper, self.control, self.starter = c, reaper, control, starter
        self.console_socket = console_socket   # --console-socket: where the pty master goes
        self.preserve_fds = preserve_fds       # the caller's fds 3.. that go to the init (--preserve-fds)
        self.procview_mnt: int | None = None   # the /proc view made for the init (-1: could not be)
        # a pod's container, created by the factory's worker (pod.py): once created, handed to its
        # pod's supervisor, which starts its QKernel, serves it and reports to `quark create`
        self.hand_over: Callable[[Child], None] | None = None
        self.keep_stdio = False   # (a pod's worker: its stdio stay the caller's)

    def create(self) -> None:
        self.c.cgroup.create()
        self.c.cgroup.apply(cgroup_resources(self.c.spec))
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:
            parent.close()
            sandbox.run_child(child, lambda: sandbox.stage1(child, self.c.spec, self.preserve_fds))
        child.close()
        os.closerange(3, 3 + self.preserve_fds)   # stage 1 has them for the init: none are ours to keep
        self.c.init = Child(parent, self.on_init_msg, stage1_pid=pid)
        # the container's stdio now live in stage 1 and the init; ours go to /dev/null so that
        # a caller reading them sees EOF when the container, not the runtime, closes them
        if not self.keep_stdio:
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            os.close(null)
        self.c.cgroup.add_pid(pid)
        channel.send(parent, {"type": "go"})
        children.watch(self.c.loop, self.c.init)

    def on_init_msg(self, child: Child, msg: dict, fds: list[int]) -> None:
        kind = msg.get("type")
        if kind == "log":
            return child_log(msg)
        if kind == "userns":
            self._write_id_maps(child.stage1_pid)
            channel.send(child.sock, {"type": "userns-ok"})
        elif kind == "pid":
            self.c.phases.mark("namespaces", msg.get("t"))   # stage 1 unshared them and forked the init
            child.pid = msg["pid"]
            self.c.state.pid = child.pid
            self.c.state.pid_start_time = procfs.start_time(child.pid) or 0
            if self.reaper.caller_reaps:
                self.reaper.watch_exit(child.pid)
            # the init builds its rootfs from here on: what we set up meanwhile (QKernel, the /proc
            # view it will ask for) runs beside it, not before it, so create does not wait for it
            self._send_prepare(child)
            if self.hand_over is None:   # (a handed-over container's runs in the supervisor it goes to)
                self.start_kernel(child.pid)
            self._make_procview(child)
        elif kind == "create-runtime":
            st = self.c.hook_state()
            hooks.run_hooks("prestart", self.c.spec.hooks.prestart, st)
            hooks.run_hooks("createRuntime", self.c.spec.hooks.create_runtime, st)
            channel.send(child.sock, {"type": "create-runtime-ok", "state": st})
        elif kind == "console":
            self._forward_console(fds[0], msg.get("name", ""))
        elif kind == "procview":
            self._serve_procview(child)
        elif kind == "created":
            self.c.phases.mark("rootfs", msg.get("t"))   # the init's mounts, pivot, ... are done
            self.c.state.status = CREATED
            self.c.store.save(self.c.state)
            self.control.open()
            if self.hand_over is not None:
                self.c.phases.mark("created")
                self.c.phases.write()
                return self.hand_over(child)
            # from here on the supervisor serves the container: hold only what that needs (before
            # the report: if this fails, create fails and leaves nothing; it costs create a
            # little time, within "create: state saved, control socket, supervisor confined" of
            # bench/README.md, "Start-up and supervisor memory")
            confine.confine_supervisor(self.c.platform, self.c.spec.process.capabilities,
                                       allow_chroot=not self.c.spec.linux.new_namespace("mount"),
                                       own_namespaces=self.c.spec.own_namespaces)
            self.c.phases.mark("created")
            self.c.phases.write()
            self.report({"ok": True, "pid": child.pid})
        elif kind == "listener":
            self.c.phases.mark("filter", msg.get("t"))   # the init installed its seccomp filters
            self.c.kernel.serve_listener(fds[0])
        elif kind == "error":
            if self.c.in_setup:
                raise from_kind(msg.get("kind"), msg["error"])
            self.starter.done(from_kind(msg.get("kind"), msg["error"]))
        elif kind == "eof":
            if self.c.in_setup:
                raise RuntimeError("container init exited during set-up")
            if self.starter.pending is not None:
                self.c.phases.mark("exec")   # the channel closed on exec
                self.c.phases.write()
                self.starter.done(None)

    def _send_prepare(self, child: Child) -> None:
        # in a user namespace the init is a mapped uid: bind sources are opened here, as host root
        fds = rootfs.bind_sources(self.c.spec) if self.c.spec.linux.namespace("user") else {}
        try:
            if len(fds) > channel.MAX_FDS:
                raise SetupError(f"mounts: at most {channel.MAX_FDS} bind mounts in a container with a user "
                                 "namespace")
            channel.send(child.sock, {"type": "prepare", "cgroup_path": self.c.state.cgroup_path,
                                      "source_fds": list(fds)}, list(fds.values()))
        finally:
            for fd in fds.values():
                os.close(fd)

    def _make_procview(self, child: Child) -> None:
        """Make the container's /proc view (qvisor/procview.py) before the init asks for it, when it
        will (the init's own test: rootfs.procview_wanted in a new mount namespace)."""
        if not (self.c.spec.linux.new_namespace("mount") and rootfs.procview_wanted(self.c.spec)):
            return
        from qvisor import procview
        try:
            self.procview_mnt = procview.serve(self.c.loop, self.c.cgroup, child.pid, self.c.state.pid_start_time)
        except OSError as e:
            log.warning("the container's /proc view is off: it sees the host's /proc/meminfo, cpuinfo, ... (%s; "
                        "annotation %s=false skips the view)", e, procview.ANNOTATION)
            self.procview_mnt = -1   # tried and failed: the init's request gets nothing

    def _serve_procview(self, child: Child) -> None:
        """The init asks for the container's /proc view: send the filesystem made for it (served on
        our loop) for the init to bind in, or nothing, and the container goes without."""
        if self.procview_mnt is None:   # not made ahead (cannot be: our test is the init's)
            self._make_procview(child)
        mnt, self.procview_mnt = self.procview_mnt, None
        if mnt is None or mnt < 0:
            return channel.send(child.sock, {"type": "procview-ok"})
        try:
            channel.send(child.sock, {"type": "procview-ok"}, [mnt])
        finally:
            os.close(mnt)

    def _write_id_maps(self, pid: int) -> None:
        for name, maps in (("uid_map", self.c.spec.linux.uid_mappings), ("gid_map", self.c.spec.linux.gid_mappings)):
            text = "".join(f"{m.container_id} {m.host_id} {m.size}\n" for m in maps)
            with open(f"/proc/{pid}/{name}", "w") as f:
                f.write(text)

    def start_kernel(self, init_pid: int, tsor_pid: int = 0) -> None:
        """QKernel for the container whose init is `init_pid`, and its TSoR registration, which
        names `tsor_pid` (default the init) to tsord: a process of the container's network
        namespace that descends from us (tsor/identity.py; a pod's supervisor names its sandbox's
        init for a container the factory reaps, pod.py)."""
        import qkernel
        from qvisor import procview
        ctx = qkernel.SandboxContext(container_id=self.c.state.id, init_pid=init_pid,
                                     sysinfo=functools.partial(procview.sysinfo, self.c.cgroup, init_pid))
        self.c.kernel = qkernel.Kernel(self.c.loop, self.c.platform, ctx)
        if self.c.platform == "ptrace":
            self.c.kernel.attach(init_pid)   # no fd installation there, so no TSoR: sockets stay native
        elif self.c.kernel.can_install_fds:
            # TSoR: register with the node's tsord (None: no tsord socket, or the host's network)
            from tsor.intercept import SocketIntercept
            ctx.tsor = SocketIntercept.attach(self.c.loop, self.c.state.id, tsor_pid or init_pid, self.c.cgroup.pids,
                                              self.c.spec.annotations)

    def _forward_console(self, master: int, name: str) -> None:
        """Send the pty master to --console-socket (runc's protocol: one fd with the pty name)."""
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(self.console_socket)
                socket.send_fds(s, [name.encode() or b"/dev/ptmx"], [master])
        finally:
            os.close(master)

    def report(self, msg: dict, close: bool = True) -> None:
        """Tell the waiting `quark create` how it went; it exits on this line (after an error, once
        this end is closed: `close=False` leaves that to this process's exit)."""
        try:
            os.write(self.c.ready_fd, json.dumps(msg).encode() + b"\n")
        except OSError:
            pass
        if close:
            os.close(self.c.ready_fd)
        self.c.ready_fd = -1

    def abort(self, error: Exception) -> None:
        """A failed create leaves nothing: no process, no cgroup, no state directory."""
        for pid in (self.c.init.pid, self.c.init.stage1_pid) if self.c.init else ():
            if pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        try:
            self.c.cgroup.kill_all(signal.SIGKILL)
        except OSError:
            pass
        while True:
            try:
                os.waitpid(-1, WAIT_ALL)
            except ChildProcessError:
                break
        try:
            self.c.cgroup.destroy()
        except Exception:
            log.exception("destroying cgroup after failed create")
        self.c.store.remove(self.c.state.id)
        # the pipe stays open until this process exits (the caller's os._exit): `quark create`
        # waits for that, so that it returns with nothing of the sandbox left, as runc's does
        self.report({"error": str(error), "kind": getattr(error, "kind", QuarkError.kind)}, close=False)
