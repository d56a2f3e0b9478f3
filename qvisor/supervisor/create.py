"""Creating the container (part of Supervisor, core.py): fork the init's stage 1, put it in its
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

from qlib.errors import QuarkError, SetupError, from_kind
from qvisor import channel, confine, hooks, rootfs, sandbox
from qlib import procfs
from qvisor.devices import cgroup_resources
from qvisor.state import CREATED
from qvisor.supervisor.child import Child, child_log
from qvisor.supervisor.reaper import WAIT_ALL

log = logging.getLogger("quark.supervisor")


class CreateMixin:
    """Creating the container: the init and its set-up (part of Supervisor, core.py)."""

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
        self.init = Child(parent, self._on_init_msg, stage1_pid=pid)
        # the container's stdio now live in stage 1 and the init; ours go to /dev/null so that
        # a caller reading them sees EOF when the container, not the runtime, closes them
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.close(null)
        self.cgroup.add_pid(pid)
        channel.send(parent, {"type": "go"})
        self.loop.add_reader(parent.fileno(), lambda: self._on_child_readable(self.init))

    def _hook_state(self) -> dict:
        return self.state.oci() | {"status": self.state.status, "pid": self.state.pid}

    def _on_init_msg(self, child: Child, msg: dict, fds: list[int]) -> None:
        kind = msg.get("type")
        if kind == "log":
            return child_log(msg)
        if kind == "userns":
            self._write_id_maps(child.stage1_pid)
            channel.send(child.sock, {"type": "userns-ok"})
        elif kind == "pid":
            self.phases.mark("namespaces", msg.get("t"))   # stage 1 unshared them and forked the init
            child.pid = msg["pid"]
            self.state.pid = child.pid
            self.state.pid_start_time = procfs.start_time(child.pid) or 0
            if self.caller_reaps:
                self._watch_exit(child.pid)
            # the init builds its rootfs from here on: what we set up meanwhile (QKernel, the /proc
            # view it will ask for) runs beside it, not before it, so create does not wait for it
            self._send_prepare(child)
            self._start_kernel(child.pid)
            self._make_procview(child)
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
            self.phases.mark("rootfs", msg.get("t"))   # the init's mounts, pivot, ... are done
            self.state.status = CREATED
            self.store.save(self.state)
            self._open_control()
            # from here on the supervisor serves the container: hold only what that needs (before
            # the report: if this fails, create fails and leaves nothing; it costs create a
            # little time, within "create: state saved, control socket, supervisor confined" of
            # bench/README.md, "Start-up and supervisor memory")
            confine.confine_supervisor(self.platform, self.spec.process.capabilities,
                                       allow_chroot=not self.spec.linux.new_namespace("mount"),
                                       own_namespaces=self.spec.own_namespaces)
            self.phases.mark("created")
            self.phases.write()
            self._report({"ok": True, "pid": child.pid})
        elif kind == "listener":
            self.phases.mark("filter", msg.get("t"))   # the init installed its seccomp filters
            self.kernel.serve_listener(fds[0])
        elif kind == "error":
            if self.ready_fd >= 0:
                raise from_kind(msg.get("kind"), msg["error"])
            self._start_done(from_kind(msg.get("kind"), msg["error"]))
        elif kind == "eof":
            if self.ready_fd >= 0:
                raise RuntimeError("container init exited during set-up")
            if self.pending_start is not None:
                self.phases.mark("exec")   # the channel closed on exec
                self.phases.write()
                self._start_done(None)

    def _send_prepare(self, child: Child) -> None:
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

    def _make_procview(self, child: Child) -> None:
        """Make the container's /proc view (qvisor/procview.py) before the init asks for it, when it
        will (the init's own test: rootfs.procview_wanted in a new mount namespace)."""
        if not (self.spec.linux.new_namespace("mount") and rootfs.procview_wanted(self.spec)):
            return
        from qvisor import procview
        try:
            self.procview_mnt = procview.serve(self.loop, self.cgroup, child.pid, self.state.pid_start_time)
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
        for name, maps in (("uid_map", self.spec.linux.uid_mappings), ("gid_map", self.spec.linux.gid_mappings)):
            text = "".join(f"{m.container_id} {m.host_id} {m.size}\n" for m in maps)
            with open(f"/proc/{pid}/{name}", "w") as f:
                f.write(text)

    def _start_kernel(self, init_pid: int) -> None:
        import qkernel
        from qvisor import procview
        ctx = qkernel.SandboxContext(container_id=self.state.id, init_pid=init_pid,
                                     sysinfo=functools.partial(procview.sysinfo, self.cgroup, init_pid))
        self.kernel = qkernel.Kernel(self.loop, self.platform, ctx)
        if self.platform == "ptrace":
            self.kernel.attach(init_pid)   # no fd installation there, so no TSoR: sockets stay native
        elif self.kernel.can_install_fds:
            # TSoR: register with the node's tsord (None: no tsord socket, or the host's network)
            from tsor.intercept import SocketIntercept
            ctx.tsor = SocketIntercept.attach(self.loop, self.state.id, init_pid, self.cgroup.pids,
                                              self.spec.annotations)

    def _socket_filter(self) -> dict[str, bool]:
        """What the container's filter traps of the socket family (the start message's fields):
        `sockets` only for a sandbox TSoR serves with the socketpair local path (a sandbox without
        TSoR, or with tsord's sockmap path, tsor/sockmap.py, pays nothing for sockets);
        `sockopt_offload` when the kernel answers TCP_NODELAY/TCP_CORK of its local-path sockets
        (tsor/sockopt_offload.py), so setsockopt of those is not trapped either; `sockmap` for a
        sandbox of the sockmap path, whose shutdown(SHUT_WR) waits for its FIN's acknowledgement."""
        tsor = self.kernel.context.tsor if self.kernel is not None else None
        sockets = tsor is not None and tsor.traps_sockets
        return {"sockets": sockets, "sockopt_offload": sockets and tsor.offload is not None,
                "sockmap": tsor is not None and not sockets}

    def _forward_console(self, master: int, name: str) -> None:
        """Send the pty master to --console-socket (runc's protocol: one fd with the pty name)."""
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(self.console_socket)
                socket.send_fds(s, [name.encode() or b"/dev/ptmx"], [master])
        finally:
            os.close(master)

    def _report(self, msg: dict, close: bool = True) -> None:
        """Tell the waiting `quark create` how it went; it exits on this line (after an error, once
        this end is closed: `close=False` leaves that to this process's exit)."""
        try:
            os.write(self.ready_fd, json.dumps(msg).encode() + b"\n")
        except OSError:
            pass
        if close:
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
                os.waitpid(-1, WAIT_ALL)
            except ChildProcessError:
                break
        try:
            self.cgroup.destroy()
        except Exception:
            log.exception("destroying cgroup after failed create")
        self.store.remove(self.state.id)
        # the pipe stays open until this process exits (the caller's os._exit): `quark create`
        # waits for that, so that it returns with nothing of the sandbox left, as runc's does
        self._report({"error": str(error), "kind": getattr(error, "kind", QuarkError.kind)}, close=False)
