"""A pod's supervisor: the sandbox container's supervisor serves the pod's other containers too
(`supervisor: {scope: pod}`, qvisor/pods.py), so a pod costs one supervisor, not one per container.

A supervisor confines itself once its container is created (qvisor/confine.py: no mount, no new
namespaces), so it cannot build the pod's later containers. The sandbox factory's worker that runs
such a container's `quark create` builds it instead, as a supervisor would (create.py, with a loop
of its own), and hands it, once created, to the pod's supervisor through POD_SOCK in the sandbox
container's state directory: the init's channel and a pidfd of it, the control socket, the /proc
view's connection. The supervisor starts the container's QKernel, reports to the waiting `quark
create` and serves the container from then on like its own.

Who reaps that container's init: stage 1 exits once it has forked it, so the init goes to the
nearest child subreaper above the worker, the sandbox factory (qvisor/factory/server.py), which
reaps it. The supervisor learns its exit status from its pidfd (PIDFD_GET_INFO, Linux 6.15+:
reaper.py's watch_exit); on an older kernel every container keeps a supervisor of its own.
Exec'd processes are the supervisor's children, as before. tsord accepts a TSoR registration only
for a process that descends from the supervisor that sends it (tsor/identity.py), so a handed-over
container's registration names the sandbox's init, and only a container in the sandbox's network
namespace is taken (containerd's CRI puts every container of a pod there).

The supervisor takes a hand-over only from a peer that is root with no seccomp filter (no
supervisor, no container process), before it reads a byte of it; what it sends back is JSON.
A container whose needs the supervisor's confinement does not cover (Confinement) is declined and
gets a supervisor of its own.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import socket
import struct
from typing import TYPE_CHECKING

from qlib import linux as L
from qlib import procfs
from qvisor import paths, pods
from qvisor.state import STOPPED

if TYPE_CHECKING:
    from qvisor.birth import SupervisorArgs
    from qvisor.spec import Spec
    from qvisor.supervisor.child import Child
    from qvisor.supervisor.core import Supervisor
    from qvisor.supervisor.served import Served

log = logging.getLogger("quark.supervisor")

MAX_MESSAGE = 1 << 20


@dataclasses.dataclass(frozen=True)
class Confinement:
    """What a supervisor's confinement depends on (confine.confine_supervisor): a container it
    serves must need no more."""
    platform: str
    filter_key: tuple
    kept: frozenset[str]

    @classmethod
    def of(cls, spec: Spec, platform: str) -> Confinement:
        from qvisor import confine
        caps = spec.process.capabilities
        allow_chroot = not spec.linux.new_namespace("mount")
        bounding = frozenset(caps.bounding) if caps is not None else frozenset()
        return cls(platform, confine.filter_key(platform, allow_chroot, bounding, spec.own_namespaces),
                   frozenset(confine.kept_capabilities(caps)))

    def refuses(self, other: Confinement) -> str:
        """Why a container needing `other` cannot be served under this confinement ("" if it can)."""
        if other.platform != self.platform or self.platform != "seccomp":
            return f"platform {other.platform} (the pod's supervisor: {self.platform})"
        if other.filter_key != self.filter_key:
            return "its capabilities and namespaces need another supervisor filter"
        if not other.kept <= self.kept:
            return f"capabilities the pod's supervisor does not hold: {', '.join(sorted(other.kept - self.kept))}"
        return ""


# ---- in the factory's worker that runs `quark create` (birth.start) ---------------------------------

def create_in_pod(args: SupervisorArgs, ready_fd: int) -> bool:
    """Build the container of `args` and hand it to its pod's supervisor, which reports on
    `ready_fd` (or report its failure there ourselves). False, with nothing made, when there is no
    pod supervisor that takes it: the create then gets a supervisor of its own."""
    sandbox = pods.sandbox_of(args.state.id, args.state.annotations)
    if sandbox is None or args.preserve_fds or args.platform != "seccomp" or not L.pidfd_exit_status_supported():
        return False
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        with paths.socket_address(args.store.path(sandbox, pods.POD_SOCK)) as address:
            conn.connect(address)
        conn.send(pickle.dumps({"op": "join", "confinement": Confinement.of(args.spec, args.platform),
                                "netns": _joined_netns(args.spec)}, pickle.HIGHEST_PROTOCOL))
        answer = _answer(conn)
    except OSError as e:   # no such pod supervisor (any more)
        log.debug("pod %s: no supervisor takes containers (%s)", sandbox, e)
        conn.close()
        return False
    if "ok" not in answer:
        log.info("pod %s's supervisor does not serve %s: %s", sandbox, args.state.id, answer.get("declined"))
        conn.close()
        return False
    try:
        _create(args, os.dup(ready_fd), conn)
    finally:
        conn.close()
    return True


def _joined_netns(spec: Spec) -> int | None:
    """The network namespace the container joins (its inode), None when it makes one of its own."""
    ns = spec.linux.namespace("network")
    if ns is not None and not ns.path:
        return None
    try:
        return os.stat(ns.path if ns is not None else "/proc/self/ns/net").st_ino   # (none listed: ours)
    except OSError:
        return None


def _answer(conn: socket.socket) -> dict:
    """The supervisor's answer: JSON only (it is never unpickled here: a subverted supervisor must
    not run code in this unconfined process)."""
    data = conn.recv(4096)
    if not data:
        return {"error": "the pod's supervisor exited"}
    try:
        msg = json.loads(data)
    except ValueError:
        msg = None
    return msg if isinstance(msg, dict) else {"error": "the pod's supervisor answered garbage"}


def _create(args: SupervisorArgs, ready_fd: int, conn: socket.socket) -> None:
    """Build the container as a supervisor would (create.py), with a loop of our own, then hand it
    over; a failure removes what was made and is reported on `ready_fd`."""
    from qlib.eventloop import Loop
    from qvisor import cgroups, phases
    from qvisor.supervisor.context import Container
    from qvisor.supervisor.served import Served
    args.state.supervisor_pid = _peer(conn)[0]
    c = Container(args.store, args.state, args.spec, args.platform,
                  args.cgroup if args.cgroup is not None else cgroups.open_cgroup(args.state.cgroup_path),
                  Loop(), phases.Phases(args.state.id), ready_fd)
    c.phases.mark("verb", phases.verb_started)
    served = Served(c, args.console_socket)
    served.creation.keep_stdio = True   # ours are the caller's: `quark create` still writes to them
    handed = []
    served.creation.hand_over = lambda child: handed.append(_hand_over(served, child, conn, args))
    try:
        served.creation.create()
        while c.in_setup and not handed:
            c.loop.run_once()
    except Exception as e:  # tell `quark create`, and leave nothing behind
        log.debug("create in pod failed", exc_info=True)
        served.creation.abort(e)
        os.close(ready_fd)


def _hand_over(served: Served, child: Child, conn: socket.socket, args: SupervisorArgs) -> bool:
    """The container is created: hand it to the supervisor, which reports to `quark create`; raised
    when it does not take it (create.py's abort then removes what was made)."""
    from qvisor import procview
    c = served.c
    try:
        os.waitpid(child.stage1_pid, 0)   # it exited once it had forked the init
    except ChildProcessError:
        pass
    pidfd = L.pidfd_open(child.pid)   # (a pid reused already would fail the start-time check below)
    view = procview.handed_over(c.cgroup)
    log_to = (args.log_file or args.store.path(args.state.id, "supervisor.log"),
              args.log_format if args.log_file else "text")
    msg = {"op": "take", "store": c.store, "state": c.state, "spec": c.spec, "platform": c.platform,
           "cgroup": c.cgroup, "phases": c.phases, "pid": child.pid, "log": log_to,
           "procview": view[1] if view else None}
    fds = [child.sock.fileno(), served.control.sock.fileno(), pidfd, c.ready_fd] + ([view[0]] if view else [])
    try:
        socket.send_fds(conn, [pickle.dumps(msg, pickle.HIGHEST_PROTOCOL)], fds)
        answer = _answer(conn)
    except OSError as e:
        answer = {"error": str(e)}
    finally:
        os.close(pidfd)
        if view:
            os.close(view[0])
    if "ok" not in answer:
        raise RuntimeError(f"the pod's supervisor did not take the container: {answer.get('error')}")
    # it serves the container and has told `quark create`: our copies go
    c.loop.remove_reader(child.sock.fileno())
    child.sock.close()
    served.control.close()
    os.close(c.ready_fd)
    c.ready_fd = -1
    return True


def _peer(conn: socket.socket) -> tuple[int, int]:
    """SO_PEERCRED's pid and uid: who is on the other end (the kernel says, not the peer)."""
    pid, uid, _ = struct.unpack("=iII", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return pid, uid


# ---- in the supervisor ----------------------------------------------------------------------------

class Pod:
    """The supervisor's side: its socket, and the containers handed over on it."""

    def __init__(self, supervisor: Supervisor) -> None:
        """Bound before the first create (and the confinement); taken from once it is created (open)."""
        c = supervisor.first.c
        self.supervisor = supervisor
        self.confinement = Confinement.of(c.spec, c.platform)
        self.path = c.store.path(c.state.id, pods.POD_SOCK)
        self.clients: dict[int, socket.socket] = {}
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        try:
            with paths.socket_address(self.path) as address:
                s.bind(address)
            os.chmod(self.path, 0o600)
            s.listen(16)
        except BaseException:
            s.close()
            raise
        self.listener = s

    def open(self) -> None:
        """The sandbox container is created: take the pod's other containers from now on."""
        self.supervisor.loop.add_reader(self.listener.fileno(), self._accept)

    def close(self) -> None:
        """No more containers: the socket goes."""
        try:
            os.unlink(self.path)
        except OSError:
            pass
        loop = self.supervisor.loop
        for conn in [self.listener, *self.clients.values()]:
            if loop.has_reader(conn.fileno()):
                loop.remove_reader(conn.fileno())
            conn.close()
        self.clients.clear()

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        why = peer_may_hand_over(conn)
        if why:
            log.warning("pod: refused a connection: %s", why)
            return conn.close()
        conn.setblocking(True)
        self.clients[conn.fileno()] = conn
        self.supervisor.loop.add_reader(conn.fileno(), lambda: self._on_client(conn))

    def _drop(self, conn: socket.socket) -> None:
        self.supervisor.loop.remove_reader(conn.fileno())
        self.clients.pop(conn.fileno(), None)
        conn.close()

    def _on_client(self, conn: socket.socket) -> None:
        try:
            data, fds, flags, _ = socket.recv_fds(conn, MAX_MESSAGE, 8)
        except OSError:
            return self._drop(conn)
        for fd in fds:
            os.set_inheritable(fd, False)   # (SCM_RIGHTS gives them without O_CLOEXEC)
        if not data:
            for fd in fds:
                os.close(fd)
            return self._drop(conn)
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            for fd in fds:
                os.close(fd)
            return self._drop(conn)
        msg = pickle.loads(data)   # from unconfined root only (peer_may_hand_over)
        if msg.get("op") == "join":
            why = self._refuses(msg)
            return _send(conn, {"declined": why} if why else {"ok": True})
        if msg.get("op") != "take" or len(fds) < 4:
            for fd in fds:
                os.close(fd)
            return self._drop(conn)
        self._take(conn, msg, fds)

    def _sandbox_init(self) -> int:
        """The running sandbox container's init (0: it is stopped)."""
        first = self.supervisor.first
        running = self.supervisor.served.get(first.c.state.id) is first and first.c.state.status != STOPPED
        return first.c.init.pid if running and first.c.init is not None else 0

    def _refuses(self, msg: dict) -> str:
        """Why a container that asks to join cannot be served here ("" if it can). It must be in
        the sandbox's network namespace: its TSoR registration names the sandbox's init, a child of
        ours, as tsord asks (tsor/identity.py), where its own init is the factory's."""
        sandbox = self._sandbox_init()
        if not sandbox:
            return "the pod's sandbox container is stopped"
        try:
            netns = os.stat(f"/proc/{sandbox}/ns/net").st_ino
        except OSError:
            return "the pod's sandbox container is stopped"
        if msg.get("netns") != netns:
            return "it does not join the network namespace of the pod's sandbox"
        return self.confinement.refuses(msg["confinement"])

    def _take(self, conn: socket.socket, msg: dict, fds: list[int]) -> None:
        init_sock, control_sock = socket.socket(fileno=fds[0]), socket.socket(fileno=fds[1])
        pidfd, ready_fd, rest = fds[2], fds[3], fds[4:]
        try:
            served = self._take_on(msg, init_sock, control_sock, pidfd, ready_fd, rest)
        except Exception as e:  # noqa: BLE001 - the worker is told, and removes what it made
            log.exception("pod: taking on a container")
            for obj in (init_sock, control_sock):
                obj.close()
            for fd in (pidfd, ready_fd, *rest):
                os.close(fd)
            return _send(conn, {"error": str(e)})
        _send(conn, {"ok": True})
        served.creation.report({"ok": True, "pid": served.c.init.pid})

    def _take_on(self, msg: dict, init_sock: socket.socket, control_sock: socket.socket, pidfd: int,
                 ready_fd: int, rest: list[int]) -> Served:
        from qvisor import logfile, phases, procview
        from qvisor.supervisor import child as children
        from qvisor.supervisor.child import Child
        from qvisor.supervisor.context import Container, ContainerLoop
        from qvisor.supervisor.served import Served
        state = msg["state"]
        pid = msg["pid"]
        if procfs.start_time(pid) != state.pid_start_time or int(procfs.fdinfo(pidfd).get("Pid", "0")) != pid:
            raise RuntimeError(f"container init {pid} exited before the pod's supervisor took it on")
        c = Container(msg["store"], state, msg["spec"], msg["platform"], msg["cgroup"],
                      ContainerLoop(self.supervisor.loop, state.id), msg["phases"] or phases.Phases(state.id), ready_fd)
        logfile.route(state.id, *msg["log"])   # its records in its own log, as with a supervisor of its own
        served = Served(c)
        c.init = Child(init_sock, served.creation.on_init_msg, pid=pid)
        if msg.get("procview") and rest:
            procview.adopt(c.loop, c.cgroup, pid, state.pid_start_time, rest[0], msg["procview"])
        sandbox = self._sandbox_init()
        if not sandbox:
            raise RuntimeError("the pod's sandbox container stopped")
        served.creation.start_kernel(pid, tsor_pid=sandbox)
        served.control.serve(control_sock)
        init_sock.setblocking(True)
        children.watch(c.loop, c.init)
        served.reaper.watch_exit(pid, pidfd)   # the factory reaps it; its status comes from the pidfd
        self.supervisor.serve(served)
        log.info("serving container %s of the pod (init %d)", state.id, pid)
        return served


def _send(conn: socket.socket, msg: dict) -> None:
    try:
        conn.send(json.dumps(msg).encode())
    except OSError:
        pass


def peer_may_hand_over(conn: socket.socket) -> str:
    """Why the peer may not hand containers over ("" if it may): only root with no seccomp filter,
    which no supervisor and no container process is."""
    pid, uid = _peer(conn)
    if uid != 0:
        return f"uid {uid} is not root"
    try:
        seccomp = procfs.status(pid).get("Seccomp")
    except OSError:
        return "the caller is gone"
    if seccomp != "0":
        return "a confined process may not hand containers over"
    return ""
